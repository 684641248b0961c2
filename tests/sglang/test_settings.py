"""The adapter's environment settings for the control channel's timing."""

from __future__ import annotations

import pytest

from kvfsm.bootstrap import ChannelConfig
from kvfsm.sglang._settings import channel_config


def test_unset_variables_keep_kvfsms_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("KVFSM_HEARTBEAT_S", "KVFSM_LIVENESS_FACTOR", "KVFSM_LEASE_S"):
        monkeypatch.delenv(name, raising=False)
    assert channel_config() == ChannelConfig()


def test_heartbeat_liveness_and_lease_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVFSM_HEARTBEAT_S", "2")
    monkeypatch.setenv("KVFSM_LIVENESS_FACTOR", "5")
    monkeypatch.setenv("KVFSM_LEASE_S", "8")
    config = channel_config()
    assert (config.heartbeat_s, config.liveness_factor, config.lease_s) == (2.0, 5.0, 8.0)
    assert config.silence_s == 10.0


@pytest.mark.parametrize("value", ["0", "-1", "soon", "nan"])
def test_a_bad_value_is_refused_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv("KVFSM_HEARTBEAT_S", value)
    with pytest.raises(ValueError, match="KVFSM_HEARTBEAT_S"):
        channel_config()
