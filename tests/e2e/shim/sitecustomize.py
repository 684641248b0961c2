"""Test-only start-up hook for the e2e servers (``tests/e2e/shim`` is on their ``PYTHONPATH``):
with ``KVFSM_E2E_CORRUPT_ARM`` set it installs the negative control's corrupting NIXL proxy
(``kvfsm_e2e_corrupt``), disarmed; without it, it does nothing.

The proxy is installed when ``kvfsm.sglang._manager`` is first imported in a process, that is
when SGLang first asks for kvfsm's classes (the scheduler, to build its manager; the launcher,
for the bootstrap server), not earlier. Installing it needs ``kvfsm.manager`` (NIXL, UCX,
uvloop): done at interpreter start-up, or when SGLang loads its plugins at the top of every
process, it would import them in processes and at moments where a server without the hook
imports nothing of the kind. Here the server's start-up imports exactly what any kvfsm server's
does, in the same order."""

import os
import sys

if os.environ.get("KVFSM_E2E_CORRUPT_ARM"):
    import importlib.abc
    import importlib.machinery

    _TRIGGER = "kvfsm.sglang._manager"

    class _InstallAfterImport(importlib.abc.MetaPathFinder):
        """Runs ``kvfsm_e2e_corrupt.install()`` right after ``_TRIGGER`` is executed."""

        def find_spec(self, name, path, target=None):  # type: ignore[no-untyped-def]
            if name != _TRIGGER:
                return None
            sys.meta_path.remove(self)
            spec = importlib.machinery.PathFinder.find_spec(name, path)
            if spec is None or spec.loader is None:
                return spec
            execute = spec.loader.exec_module

            def exec_then_install(module):  # type: ignore[no-untyped-def]
                execute(module)
                import kvfsm_e2e_corrupt

                kvfsm_e2e_corrupt.install()

            spec.loader.exec_module = exec_then_install  # type: ignore[method-assign]
            return spec

    sys.meta_path.insert(0, _InstallAfterImport())
