"""A test-only stand-in for the one piece of vLLM that SGLang 0.5.23 reaches on this CPU rig.

SGLang's ``RotaryEmbedding`` falls back to ``vllm._custom_ops.rotary_embedding`` when the CUDA
build of torch runs on a machine without a GPU (it is neither its CUDA nor its CPU path). The
e2e tests put ``tests/e2e/shim`` on the servers' ``PYTHONPATH``; nothing in the ``kvfsm``
package imports it, and it is never installed.
"""
