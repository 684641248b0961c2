"""Bytes each prefill rank moves, per attention-TP shape and per pipeline shape (the figures
of ``benchmarks/README.md``).

For each shape it runs SGLang 0.5.23's scheduler sequences (the conformance replay of
``tests/helpers/sglang_replay.py``, which checks every head slice of every page on decode) with 12
random requests over real NIXL, and prints one line: requests that succeeded, violations and
leaks the replay found, and each prefill rank's ``bytes_done``. Equal TP moves the reference
amount; unequal MHA must move the same KV bytes (each decode head written once), MLA one
replica per decode rank. Pipeline shapes (``tests/helpers/sglang_pipeline.py``): each stage
must move its own layers of every page, and only the last stage the aux rows.

Run from the repository root (it uses the test rig): ``python -m benchmarks.tp_shapes``.
"""

from __future__ import annotations

import json
import random
import sys

from kvfsm.sglang import KvfsmKVBootstrapServer, configure
from tests.helpers import sglang_pipeline as pp_rig
from tests.helpers import sglang_replay as rig
from tests.helpers.sglang_config import CONFIG

#: (prefill attention TP, decode attention TP, KV heads, MLA)
SHAPES = [
    (2, 2, 4, False),
    (2, 1, 4, False),
    (4, 2, 4, False),
    (1, 2, 4, False),
    (2, 4, 4, False),
    (2, 1, 1, True),
    (4, 2, 1, True),
    (1, 2, 1, True),
]
#: (attention TP, pipeline stages, layers): PP 1 is the reference for the same model.
PIPELINES = [(1, 1, 4), (1, 2, 4), (1, 3, 4), (2, 2, 4)]


def run(prefill_tp: int, decode_tp: int, heads: int, mla: bool) -> dict[str, object]:
    boot = KvfsmKVBootstrapServer(host="127.0.0.1", port=0)
    shape = {"heads": heads, "head_bytes": 64, "mla": mla, "state": False}
    prefill = rig.Instance.start("prefill", boot.port, prefill_tp, head_counts="before", **shape)
    decode = rig.Instance.start("decode", boot.port, decode_tp, head_counts="never", **shape)
    try:
        requests = rig.random_requests(random.Random(5), 12)
        out = rig.Pair(prefill, decode, boot.port).run(requests, timeout=60)
        done = [s["bytes_done"] for s in prefill.transport_snapshots()]
    finally:
        decode.close()
        prefill.close()
        boot.close()
    return {
        "shape": f"{'MLA' if mla else 'MHA'} {heads} heads, TP {prefill_tp} -> {decode_tp}",
        "succeeded": sum(r.prefill_outcome == r.decode_outcome == "Success" for r in requests),
        "requests": len(requests),
        "pages": sum(len(r.src_pages) for r in requests),
        "violations": out.violations,
        "leaks": out.leaks,
        "bytes_per_prefill_rank": done,
        "bytes": sum(done),
    }


def run_pipeline(tp: int, stages: int, layers: int) -> dict[str, object]:
    boot = KvfsmKVBootstrapServer(host="127.0.0.1", port=0)
    decode = None
    try:
        if stages == 1:
            prefill: rig.Instance | pp_rig.Pipeline = rig.Instance.start(
                "prefill", boot.port, tp, state=False, layers=layers
            )
        else:
            prefill = pp_rig.Pipeline.start(boot.port, tp, stages, layers=layers)
        decode = rig.Instance.start("decode", boot.port, tp, state=False, layers=layers)
        requests = rig.random_requests(random.Random(5), 12)
        if isinstance(prefill, pp_rig.Pipeline):
            pair: rig.Pair = pp_rig.PipelinePair(prefill, decode, boot.port)
            pp_pair = pair
            assert isinstance(pp_pair, pp_rig.PipelinePair)
            pp_pair.wait_for_stages()
            out = pair.run(requests, timeout=60)
            done = [[s["bytes_done"] for s in stage] for stage in prefill.transport_snapshots()]
        else:
            out = rig.Pair(prefill, decode, boot.port).run(requests, timeout=60)
            done = [[s["bytes_done"] for s in prefill.transport_snapshots()]]
    finally:
        if decode is not None:
            decode.close()
        prefill.close()
        boot.close()
    return {
        "shape": f"MHA, {layers} layers, TP {tp}, PP {stages} -> TP {tp}",
        "succeeded": sum(r.prefill_outcome == r.decode_outcome == "Success" for r in requests),
        "requests": len(requests),
        "pages": sum(len(r.src_pages) for r in requests),
        "violations": out.violations,
        "leaks": out.leaks,
        "bytes_per_stage_and_rank": done,
        "bytes": sum(map(sum, done)),
    }


def main() -> int:
    configure(CONFIG)
    rows = [run(*shape) for shape in SHAPES] + [run_pipeline(*shape) for shape in PIPELINES]
    json.dump(rows, sys.stdout, indent=1)
    print()
    return 0 if all(r["succeeded"] == r["requests"] and not r["violations"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
