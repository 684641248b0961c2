#!/usr/bin/env bash
# Real SGLang 0.5.23 prefill and decode servers on this CPU machine, with kvfsm moving their KV
# (docs/sglang.md, "SGLang PD on a CPU machine"), SGLang's router in front, one request through
# it, then everything stopped. Run from anywhere after `./dev.sh test` (or `./dev.sh main`) has
# set up .venv; it takes a minute or two, most of it the servers' start-up.
#
#   examples/sglang_cpu_pd.sh            ends with "sglang_cpu_pd: OK"
#
# The model is a 2-layer Llama config with no weights (--load-format dummy). SGLang's rotary
# embedding reaches a vLLM op off-CUDA; the torch version of it that the test rig uses
# (tests/e2e/shim, not part of kvfsm) goes on the servers' PYTHONPATH.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
PY=${PYTHON:-$ROOT/.venv/bin/python}
if ! "$PY" -c "import sglang, sglang_router" 2>/dev/null; then
    echo "sglang_cpu_pd: SGLang is not in $PY's environment; run ./dev.sh test first" >&2
    exit 2
fi

WORK=$(mktemp -d)
PIDS=()
cleanup() {
    # Each server runs in its own process group (setsid): stop the groups, children included.
    for pid in "${PIDS[@]}"; do kill -TERM -- "-$pid" 2>/dev/null || true; done
    for pid in "${PIDS[@]}"; do
        for _ in $(seq 30); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
        kill -KILL -- "-$pid" 2>/dev/null || true
    done
    rm -rf "$WORK"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

free_port() { "$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
PREFILL=$(free_port); BOOTSTRAP=$(free_port); DECODE=$(free_port); ROUTER=$(free_port)

mkdir -p "$WORK/model"
cat >"$WORK/model/config.json" <<'EOF'
{"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128,
 "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
 "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 512, "max_position_embeddings": 2048,
 "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "hidden_act": "silu", "torch_dtype": "bfloat16",
 "tie_word_embeddings": false, "bos_token_id": 1, "eos_token_id": 2}
EOF

COMMON=(--model-path "$WORK/model" --load-format dummy --skip-tokenizer-init --device cpu
    --attention-backend torch_native --disable-cuda-graph --mem-fraction-static 0.5
    --max-total-tokens 8192 --disable-radix-cache --host 127.0.0.1 --sleep-on-idle
    --disaggregation-transfer-backend nixl)
# --sleep-on-idle: an idle SGLang scheduler on a CPU otherwise spins, a core per server.
# KVFSM_SGLANG=1: SGLang's "nixl" backend is served by kvfsm. A longer liveness bound than
# kvfsm's 2 s default: two CPU-bound servers share the cores (docs/sglang.md).
export KVFSM_SGLANG=1 KVFSM_HEARTBEAT_S=1 KVFSM_LIVENESS_FACTOR=10 KVFSM_LEASE_S=10
export PYTHONPATH="$ROOT/tests/e2e/shim${PYTHONPATH:+:$PYTHONPATH}"

start() { # name, then the command: logs to $WORK/name.log, pid into PIDS
    local name=$1; shift
    setsid "$@" >"$WORK/$name.log" 2>&1 &
    PIDS+=("$!")
}
start prefill "$PY" -m sglang.launch_server "${COMMON[@]}" --port "$PREFILL" \
    --disaggregation-mode prefill --disaggregation-bootstrap-port "$BOOTSTRAP"
start decode "$PY" -m sglang.launch_server "${COMMON[@]}" --port "$DECODE" \
    --disaggregation-mode decode --disaggregation-decode-retraction-backup none

wait_ready() { # name, pid, url
    for _ in $(seq 300); do
        if ! kill -0 "$2" 2>/dev/null; then
            echo "sglang_cpu_pd: $1 exited; its log:" >&2; tail -n 40 "$WORK/$1.log" >&2; exit 1
        fi
        if curl -sf -m 10 -o /dev/null "$3"; then echo "[$1] ready"; return 0; fi
        sleep 1
    done
    echo "sglang_cpu_pd: $1 not ready after 300 s; its log:" >&2; tail -n 40 "$WORK/$1.log" >&2
    exit 1
}
wait_ready prefill "${PIDS[0]}" "http://127.0.0.1:$PREFILL/health"
wait_ready decode "${PIDS[1]}" "http://127.0.0.1:$DECODE/health"

start router "$PY" -m sglang_router.launch_router --pd-disaggregation \
    --prefill "http://127.0.0.1:$PREFILL" "$BOOTSTRAP" --decode "http://127.0.0.1:$DECODE" \
    --host 127.0.0.1 --port "$ROUTER"

REQUEST='{"input_ids": [17, 42, 301, 99, 7, 250, 3, 128], "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": true}}'
for _ in $(seq 120); do # until the router has registered both workers
    if OUT=$(curl -sf -m 60 -H 'Content-Type: application/json' -d "$REQUEST" \
        "http://127.0.0.1:$ROUTER/generate"); then
        break
    fi
    OUT=""
    sleep 1
done
if [ -z "$OUT" ]; then
    echo "sglang_cpu_pd: the router did not serve; its log:" >&2; tail -n 40 "$WORK/router.log" >&2
    exit 1
fi
IDS=$(printf '%s' "$OUT" | "$PY" -c 'import json, sys; print(json.load(sys.stdin)["output_ids"])')
echo "[router] 8 prompt tokens -> output ids $IDS (KV moved prefill -> decode by kvfsm)"
# The request's KV went through kvfsm: prefill's kvfsm rank logged its start.
grep -q "kvfsm prefill rank 0" "$WORK/prefill.log"
grep -q "kvfsm decode rank 0" "$WORK/decode.log"
echo "sglang_cpu_pd: OK"
