"""The adapter's environment settings: the control channel's timing, the fenced-out policy."""

from __future__ import annotations

import pytest

from kvfsm.control import ChannelConfig
from kvfsm.sglang._settings import channel_config, configure, manager_config


def test_unset_variables_keep_kvfsms_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (
        "KVFSM_HEARTBEAT_S",
        "KVFSM_LIVENESS_FACTOR",
        "KVFSM_LEASE_S",
        "KVFSM_MAX_LINKS",
        "KVFSM_MAX_LINKS_PER_HOST",
    ):
        monkeypatch.delenv(name, raising=False)
    assert channel_config() == ChannelConfig()


def test_heartbeat_liveness_and_lease_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVFSM_HEARTBEAT_S", "2")
    monkeypatch.setenv("KVFSM_LIVENESS_FACTOR", "5")
    monkeypatch.setenv("KVFSM_LEASE_S", "8")
    config = channel_config()
    assert (config.heartbeat_s, config.liveness_factor, config.lease_s) == (2.0, 5.0, 8.0)
    assert config.silence_s == 10.0


def test_link_bounds_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVFSM_MAX_LINKS", "512")
    monkeypatch.setenv("KVFSM_MAX_LINKS_PER_HOST", "64")
    config = channel_config()
    assert (config.max_links, config.max_links_per_host) == (512, 64)
    monkeypatch.setenv("KVFSM_MAX_LINKS", "1.5")
    with pytest.raises(ValueError, match="KVFSM_MAX_LINKS"):
        channel_config()


@pytest.mark.parametrize("value", ["0", "-1", "soon", "nan"])
def test_a_bad_value_is_refused_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv("KVFSM_HEARTBEAT_S", value)
    with pytest.raises(ValueError, match="KVFSM_HEARTBEAT_S"):
        channel_config()


def test_a_fenced_out_prefill_exits_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    """SGLang takes the server down when a scheduler exits, as on any fatal scheduler error; a
    supervisor restarts it. That beats a prefill that stays up and fails every transfer."""
    configure(None)  # the environment's settings, not the tests' (the fixture restores them)
    monkeypatch.delenv("KVFSM_EXIT_ON_FENCED_OUT", raising=False)
    assert manager_config().exit_on_fenced_out is True
    monkeypatch.setenv("KVFSM_EXIT_ON_FENCED_OUT", "0")
    assert manager_config().exit_on_fenced_out is False
    monkeypatch.setenv("KVFSM_EXIT_ON_FENCED_OUT", "yes")
    with pytest.raises(ValueError, match="KVFSM_EXIT_ON_FENCED_OUT"):
        manager_config()


def test_the_registry_timeout_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    configure(None)  # the environment's settings, not the tests' (the fixture restores them)
    monkeypatch.delenv("KVFSM_REGISTRY_TIMEOUT_S", raising=False)
    assert manager_config().registry_timeout_s == 2.0
    monkeypatch.setenv("KVFSM_REGISTRY_TIMEOUT_S", "7.5")
    assert manager_config().registry_timeout_s == 7.5
    monkeypatch.setenv("KVFSM_REGISTRY_TIMEOUT_S", "0")
    with pytest.raises(ValueError, match="KVFSM_REGISTRY_TIMEOUT_S"):
        manager_config()
