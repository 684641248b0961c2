"""Which model and deployment shapes SGLang 0.5.23 itself can serve on this CPU machine: one plain
SGLang server per shape (no disaggregation, no kvfsm: ``KVFSM_SGLANG=0``), with the e2e suite's
flags and dummy weights, then one greedy request. It prints, per shape, whether the server came
up, what it answered, or the last error lines of SGLang's own log.

    .venv/bin/python -m tests.e2e.shapes_probe [SHAPE ...]      (default: every shape)

What it found is in ``docs/sglang.md`` ("Real servers on this CPU"); a shape that comes up here
can join the e2e suite, one that does not is covered by the conformance replay.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from tests.e2e.servers import COMMON_FLAGS, MODEL_CONFIG, SHIM, free_port

#: A DeepSeek-V2-style MLA model, all layers dense. SGLang's CPU rotary embedding wants
#: DeepSeek's YaRN scaling; its torch-native MLA extend path wants ``kv_lora_rank`` equal to
#: ``qk_nope_head_dim`` (otherwise "Expected size for first two dimensions of batch2 tensor").
MLA_CONFIG: dict[str, Any] = {
    **MODEL_CONFIG,
    "architectures": ["DeepseekV2ForCausalLM"],
    "model_type": "deepseek_v2",
    "num_key_value_heads": 4,
    "kv_lora_rank": 32,
    "q_lora_rank": None,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 16,
    "v_head_dim": 32,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "moe_intermediate_size": 64,
    "first_k_dense_replace": 2,
    "moe_layer_freq": 1,
    "topk_method": "greedy",
    "n_group": 1,
    "topk_group": 1,
    "routed_scaling_factor": 1.0,
    "scoring_func": "softmax",
    "norm_topk_prob": False,
    "rope_scaling": {
        "type": "yarn",
        "factor": 1.0,
        "original_max_position_embeddings": 2048,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
}
#: A hybrid sliding-window model (SGLang's SWA memory pool: a ``swa`` state type in PD).
SWA_CONFIG: dict[str, Any] = {
    **MODEL_CONFIG,
    "architectures": ["GraniteSWAForCausalLM"],
    "model_type": "granite",
    "layer_types": ["sliding_attention", "full_attention"],
    "sliding_window": 64,
    "layer_rope_theta": [10000.0, 10000.0],
    "attention_multiplier": 1.0,
    "embedding_multiplier": 1.0,
    "residual_multiplier": 1.0,
    "logits_scaling": 1.0,
}
#: A Mamba model (SGLang's Mamba state: a ``mamba`` state type in PD).
MAMBA_CONFIG: dict[str, Any] = {
    "architectures": ["MambaForCausalLM"],
    "model_type": "mamba",
    "hidden_size": 128,
    "intermediate_size": 256,
    "state_size": 16,
    "num_hidden_layers": 2,
    "expand": 2,
    "conv_kernel": 4,
    "time_step_rank": 8,
    "vocab_size": 512,
    "layer_norm_epsilon": 1e-5,
    "use_bias": False,
    "use_conv_bias": True,
    "residual_in_fp32": True,
    "torch_dtype": "bfloat16",
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}
#: Several scheduler processes: SGLang's CPU backend binds each one's OpenMP threads to cores.
_TWO_RANKS = {"SGLANG_CPU_OMP_THREADS_BIND": "0|1"}

#: name -> (model config, extra server flags, extra environment)
SHAPES: dict[str, tuple[dict[str, Any], list[str], dict[str, str]]] = {
    "llama": (MODEL_CONFIG, [], {}),
    "mla": (MLA_CONFIG, [], {}),
    "swa": (SWA_CONFIG, [], {}),
    "mamba": (MAMBA_CONFIG, [], {}),
    "tp2": (MODEL_CONFIG, ["--tp", "2"], _TWO_RANKS),
    "pp2": (MODEL_CONFIG, ["--pp-size", "2"], _TWO_RANKS),
    "dp2": (MODEL_CONFIG, ["--tp", "2", "--dp", "2", "--enable-dp-attention"], _TWO_RANKS),
}


def probe(name: str, directory: Path, timeout_s: float = 240.0) -> str:
    config, flags, env_extra = SHAPES[name]
    model = directory / name
    model.mkdir(parents=True, exist_ok=True)
    (model / "config.json").write_text(json.dumps(config))
    port = free_port()
    env = {**os.environ, **env_extra, "KVFSM_SGLANG": "0", "PYTHONPATH": str(SHIM)}
    argv = [
        sys.executable, "-m", "sglang.launch_server", "--model-path", str(model),
        "--port", str(port), *COMMON_FLAGS, *flags,
    ]  # fmt: skip
    log_path = model / "server.log"
    began = time.monotonic()
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    try:
        while time.monotonic() - began < timeout_s and proc.poll() is None:
            health = f"http://127.0.0.1:{port}/health"
            with contextlib.suppress(OSError), urllib.request.urlopen(health, timeout=5) as r:
                if r.status == 200:
                    up = time.monotonic() - began
                    return f"{name}: serves ({_generate(port)}), up in {up:.0f} s"
            time.sleep(1)
        lines = log_path.read_text(errors="replace").splitlines()
        errors = [ln for ln in lines if "Error" in ln and "Ignore import error" not in ln]
        return f"{name}: does not start (exit {proc.poll()}):\n  " + "\n  ".join(errors[-3:])
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _generate(port: int) -> str:
    body = {
        "input_ids": list(range(3, 40)),
        "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True},
    }
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/generate",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return f"output ids {json.loads(resp.read())['output_ids']}"
    except OSError as exc:
        return f"generate failed: {exc}"


def main() -> None:
    names = sys.argv[1:] or list(SHAPES)
    with tempfile.TemporaryDirectory(prefix="kvfsm-shapes-") as tmp:
        for name in names:
            print(probe(name, Path(tmp)), flush=True)


if __name__ == "__main__":
    main()
