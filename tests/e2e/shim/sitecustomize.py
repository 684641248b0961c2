"""Test-only start-up hook for the e2e servers (``tests/e2e/shim`` is on their ``PYTHONPATH``):
with ``KVFSM_E2E_CORRUPT_FIRST=1`` it installs the negative control's corrupting NIXL proxy
(``kvfsm_e2e_corrupt``); without it, it does nothing.

The proxy is installed when SGLang itself first imports ``kvfsm.sglang`` in a process, not
here: importing kvfsm (and with it NIXL, UCX and torch) at interpreter start-up, before SGLang
forks and spawns its schedulers, made the corrupting server's scheduler hang before its first
log line in 2 of the suite's clean-clone runs, while servers without the hook never did. An
import hook keeps this server's start-up identical to the others'."""

import os
import sys

if os.environ.get("KVFSM_E2E_CORRUPT_FIRST") == "1":
    import importlib.abc
    import importlib.machinery

    class _InstallAfterImport(importlib.abc.MetaPathFinder):
        """Runs ``kvfsm_e2e_corrupt.install()`` right after ``kvfsm.sglang`` is executed."""

        def find_spec(self, name, path, target=None):  # type: ignore[no-untyped-def]
            if name != "kvfsm.sglang":
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
