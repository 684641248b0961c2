"""The Grafana dashboard (``docs/grafana/kvfsm.json``) and the Prometheus alert rules
(``docs/prometheus/alerts.yml``) against what a real prefill-decode pair serves on ``/metrics``.

Every metric their PromQL names is in the scrape of one side or the other, and every label they
select, group or match by is on that metric there (``job`` and ``instance`` are Prometheus's
target labels, added when it scrapes). Their structure is checked in Python; where promtool is
installed (``./dev.sh`` sets it up where it can), its rule checker parses every expression and its
rule tests fire each alert on made-up series, and none on the pair's own scrape held still."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers.observed_pair import get_text, observed_pair

_REPO = Path(__file__).resolve().parent.parent
DASHBOARD = _REPO / "docs" / "grafana" / "kvfsm.json"
ALERTS = _REPO / "docs" / "prometheus" / "alerts.yml"

#: The alerts docs/operations.md describes.
ALERT_NAMES = {"KvfsmRoomWedged", "KvfsmFailuresRising", "KvfsmPeerDown", "KvfsmUnexpectedErrors"}
#: Labels Prometheus adds to every series it scrapes.
TARGET_LABELS = frozenset({"job", "instance"})
#: Grafana's own variables, as Prometheus would see them once Grafana has put them in.
GRAFANA_VARIABLES = {"$__rate_interval": "5m", "$instance": ".*", "$job": ".*"}

_NAME = re.compile(r"\bkvfsm_\w+")
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'')
_SELECTOR = re.compile(r"\b(kvfsm_\w+)\s*\{([^}]*)\}")
_MATCHER = re.compile(r"(\w+)\s*(?:=~|!~|!=|=)")
_CLAUSE = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\(([^()]*)\)")
_RANGE = re.compile(r"\[([^\]]*)\]")
_DURATION = re.compile(r"^(?:\d+y)?(?:\d+w)?(?:\d+d)?(?:\d+h)?(?:\d+m)?(?:\d+s)?(?:\d+ms)?$")
_LEGEND_LABEL = re.compile(r"\{\{\s*(\w+)\s*\}\}")
_TEMPLATE_LABEL = re.compile(r"\$labels\.(\w+)")


# -- the pair's scrape ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Scrape:
    #: Each side's samples: (name, labels, value), as served.
    samples: dict[str, list[tuple[str, dict[str, str], float]]]

    def labels(self) -> dict[str, set[str]]:
        """Every sample name either side serves, with the label names it has there."""
        out: dict[str, set[str]] = {}
        for rows in self.samples.values():
            for name, labels, _ in rows:
                out.setdefault(name, set()).update(labels)
        return out


def parse(text: str) -> list[tuple[str, dict[str, str], float]]:
    return [
        (sample.name, dict(sample.labels), sample.value)
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    ]


@pytest.fixture(scope="module")
def scrape() -> Iterator[Scrape]:
    # Some series appear only once measured (a link's heartbeat round trip, after its first
    # heartbeats): scraped again, a few times a second, until every name in use is there or a
    # few seconds have gone; what is missing then is missing.
    used = {name for _, expr in expressions() for name in names(expr)}
    with observed_pair() as pair:
        deadline = time.monotonic() + 10
        while True:
            scraped = Scrape(
                {
                    "prefill": parse(get_text(pair.prefill_url + "/metrics")),
                    "decode": parse(get_text(pair.decode_url + "/metrics")),
                }
            )
            if used <= set(scraped.labels()) or time.monotonic() > deadline:
                break
            time.sleep(0.25)
        yield scraped


# -- the PromQL in the dashboard and the rules ----------------------------------------------------


def dashboard() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return loaded


def all_panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in panels:
        yield panel
        yield from all_panels(panel.get("panels", []))


def dashboard_targets() -> list[tuple[str, dict[str, Any]]]:
    """(where, target) of every query on the dashboard."""
    return [
        (f"panel {panel['id']} {panel['title']!r} {target.get('refId')}", target)
        for panel in all_panels(dashboard()["panels"])
        for target in panel.get("targets", [])
    ]


def variable_queries() -> list[tuple[str, str]]:
    out = []
    for variable in dashboard()["templating"]["list"]:
        if variable["type"] == "query":
            query = variable["query"]
            out.append((f"variable {variable['name']}", query["query"]))
    return out


def rules() -> list[dict[str, Any]]:
    loaded = yaml.safe_load(ALERTS.read_text())
    return [rule for group in loaded["groups"] for rule in group["rules"]]


def expressions() -> list[tuple[str, str]]:
    """(where, PromQL) of everything the dashboard and the rules ask Prometheus."""
    exprs = [(where, str(target["expr"])) for where, target in dashboard_targets()]
    exprs += variable_queries()
    exprs += [(f"alert {rule['alert']}", str(rule["expr"])) for rule in rules()]
    return exprs


def unquoted(expr: str) -> str:
    """The expression with every string literal emptied (a regex or a label value may hold
    anything, metric-like names and brackets included)."""
    return _STRING.sub('""', expr)


def names(expr: str) -> list[str]:
    return _NAME.findall(unquoted(expr))


def balanced(expr: str) -> bool:
    pairs = {")": "(", "]": "[", "}": "{"}
    stack: list[str] = []
    for char in unquoted(expr):
        if char in "([{":
            stack.append(char)
        elif char in pairs and (not stack or stack.pop() != pairs[char]):
            return False
    return not stack


def group_after(text: str, start: int) -> str | None:
    """The balanced ``(...)`` that starts at ``text[start:]`` after blanks, if one does."""
    i = start
    while i < len(text) and text[i].isspace():
        i += 1
    if i >= len(text) or text[i] != "(":
        return None
    depth = 0
    for j in range(i, len(text)):
        depth += {"(": 1, ")": -1}.get(text[j], 0)
        if depth == 0:
            return text[i : j + 1]
    return None


def group_before(text: str, end: int) -> str | None:
    """The balanced ``(...)`` that ends just before ``text[:end]`` (blanks aside), if one does
    (``sum(x) by (l)``)."""
    i = end - 1
    while i >= 0 and text[i].isspace():
        i -= 1
    if i < 0 or text[i] != ")":
        return None
    depth = 0
    for j in range(i, -1, -1):
        depth += {")": 1, "(": -1}.get(text[j], 0)
        if depth == 0:
            return text[j : i + 1]
    return None


@dataclass(frozen=True)
class Clause:
    keyword: str
    labels: tuple[str, ...]
    #: The metrics the clause's labels are about: the aggregation's argument for by/without,
    #: the whole expression for vector matching.
    scope: tuple[str, ...]


def clauses(expr: str) -> list[Clause]:
    text = unquoted(expr)
    out = []
    for match in _CLAUSE.finditer(text):
        keyword = match.group(1)
        labels = tuple(label.strip() for label in match.group(2).split(",") if label.strip())
        if keyword in {"by", "without"}:
            argument = group_after(text, match.end())
            if argument is None:
                argument = group_before(text, match.start())
            assert argument is not None, f"no aggregation argument for {match.group(0)} in {expr}"
            scope = tuple(_NAME.findall(argument))
        else:
            scope = tuple(_NAME.findall(text))
        out.append(Clause(keyword, labels, scope))
    return out


def result_labels(expr: str, scraped: dict[str, set[str]]) -> set[str]:
    """The labels the expression's result may carry: those of its innermost grouping clause if it
    aggregates with ``by`` (the ones every ``by`` keeps), else its metrics' and the target's."""
    kept = [set(c.labels) for c in clauses(expr) if c.keyword == "by"]
    if kept:
        return set.intersection(*kept)
    out = set(TARGET_LABELS)
    for name in names(expr):
        out |= scraped.get(name, set())
    return out


# -- the metrics and labels exist -----------------------------------------------------------------


def test_every_metric_the_dashboard_and_the_alerts_use_is_served(scrape: Scrape) -> None:
    served = scrape.labels()
    used: dict[str, list[str]] = {}
    for where, expr in expressions():
        assert names(expr), f"{where}: no kvfsm metric in {expr!r}"
        for name in names(expr):
            used.setdefault(name, []).append(where)
    missing = {name: wheres for name, wheres in used.items() if name not in served}
    assert not missing, "not in either side's /metrics: " + "; ".join(
        f"{name} (used by {', '.join(wheres)})" for name, wheres in sorted(missing.items())
    )


def test_every_label_they_select_or_group_by_is_on_its_metric(scrape: Scrape) -> None:
    served = scrape.labels()
    problems = []
    for where, expr in expressions():
        problems.extend(
            f"{where}: {name} has no label {label!r}"
            for name, matchers in _SELECTOR.findall(unquoted(expr))
            for label in _MATCHER.findall(matchers)
            if label not in served.get(name, set()) | TARGET_LABELS
        )
        for clause in clauses(expr):
            for label in clause.labels:
                if label in TARGET_LABELS:
                    continue
                carried = [label in served.get(name, set()) for name in clause.scope]
                if clause.keyword in {"group_left", "group_right"}:
                    ok = any(carried)
                else:
                    ok = bool(carried) and all(carried)
                if not ok:
                    problems.append(f"{where}: {clause.keyword} ({label}) over {clause.scope}")
    assert not problems, "\n".join(problems)


def test_legends_and_annotations_name_labels_their_query_keeps(scrape: Scrape) -> None:
    served = scrape.labels()
    problems = []
    for where, target in dashboard_targets():
        keeps = result_labels(str(target["expr"]), served)
        problems.extend(
            f"{where}: legend names {label!r}, the query keeps {keeps}"
            for label in _LEGEND_LABEL.findall(str(target.get("legendFormat", "")))
            if label not in keeps
        )
    for rule in rules():
        keeps = result_labels(str(rule["expr"]), served)
        problems.extend(
            f"{rule['alert']}: $labels.{label}, the rule keeps {keeps}"
            for text in rule["annotations"].values()
            for label in _TEMPLATE_LABEL.findall(str(text))
            if label not in keeps
        )
    assert not problems, "\n".join(problems)


def test_what_the_alerts_watch_is_on_the_dashboard() -> None:
    shown = {
        name for where, expr in expressions() if where.startswith("panel") for name in names(expr)
    }
    for rule in rules():
        assert set(names(str(rule["expr"]))) <= shown, rule["alert"]


# -- structure ------------------------------------------------------------------------------------


def test_every_expression_is_balanced_and_its_ranges_are_durations() -> None:
    for where, expr in expressions():
        assert balanced(expr), f"{where}: unbalanced brackets in {expr!r}"
        for written in _RANGE.findall(unquoted(expr)):
            window = GRAFANA_VARIABLES.get(written, written)
            assert window, f"{where}: an empty range"
            assert _DURATION.match(window), f"{where}: range [{written}]"


def test_the_dashboard_is_a_grafana_model_on_a_chosen_prometheus() -> None:
    model = dashboard()
    assert model["schemaVersion"] >= 36
    assert model["uid"]
    assert model["title"]
    variables = {v["name"]: v for v in model["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for name in ("job", "instance"):
        assert variables[name]["type"] == "query"
        assert variables[name]["datasource"]["uid"] == "${datasource}"
    panels = list(all_panels(model["panels"]))
    ids = [panel["id"] for panel in panels]
    assert len(ids) == len(set(ids)), f"panel ids repeat: {ids}"
    boxes = []
    for panel in panels:
        grid = panel["gridPos"]
        assert all(isinstance(grid[k], int) for k in "hwxy"), panel["title"]
        assert min(grid["w"], grid["h"]) > 0, panel["title"]
        assert 0 <= grid["x"] <= grid["x"] + grid["w"] <= 24, panel["title"]
        boxes.append((panel["title"], grid))
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        targets = panel["targets"]
        assert targets, f"{panel['title']}: no query"
        refs = [target["refId"] for target in targets]
        assert len(refs) == len(set(refs)), panel["title"]
        for target in targets:
            assert target["datasource"]["uid"] == "${datasource}", panel["title"]
            # Every metric is read for the chosen job and instances.
            expr = str(target["expr"])
            selectors = _SELECTOR.findall(expr)
            assert len(selectors) == len(names(expr)), f"{panel['title']}: a bare metric"
            for _, matchers in selectors:
                assert 'job=~"$job"' in matchers, expr
                assert 'instance=~"$instance"' in matchers, expr
    for i, (title, a) in enumerate(boxes):
        for other, b in boxes[i + 1 :]:
            apart = (
                a["x"] + a["w"] <= b["x"]
                or b["x"] + b["w"] <= a["x"]
                or a["y"] + a["h"] <= b["y"]
                or b["y"] + b["h"] <= a["y"]
            )
            assert apart, f"{title!r} overlaps {other!r}"


def test_the_alert_rules_are_prometheus_rule_groups() -> None:
    loaded = yaml.safe_load(ALERTS.read_text())
    assert set(loaded) == {"groups"}
    seen = []
    for group in loaded["groups"]:
        assert group["name"], group
        assert group["rules"], group
        for rule in group["rules"]:
            assert set(rule) <= {"alert", "expr", "for", "labels", "annotations"}, rule
            seen.append(rule["alert"])
            assert isinstance(rule["expr"], str), rule["alert"]
            assert rule["expr"].strip(), rule["alert"]
            if "for" in rule:
                assert _DURATION.match(str(rule["for"])), f"{rule['alert']}: for {rule['for']}"
            assert rule["labels"]["severity"] in {"critical", "warning", "info"}, rule["alert"]
            annotations = rule["annotations"]
            for key in ("summary", "description"):
                text = str(annotations[key])
                assert text.strip(), f"{rule['alert']}: empty {key}"
                assert text.count("{{") == text.count("}}"), f"{rule['alert']}: {key}"
            # It tells the operator where to look first.
            assert "`kvfsm " in annotations["description"], rule["alert"]
    assert sorted(seen) == sorted(ALERT_NAMES)


# -- promtool, where it is installed --------------------------------------------------------------


def promtool() -> str:
    found = shutil.which("promtool")
    beside = Path(sys.executable).parent / "promtool"  # where ./dev.sh puts it
    if found is None and beside.is_file():
        found = str(beside)
    if found is None:
        pytest.skip("promtool is not installed (./dev.sh sets it up where apt-get can fetch it)")
    return found


def run_promtool(*args: str) -> None:
    done = subprocess.run(
        [promtool(), *args], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, f"promtool {' '.join(args)}:\n{done.stdout}{done.stderr}"


def test_promtool_checks_the_rules() -> None:
    run_promtool("check", "rules", str(ALERTS))


def test_promtool_parses_every_dashboard_query(tmp_path: Path) -> None:
    recorded = []
    for where, written in expressions():
        expr = written
        for variable, value in GRAFANA_VARIABLES.items():
            expr = expr.replace(variable, value)
        if where.startswith("variable"):
            # label_values(metric, label) is Grafana's; Prometheus gets the metric's series.
            expr = re.sub(r"label_values\((.*),\s*\w+\)$", r"\1", expr)
        recorded.append({"record": f"dashboard:query_{len(recorded)}", "expr": expr})
    path = tmp_path / "dashboard_queries.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": recorded}]}))
    run_promtool("check", "rules", str(path))


def series(name: str, labels: dict[str, str], values: str) -> dict[str, str]:
    inner = ",".join(f"{key}={json.dumps(value)}" for key, value in sorted(labels.items()))
    return {"series": f"{name}{{{inner}}}", "values": values}


def alerts_at(when: str, alertname: str, *fired: dict[str, str]) -> dict[str, Any]:
    severity = {rule["alert"]: rule["labels"]["severity"] for rule in rules()}[alertname]
    return {
        "eval_time": when,
        "alertname": alertname,
        "exp_alerts": [{"exp_labels": {**labels, "severity": severity}} for labels in fired],
    }


def run_rule_tests(tmp_path: Path, tests: list[dict[str, Any]]) -> None:
    # The rules without their annotations: promtool's rule tests compare annotations too, and
    # `promtool check rules` has already parsed their templates.
    loaded = yaml.safe_load(ALERTS.read_text())
    for group in loaded["groups"]:
        for rule in group["rules"]:
            rule.pop("annotations", None)
    (tmp_path / "alerts.yml").write_text(yaml.safe_dump(loaded))
    spec = {"rule_files": ["alerts.yml"], "evaluation_interval": "1m", "tests": tests}
    (tmp_path / "tests.yml").write_text(yaml.safe_dump(spec, sort_keys=False))
    run_promtool("test", "rules", str(tmp_path / "tests.yml"))


def test_promtool_fires_each_alert_on_its_fault_and_not_beside_it(tmp_path: Path) -> None:
    target = {"job": "kvfsm", "instance": "decode-0:9000"}
    waiting = {**target, "role": "receiver", "state": "WaitingForInput"}
    moving = {**target, "role": "sender", "state": "Transferring"}
    lost = {**target, "role": "sender", "kind": "peer lost"}
    burst = {**target, "role": "sender", "kind": "deadline expired"}
    aborts = {**target, "role": "receiver", "kind": "aborted (local)"}
    restarted = {**target, "peer_role": "prefill", "peer_rank": "0"}
    gone = {**target, "peer_role": "prefill", "peer_rank": "1"}
    run_rule_tests(
        tmp_path,
        [
            {
                "interval": "1m",
                "input_series": [
                    # A receiver wedged in WaitingForInput (deadline 300 s): past 600 s at 11m.
                    series("kvfsm_oldest_room_age_seconds", waiting, "0+60x30"),
                    series("kvfsm_state_deadline_seconds", waiting, "300x30"),
                    # Senders that keep moving (deadline 120 s): never past 240 s.
                    series("kvfsm_oldest_room_age_seconds", moving, "0 100 200 0 100 200 0+10x20"),
                    series("kvfsm_state_deadline_seconds", moving, "120x30"),
                    # 0.2/s of "peer lost" from the start (its 5-minute rate is over 0.1/s
                    # from 3m: firing at 13m); one burst of 100 deadlines at 5m (over 0.1/s
                    # for under 10 minutes: never firing); 1/s of the callers' own aborts.
                    series("kvfsm_failures_total", lost, "0+12x30"),
                    series("kvfsm_failures_total", burst, "0x5 100x25"),
                    series("kvfsm_failures_total", aborts, "0+60x30"),
                    # Prefill rank 0 restarts at 3m (a new incarnation up); rank 1 is gone.
                    series("kvfsm_peer_up", {**restarted, "incarnation": "1"}, "1x3 0x27"),
                    series("kvfsm_peer_up", {**restarted, "incarnation": "2"}, "_x3 1x27"),
                    series("kvfsm_peer_up", {**gone, "incarnation": "7"}, "1x3 0x27"),
                    # One unexpected error at 6m.
                    series("kvfsm_control_unexpected_errors_total", target, "0x5 1x25"),
                ],
                "alert_rule_test": [
                    alerts_at("10m", "KvfsmRoomWedged"),
                    alerts_at("15m", "KvfsmRoomWedged", waiting),
                    alerts_at("9m", "KvfsmFailuresRising"),
                    alerts_at("16m", "KvfsmFailuresRising", lost),
                    alerts_at("25m", "KvfsmFailuresRising", lost),
                    alerts_at("3m", "KvfsmPeerDown"),
                    alerts_at("10m", "KvfsmPeerDown", gone),
                    alerts_at("5m", "KvfsmUnexpectedErrors"),
                    alerts_at("8m", "KvfsmUnexpectedErrors", target),
                    alerts_at("25m", "KvfsmUnexpectedErrors"),
                ],
            }
        ],
    )


def test_promtool_fires_nothing_on_the_pairs_scrape_held_still(
    scrape: Scrape, tmp_path: Path
) -> None:
    held = [
        series(name, {**labels, "job": "kvfsm", "instance": side}, f"{value!r}x40")
        for side, rows in scrape.samples.items()
        for name, labels, value in rows
        if not name.endswith("_created")
    ]
    run_rule_tests(
        tmp_path,
        [
            {
                "interval": "1m",
                "input_series": held,
                "alert_rule_test": [alerts_at("35m", name) for name in sorted(ALERT_NAMES)],
            }
        ],
    )
