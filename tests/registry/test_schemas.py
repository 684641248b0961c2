"""The registry's wire schemas (``kvfsm/registry/_schemas.py``): ``RankInfo`` validates its
fields, in the constructor and when decoded from JSON."""

from __future__ import annotations

import msgspec
import pytest

from kvfsm.registry import RankInfo
from tests.helpers.rank_info import as_json, info


def test_rank_info_validates_its_fields() -> None:
    with pytest.raises(ValueError, match="tp_rank 4 out of range"):
        info(tp_rank=4)
    with pytest.raises(msgspec.ValidationError, match=r"\$\.engine"):
        msgspec.json.decode(
            msgspec.json.encode({**as_json(info()), "engine": "a b"}), type=RankInfo
        )
    # msgspec's pattern uses re.search; an anchored "$" would let a trailing newline through.
    bad = {**as_json(info()), "engine": "a\n"}
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(msgspec.json.encode(bad), type=RankInfo)
