"""kvfsm: KV-cache transfer for prefill-decode disaggregation, one state machine per room."""

from __future__ import annotations

from kvfsm.states import KVPoll, Role

__all__ = ["KVPoll", "Role", "__version__"]

__version__ = "0.1.0"
