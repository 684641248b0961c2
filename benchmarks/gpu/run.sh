#!/usr/bin/env bash
# kvfsm against raw NIXL on VRAM, side by side in one run, on a machine with one NVIDIA GPU
# (H200 class, CUDA 13 driver). Installs what it needs into its own virtualenv, then runs
# benchmarks/transfer.py's cases with both sides' buffers on CUDA device 0 (prefill process
# and decode process on the same GPU: UCX moves the bytes GPU to GPU, cuda_ipc) and prints ONE
# JSON object on stdout: the transfer report plus the environment. Progress goes to stderr.
# Budget: under 10 minutes (install ~3-5 min with a warm pip cache, run ~1-2 min).
#
#   bash benchmarks/gpu/run.sh            # or: REPEAT=5 CASES=rooms_16 bash benchmarks/gpu/run.sh
#
# Environment: VENV (default .venv-gpu), PYTHON (python3.11 if present, else python3),
# REPEAT (3), CASES (all), TIMEOUT_S (480: the benchmark itself), WHEELHOUSE (a folder of
# wheels for a machine without a package index: pip then installs from it only; fill it
# beforehand with `pip download -d wheels torch nixl-cu13 nixl aiohttp anyio transitions
# msgspec numpy uvloop` on a machine of the same platform and Python).
set -euo pipefail
cd "$(dirname "$0")/../.."

log() { echo "[gpu/run.sh] $*" >&2; }
PYTHON=${PYTHON:-$(command -v python3.11 || command -v python3)}
VENV=${VENV:-.venv-gpu}
REPEAT=${REPEAT:-3}
CASES=${CASES:-all}
TIMEOUT_S=${TIMEOUT_S:-480}

command -v nvidia-smi >/dev/null || { log "no nvidia-smi: not a GPU machine"; exit 2; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader >&2

if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
# shellcheck disable=SC1091
. "$VENV/bin/activate"
log "installing (pip, quiet)"
if [ -n "${WHEELHOUSE:-}" ]; then
    export PIP_NO_INDEX=1 PIP_FIND_LINKS="$WHEELHOUSE"
else
    python -m pip install --quiet --upgrade pip
fi
# torch's default Linux wheel is a CUDA build; it only allocates and copies the buffers here.
python -m pip install --quiet "torch<=2.14.1"
# NIXL for CUDA 13: the nixl-cu13 wheel (module nixl_cu13) and the nixl meta package (module
# nixl, which kvfsm falls back to when nixl_cu12 is absent). kvfsm itself without its
# dependencies (they name nixl-cu12, the CUDA 12 wheel), then the rest of them.
python -m pip install --quiet "nixl-cu13>=1.5.1" "nixl>=1.5.1"
python -m pip install --quiet --no-deps -e .
python -m pip install --quiet "aiohttp>=3.9" "anyio>=4.9" "transitions>=0.9.2,<0.10" \
    "msgspec>=0.18" "numpy>=1.26" "uvloop>=0.19"
python -m pip uninstall --quiet --yes nixl-cu12 2>/dev/null || true
python - <<'PY' >&2
import torch
from kvfsm.transport._nixl import nixl_agent
print("torch", torch.__version__, "cuda", torch.version.cuda, "device", torch.cuda.get_device_name(0))
print("nixl agent class from", nixl_agent.__module__)
PY

log "running transfer.py --mem vram (raw_nixl vs kvfsm, best of $REPEAT)"
out=$(mktemp)
# UCX_TLS unset: UCX picks cuda_ipc for GPU-to-GPU on one device, as SGLang would get.
timeout "$TIMEOUT_S" python benchmarks/transfer.py --mem vram --runners raw_nixl,kvfsm \
    --cases "$CASES" --repeat "$REPEAT" --json >"$out"
python - "$out" <<'PY'
import json, subprocess, sys
report = json.load(open(sys.argv[1]))
gpu = subprocess.run(
    ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
    capture_output=True, text=True, check=False,
).stdout.strip()
report["gpu"] = gpu
report["summary"] = {
    f"{r['case']} {r['ratio']}": round(r["bandwidth"], 3) for r in report["ratios"]
}
print(json.dumps(report))
PY
