#!/usr/bin/env bash
# One entry point for people and CI. Each command sets up what it needs on a fresh machine
# (a virtualenv in .venv with kvfsm installed editable), then runs:
#
#   ./dev.sh main     the main job (kvfsm demo): a prefill-decode pair moving real KV over NIXL
#   ./dev.sh test     the test suite
#   ./dev.sh lint     ruff and mypy (strict on kvfsm/)
#   ./dev.sh bench    the benchmarks (all of benchmarks/, about 15 minutes; NAME... some)
#
# Extra arguments go to the underlying command (kvfsm run / pytest), or name the benchmarks to
# run. The set-up prints one line per step; pip's output goes to $VENV/kvfsm-setup.log.
# VENV=path and PYTHON=exe choose another virtualenv and the interpreter that creates it
# (defaults .venv, python3).
set -euo pipefail
cd "$(dirname "$0")"

PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}

# What the set-up prints: one line per step on stderr, nothing from pip. pip's own output (its
# progress, and the dozens of "WARNING: Location ... is ignored" lines these machines' find-links
# give it) goes to a log in the virtualenv, named, with its last lines, if a step fails.
say() {
    printf 'dev.sh: %s\n' "$*" >&2
}

step() {  # step WHAT COMMAND...: run COMMAND with its output appended to $log
    say "  $1"
    local what=$1 rc=0
    shift
    printf '\n== %s\n$ %s\n' "$what" "$*" >>"$log"
    "$@" >>"$log" 2>&1 || rc=$?
    if [ "$rc" -ne 0 ]; then
        say "set-up failed: $what (exit status $rc); the end of its log:"
        tail -n 25 "$log" | sed 's/^/    /' >&2
        say "full log: $log"
        exit "$rc"
    fi
}

# promtool, which tests/test_observability_assets.py runs on docs/prometheus/alerts.yml when it
# is there: only the binary, taken from Debian's prometheus package into $VENV/bin (the package
# is not installed, so no Prometheus server is set up or started). Optional: where apt-get cannot
# fetch it, one line says so and those checks are skipped.
promtool_step() {
    if command -v promtool >/dev/null 2>&1 || [ -x "$VENV/bin/promtool" ]; then
        return 0
    fi
    if ! command -v apt-get >/dev/null 2>&1 || ! command -v dpkg-deb >/dev/null 2>&1; then
        say "  promtool: skipped (no apt-get here); the tests' promtool checks will not run"
        return 0
    fi
    say "  promtool, from Debian's prometheus package"
    printf '\n== promtool\n' >>"$log"
    if ! fetch_promtool >>"$log" 2>&1; then
        say "  promtool: skipped (apt-get could not fetch it, see $log); its checks will not run"
    fi
    return 0
}

fetch_promtool() {
    local dir rc=0
    dir=$(mktemp -d)
    # Without package lists (a fresh image) only root can fetch them first. Bounded: a mirror
    # that does not answer costs these checks, never the set-up.
    (cd "$dir" && timeout 120 apt-get download prometheus) \
        || { [ "$(id -u)" -eq 0 ] && timeout 300 apt-get update -qq \
            && (cd "$dir" && timeout 120 apt-get download prometheus); } \
        || rc=$?
    if [ "$rc" -eq 0 ]; then
        { dpkg-deb -x "$dir"/prometheus_*.deb "$dir/unpacked" \
            && install -m 755 "$dir/unpacked/usr/bin/promtool" "$VENV/bin/promtool"; } || rc=$?
    fi
    rm -rf "$dir"
    return "$rc"
}

setup() {
    if [ ! -x "$VENV/bin/python" ]; then
        say "creating a virtualenv in $VENV"
        "$PYTHON" -m venv "$VENV"
    fi
    # shellcheck disable=SC1091
    . "$VENV/bin/activate"
    local stamp="$VENV/.kvfsm-installed"
    local sglang_reqs=tests/sglang/requirements-cpu.txt
    if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ "$sglang_reqs" -nt "$stamp" ] \
        || [ "$0" -nt "$stamp" ]; then
        log="$VENV/kvfsm-setup.log"
        local started=$SECONDS
        : >"$log"
        say "installing kvfsm and its tools into $VENV (a few minutes; pip's output: $log)"
        step "pip" python -m pip install --upgrade pip
        # SGLang 0.5.23's own torch pins (local wheels on these machines; pip is capped at
        # torch<=2.14.1 here). The CUDA build imports and runs on a CPU-only machine, which is
        # what lets tests/e2e run real SGLang servers (docs/sglang-import.md). First, so the
        # editable install below finds its torch requirement met.
        step "torch 2.14.1, torchvision 0.29.1" \
            python -m pip install "torch==2.14.1" "torchvision==0.29.1"
        step "kvfsm, editable, with its dev extras" python -m pip install -e '.[dev]'
        # SGLang 0.5.23 and its serving stack, for tests/sglang and tests/e2e: the packages a
        # CPU machine needs, pinned in $sglang_reqs, then SGLang itself without its
        # dependencies (they also pin flashinfer, CUDA kernels and more, unusable on a CPU).
        # pip's resolver warnings about those are expected (they are in the log).
        step "SGLang's CPU serving stack ($sglang_reqs)" python -m pip install -r "$sglang_reqs"
        step "sglang 0.5.23, without its dependencies" \
            python -m pip install --no-deps "sglang==0.5.23"
        promtool_step
        touch "$stamp"
        say "set up in $((SECONDS - started)) s"
    fi
}

# Every benchmark of benchmarks/, in this order, with the options that fit the whole run in
# 15 minutes on a 2-vCPU machine (each one's defaults measure longer; benchmarks/README.md
# gives both). A name, then its arguments; vs_sglang.py and tp_shapes.py need the repository
# on the path (they use the test rigs), so every one runs as a module from here.
BENCHMARKS=(
    "room_lifecycle --rooms 3000 --runs 3"
    "transfer --repeat 2"
    "control --frames 50000 --pings 1000"
    "gil --seconds 2 --rounds 2"
    "gil_backends --seconds 2 --rounds 1"
    "sglang_adapter --requests 1000 --rounds 3"
    "vs_sglang --requests 200 --rounds 1"
    "idle --rooms 2000 --idle 2"
    "peer_loss"
    "routing_quotas"
    "tp_shapes"
    "scaling --quick"
)

# run_benchmarks [NAME...]: the benchmarks named (all by default), each one's output on the
# console and in benchmarks/figures/NAME.txt (scaling.py also writes its JSON and plots
# there). One that is not in the tree is skipped with a line; one that fails does not stop
# the others, and the exit status is 1 if any failed.
run_benchmarks() {
    local entry name args failed=() started=$SECONDS began load known=" "
    for entry in "${BENCHMARKS[@]}"; do
        known+="${entry%% *} "
    done
    for name in "$@"; do
        if [[ "$known" != *" $name "* ]]; then
            say "bench: no benchmark named '$name'; the names:$known"
            return 2
        fi
    done
    mkdir -p benchmarks/figures
    for entry in "${BENCHMARKS[@]}"; do
        name=${entry%% *}
        args=${entry#"$name"}
        if [ $# -gt 0 ] && [[ " $* " != *" $name "* ]]; then
            continue
        fi
        if [ ! -f "benchmarks/$name.py" ]; then
            say "bench: $name: benchmarks/$name.py is not here, skipped"
            continue
        fi
        say "bench: $name$args"
        began=$SECONDS load=$(cut -d' ' -f1 /proc/loadavg)
        # shellcheck disable=SC2086  # $args: the options above, split on spaces
        if ! PYTHONUNBUFFERED=1 PYTHONPATH="benchmarks${PYTHONPATH:+:$PYTHONPATH}" \
            python -m "$name" $args \
            2>&1 | tee "benchmarks/figures/$name.txt"; then
            failed+=("$name")
        fi
        # What produced the file, and the machine's state: the figures mean little without it.
        printf '\n# ./dev.sh bench: python benchmarks/%s.py%s; %d s; load average %s -> %s; %s\n' \
            "$name" "$args" "$((SECONDS - began))" "$load" "$(cut -d' ' -f1 /proc/loadavg)" \
            "$(nproc) CPUs" >>"benchmarks/figures/$name.txt"
        say "bench: $name took $((SECONDS - began)) s"
    done
    say "bench: all in $((SECONDS - started)) s${failed[*]:+; failed: ${failed[*]}}"
    [ ${#failed[@]} -eq 0 ]
}

cmd=${1:-help}
shift || true
case "$cmd" in
    main)
        setup
        exec kvfsm demo "$@"
        ;;
    test)
        setup
        # Two workers (this machine and CI's have two cores); tests that must not run beside
        # each other share an xdist_group (tests/conftest.py), which --dist loadgroup keeps on
        # one worker. Then the tests marked `alone` (they judge how long calls took), one at
        # a time with the machine to themselves. Arguments go to both parts and win: `-n 0`
        # runs the first in this process too. A part that selects nothing (exit status 5)
        # fails only if the other selected nothing as well.
        parallel=0 alone=0
        python -m pytest -n 2 --dist loadgroup -m "not alone" "$@" || parallel=$?
        python -m pytest -n 0 -m alone "$@" || alone=$?
        if [ "$parallel" -eq 5 ] && [ "$alone" -eq 5 ]; then exit 5; fi
        [ "$parallel" -eq 5 ] && parallel=0
        [ "$alone" -eq 5 ] && alone=0
        [ "$parallel" -ne 0 ] && exit "$parallel"
        exit "$alone"
        ;;
    lint)
        setup
        ruff check .
        ruff format --check .
        mypy
        ;;
    bench)
        setup
        run_benchmarks "$@"
        ;;
    *)
        sed -n '2,12p' "$0"
        exit 2
        ;;
esac
