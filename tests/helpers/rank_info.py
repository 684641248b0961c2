"""``RankInfo`` values for the bootstrap registry's tests (the table, the schemas, the server
and the command line): one rank of the engine ``ENGINE``, and the registry secret they sign with."""

from __future__ import annotations

import json
from typing import Any

import msgspec

from kvfsm.registry import RankInfo

ENGINE = "prefill-a"
SECRET = b"0123456789abcdef-test-secret"


def info(rank: int = 0, *, engine: str = ENGINE, incarnation: int = 1, **kw: Any) -> RankInfo:
    fields: dict[str, Any] = {
        "engine": engine,
        "rank": rank,
        "tp_rank": rank,
        "tp_size": 4,
        "dp_rank": 0,
        "pp_rank": 0,
        "host": "10.0.0.7",
        "port": 17000 + rank,
        "agent": f"prefill-{rank}",
        "layout": msgspec.msgpack.encode({"kv": [rank, 4096]}),
        "incarnation": incarnation,
    }
    fields.update(kw)
    return RankInfo(**fields)


def as_json(i: RankInfo) -> dict[str, Any]:
    out: dict[str, Any] = json.loads(msgspec.json.encode(i))
    return out
