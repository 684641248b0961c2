"""Test-only start-up hook for the e2e servers (``tests/e2e/shim`` is on their ``PYTHONPATH``):
with ``KVFSM_E2E_CORRUPT_FIRST=1`` it installs the negative control's corrupting NIXL proxy
(``kvfsm_e2e_corrupt``); without it, it does nothing."""

import os

if os.environ.get("KVFSM_E2E_CORRUPT_FIRST") == "1":
    import kvfsm_e2e_corrupt

    kvfsm_e2e_corrupt.install()
