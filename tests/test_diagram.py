"""The generated state diagrams show exactly the edges of the real tables, and follow them."""

from __future__ import annotations

import re
from types import MappingProxyType

import pytest

import kvfsm.diagram
from kvfsm.diagram import main, mermaid, mermaid_all
from kvfsm.states import TABLES, TERMINAL, KVPoll, PeerSettled, Role

EDGE = re.compile(r"^    (\w+) --> (\w+) : (\w+)$")


def parsed_edges(text: str) -> list[tuple[str, str, str]]:
    return [
        (m.group(1), m.group(2), m.group(3))
        for line in text.splitlines()
        if (m := EDGE.match(line))
    ]


def table_edges(role: Role) -> set[tuple[str, str, str]]:
    return {
        (source.name, target.name, event.__name__)
        for source, row in TABLES[role].items()
        for event, target in row.items()
    }


@pytest.mark.parametrize("role", list(Role))
def test_every_table_edge_appears_exactly_once(role: Role) -> None:
    found = parsed_edges(mermaid(role))
    assert len(found) == len(set(found))
    assert set(found) == table_edges(role)
    assert len(found) == sum(len(row) for row in TABLES[role].values())


@pytest.mark.parametrize("role", list(Role))
def test_start_terminals_and_no_edge_out_of_a_terminal(role: Role) -> None:
    text = mermaid(role)
    lines = text.splitlines()
    assert lines[0] == "stateDiagram-v2"
    assert "    [*] --> Bootstrapping" in lines
    for state in TERMINAL:
        assert f"    {state.name} --> [*]" in lines
    assert not [e for e in parsed_edges(text) if e[0] in {"Success", "Failed"}]
    assert "    Transferring --> [*]" not in lines
    # self-edges are drawn too
    assert any(source == target for source, target, _ in parsed_edges(text))


def test_role_by_value_and_both_roles() -> None:
    assert mermaid("sender") == mermaid(Role.SENDER)
    text = mermaid_all()
    assert text.count("```mermaid\nstateDiagram-v2") == 2
    assert mermaid(Role.SENDER) in text
    assert mermaid(Role.RECEIVER) in text
    assert "sender (prefill)" in text
    assert "receiver (decode)" in text


def test_output_follows_the_table(monkeypatch: pytest.MonkeyPatch) -> None:
    before, sender = mermaid(Role.RECEIVER), mermaid(Role.SENDER)
    table = {state: dict(row) for state, row in TABLES[Role.RECEIVER].items()}
    table[KVPoll.Transferring][PeerSettled] = KVPoll.Transferring
    del table[KVPoll.WaitingForInput][next(iter(table[KVPoll.WaitingForInput]))]
    tables = dict(TABLES)
    tables[Role.RECEIVER] = MappingProxyType(
        {state: MappingProxyType(row) for state, row in table.items()}
    )
    monkeypatch.setattr(kvfsm.diagram, "TABLES", MappingProxyType(tables))
    after = mermaid(Role.RECEIVER)
    assert after != before
    assert "    Transferring --> Transferring : PeerSettled" in after
    assert "    WaitingForInput --> Transferring : MetadataSubmitted" not in after
    assert mermaid(Role.SENDER) == sender  # the untouched role is unchanged


def test_main_prints_both(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 0
    assert capsys.readouterr().out == mermaid_all() + "\n"
    assert main(["--role", "receiver"]) == 0
    assert capsys.readouterr().out == mermaid(Role.RECEIVER) + "\n"


def test_the_readme_shows_the_diagrams_of_the_real_tables() -> None:
    from pathlib import Path

    from kvfsm.diagram import mermaid_all

    readme = (Path(__file__).parent.parent / "README.md").read_text()
    start = readme.index("<!-- diagram:start")
    body = readme[readme.index("-->", start) + 3 : readme.index("<!-- diagram:end -->")]
    expected = mermaid_all().replace("## ", "### ")
    assert body.strip() == expected.strip(), "README diagram is stale: rerun `kvfsm diagram`"
