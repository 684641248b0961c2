#!/usr/bin/env bash
# One entry point for people and CI. Each command sets up what it needs on a fresh machine
# (a virtualenv in .venv with kvfsm installed editable), then runs:
#
#   ./dev.sh main     the main job (kvfsm demo): a prefill-decode pair moving real KV over NIXL
#   ./dev.sh test     the test suite
#   ./dev.sh lint     ruff and mypy (strict on kvfsm/)
#   ./dev.sh bench    the benchmarks
#
# Extra arguments go to the underlying command (kvfsm run / pytest / the benchmark).
set -euo pipefail
cd "$(dirname "$0")"

PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}

setup() {
    if [ ! -x "$VENV/bin/python" ]; then
        "$PYTHON" -m venv "$VENV"
    fi
    # shellcheck disable=SC1091
    . "$VENV/bin/activate"
    local stamp="$VENV/.kvfsm-installed"
    local sglang_reqs=tests/sglang/requirements-cpu.txt
    if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ "$sglang_reqs" -nt "$stamp" ] \
        || [ "$0" -nt "$stamp" ]; then
        python -m pip install --quiet --upgrade pip
        # SGLang 0.5.23's own torch pins (local wheels on these machines; pip is capped at
        # torch<=2.14.1 here). The CUDA build imports and runs on a CPU-only machine, which is
        # what lets tests/e2e run real SGLang servers (docs/sglang-import.md). First, so the
        # editable install below finds its torch requirement met.
        python -m pip install --quiet "torch==2.14.1" "torchvision==0.29.1"
        python -m pip install --quiet -e '.[dev]'
        # SGLang 0.5.23 and its serving stack, for tests/sglang and tests/e2e: the packages a
        # CPU machine needs, pinned in $sglang_reqs, then SGLang itself without its
        # dependencies (they also pin flashinfer, CUDA kernels and more, unusable on a CPU).
        # pip's resolver warnings about those are expected.
        python -m pip install --quiet -r "$sglang_reqs"
        python -m pip install --quiet --no-deps "sglang==0.5.23"
        touch "$stamp"
    fi
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
        exec python -m pytest "$@"
        ;;
    lint)
        setup
        ruff check .
        ruff format --check .
        mypy
        ;;
    bench)
        setup
        python benchmarks/room_lifecycle.py "$@"
        ;;
    *)
        sed -n '2,12p' "$0"
        exit 2
        ;;
esac
