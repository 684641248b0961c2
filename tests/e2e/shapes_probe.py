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
#: Hybrid models whose linear layers keep per-request state in SGLang's ``MambaPool`` (a
#: ``mamba`` state type in PD, the pool ``HybridLinearKVPool``), each a tiny config with one
#: linear layer and one full-attention layer where the architecture allows. On this machine
#: SGLang is not its CPU engine (``is_cpu()`` needs ``SGLANG_USE_CPU_ENGINE=1``) nor CUDA, so
#: the linear layers take the Triton kernels (no Triton driver here: "0 active drivers") or
#: none at all; only ZAYA1's plain-torch convolution serves.
_HYBRID_BASE: dict[str, Any] = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "vocab_size": 512,
    "max_position_embeddings": 2048,
    "rope_theta": 10000.0,
    "torch_dtype": "bfloat16",
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}
#: LFM2: gated short convolutions (conv state only) and attention. Its pool is built; the
#: first forward fails in the Triton ``causal_conv1d_fn``.
LFM2_CONFIG: dict[str, Any] = {
    **_HYBRID_BASE,
    "architectures": ["Lfm2ForCausalLM"],
    "model_type": "lfm2",
    "num_hidden_layers": 2,
    "layer_types": ["conv", "full_attention"],
    "conv_L_cache": 3,
    "conv_bias": False,
    "norm_eps": 1e-5,
    "block_auto_adjust_ff_dim": False,
    "block_multiple_of": 1,
}
#: Qwen3-Next: Gated DeltaNet linear attention and gated attention; dense MLPs only. Its
#: gated RMSNorm asks ``torch.cuda`` for the current device while the model is built.
QWEN3_NEXT_CONFIG: dict[str, Any] = {
    **_HYBRID_BASE,
    "architectures": ["Qwen3NextForCausalLM"],
    "model_type": "qwen3_next",
    "num_hidden_layers": 2,
    "layer_types": ["linear_attention", "full_attention"],
    "full_attention_interval": 2,
    "partial_rotary_factor": 0.25,
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 32,
    "linear_value_head_dim": 32,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 64,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [0, 1],
    "norm_topk_prob": True,
}
_MAMBA2_MIXER: dict[str, Any] = {
    "mamba_n_heads": 8,
    "mamba_d_head": 32,
    "mamba_n_groups": 1,
    "mamba_d_state": 16,
    "mamba_d_conv": 4,
    "mamba_expand": 2,
    "mamba_chunk_size": 64,
    "mamba_conv_bias": True,
    "mamba_proj_bias": False,
}
#: Falcon-H1: a Mamba-2 mixer beside attention in every layer. SGLang's Mamba-2 mixer binds
#: its ``causal_conv1d_fn`` on CUDA, NPU and XPU only (a ``NameError`` at the first forward),
#: as for Nemotron-H, Granite-4.0-H and Mamba-2 below.
FALCON_H1_CONFIG: dict[str, Any] = {
    **_HYBRID_BASE,
    **_MAMBA2_MIXER,
    "architectures": ["FalconH1ForCausalLM"],
    "model_type": "falcon_h1",
    "num_hidden_layers": 2,
    "mamba_d_ssm": 256,
    "mamba_rms_norm": False,
    "mamba_norm_before_gate": True,
    "rms_norm_eps": 1e-5,
    "hidden_act": "silu",
}
#: Nemotron-H: Mamba-2, attention and MLP layers ("M*-").
NEMOTRON_H_CONFIG: dict[str, Any] = {
    **_HYBRID_BASE,
    "architectures": ["NemotronHForCausalLM"],
    "model_type": "nemotron_h",
    "hybrid_override_pattern": "M*-",
    "num_hidden_layers": 3,
    "ssm_state_size": 16,
    "mamba_num_heads": 8,
    "mamba_head_dim": 32,
    "mamba_n_groups": 1,
    "n_groups": 1,
    "mamba_d_conv": 4,
    "mamba_expand": 2,
    "mamba_chunk_size": 64,
    "layer_norm_epsilon": 1e-5,
    "mlp_hidden_act": "relu2",
}
#: Granite-4.0-H (``GraniteMoeHybridForCausalLM``): Mamba-2 and attention layers.
GRANITE_HYBRID_CONFIG: dict[str, Any] = {
    **_HYBRID_BASE,
    **_MAMBA2_MIXER,
    "architectures": ["GraniteMoeHybridForCausalLM"],
    "model_type": "granitemoehybrid",
    "num_hidden_layers": 2,
    "layer_types": ["mamba", "attention"],
    "num_local_experts": 0,
    "num_experts_per_tok": 0,
    "shared_intermediate_size": 256,
    "position_embedding_type": "rope",
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
    "embedding_multiplier": 1.0,
    "logits_scaling": 1.0,
    "residual_multiplier": 1.0,
    "attention_multiplier": 1.0,
}
#: Mamba-2 alone (no attention layer: a state-only pool).
MAMBA2_CONFIG: dict[str, Any] = {
    **_HYBRID_BASE,
    "architectures": ["Mamba2ForCausalLM"],
    "model_type": "mamba2",
    "num_hidden_layers": 2,
    "num_heads": 8,
    "head_dim": 32,
    "state_size": 16,
    "expand": 2,
    "n_groups": 1,
    "conv_kernel": 4,
    "chunk_size": 64,
    "use_bias": False,
    "use_conv_bias": True,
    "layer_norm_epsilon": 1e-5,
    "residual_in_fp32": True,
    "hidden_act": "silu",
    "rms_norm": True,
    "norm_before_gate": False,
}
#: Kimi Linear: Kimi Delta Attention (KDA) layers and MLA layers; dense MLPs only. Its short
#: convolution is the Triton ``causal_conv1d_fn``.
KIMI_LINEAR_CONFIG: dict[str, Any] = {
    **_HYBRID_BASE,
    "architectures": ["KimiLinearForCausalLM"],
    "model_type": "kimi_linear",
    "num_hidden_layers": 2,
    "num_key_value_heads": 4,
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
    "kv_lora_rank": 32,
    "q_lora_rank": None,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 16,
    "v_head_dim": 32,
    "mla_use_nope": True,
    "num_experts": 4,
    "num_experts_per_token": 2,
    "moe_intermediate_size": 64,
    "first_k_dense_replace": 2,
    "linear_attn_config": {
        "kda_layers": [1],
        "full_attn_layers": [2],
        "num_heads": 4,
        "head_dim": 32,
        "short_conv_kernel_size": 4,
    },
}
#: Ling-2.5 (``BailingMoeV2_5ForCausalLM``): lightning linear attention and GQA attention
#: (``full_attention_type`` "gqa" instead of MLA); one expert, so dense MLPs. Its rotary
#: embedding takes SGLang's CPU path, which wants ``rope_type`` "deepseek_yarn". Its gated
#: group norm is a Triton kernel that asks ``torch.cuda`` for the SM count.
BAILING_LINEAR_CONFIG: dict[str, Any] = {
    **_HYBRID_BASE,
    "architectures": ["BailingMoeV2_5ForCausalLM"],
    "model_type": "bailing_hybrid",
    "num_hidden_layers": 2,
    "layer_group_size": 2,
    "group_norm_size": 1,
    "full_attention_type": "gqa",
    "num_experts": 1,
    "first_k_dense_replace": 2,
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
    "use_qk_norm": True,
    "rope_scaling": {**MLA_CONFIG["rope_scaling"], "rope_type": "deepseek_yarn"},
}
#: ZAYA1 (``ZayaForCausalLM``): CCA attention layers, whose q/k convolution keeps per-request
#: conv state (and the previous hidden state) in the ``MambaPool``, and MoE layers. Its
#: conv steps are plain torch in SGLang (no Triton kernel): it serves. Without
#: ``scale_residual_merge`` off, the dummy weights' residual scales (about 1e-3 a layer) leave
#: every logit equal and every output token 0; with it off the outputs depend on the prompt.
ZAYA_CONFIG: dict[str, Any] = {
    **_HYBRID_BASE,
    "architectures": ["ZayaForCausalLM"],
    "model_type": "zaya",
    "zaya_layers": ["a", 2],
    "num_hidden_layers": 2,
    "num_query_groups": 2,
    "ffn_hidden_size": 256,
    "num_experts": 2,
    "moe_router_topk": 1,
    "zaya_mlp_expansion": 64,
    "partial_rotary_factor": 0.5,
    "norm_epsilon": 1e-5,
    "scale_residual_merge": False,
}
#: Several scheduler processes: SGLang's CPU backend binds each one's OpenMP threads to cores.
_TWO_RANKS = {"SGLANG_CPU_OMP_THREADS_BIND": "0|1"}

#: The Mamba state pool's slots; SGLang's default sizes it from free memory (5 GB here).
HYBRID_FLAGS = ["--max-mamba-cache-size", "64"]
#: SGLang's own CPU engine (``is_cpu()``): its CPU kernels come from ``sgl_kernel``'s CPU build,
#: which is not installed (``No module named 'sgl_kernel'`` at start-up).
_CPU_ENGINE = {"SGLANG_USE_CPU_ENGINE": "1"}

#: name -> (model config, extra server flags, extra environment)
SHAPES: dict[str, tuple[dict[str, Any], list[str], dict[str, str]]] = {
    "llama": (MODEL_CONFIG, [], {}),
    "mla": (MLA_CONFIG, [], {}),
    "swa": (SWA_CONFIG, [], {}),
    "mamba": (MAMBA_CONFIG, [], {}),
    "lfm2": (LFM2_CONFIG, HYBRID_FLAGS, {}),
    "qwen3_next": (QWEN3_NEXT_CONFIG, HYBRID_FLAGS, {}),
    "falcon_h1": (FALCON_H1_CONFIG, HYBRID_FLAGS, {}),
    "nemotron_h": (NEMOTRON_H_CONFIG, HYBRID_FLAGS, {}),
    "granite_hybrid": (GRANITE_HYBRID_CONFIG, HYBRID_FLAGS, {}),
    "mamba2": (MAMBA2_CONFIG, HYBRID_FLAGS, {}),
    "kimi_linear": (KIMI_LINEAR_CONFIG, HYBRID_FLAGS, {}),
    "bailing_linear": (BAILING_LINEAR_CONFIG, HYBRID_FLAGS, {}),
    "zaya": (ZAYA_CONFIG, HYBRID_FLAGS, {}),
    "lfm2-cpu-engine": (LFM2_CONFIG, HYBRID_FLAGS, _CPU_ENGINE),
    "qwen3_next-cpu-engine": (QWEN3_NEXT_CONFIG, HYBRID_FLAGS, _CPU_ENGINE),
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
        frames = [ln.strip() for ln in lines if ln.strip().startswith('File "')]
        deepest = [f for f in frames if "/sglang/" in f][-1:]
        return f"{name}: does not start (exit {proc.poll()}):\n  " + "\n  ".join(
            [*errors[-3:], *(f"deepest SGLang frame: {f}" for f in deepest)]
        )
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
