"""Test-only start-up hooks for the e2e servers (``tests/e2e/shim`` is on their ``PYTHONPATH``);
without their variables they do nothing.

* ``KVFSM_E2E_CORRUPT_ARM``: the negative control's corrupting NIXL proxy
  (``kvfsm_e2e_corrupt``), installed disarmed.
* ``KVFSM_E2E_CPU_KV_CHECKSUM``: a CPU digest for SGLang's KV checksum
  (``kvfsm_e2e_cpu_checksum``).

Each is installed right after the module it changes is first imported in a process, not
earlier. The proxy waits for ``kvfsm.sglang._manager``, that is for SGLang to first ask for
kvfsm's classes (the scheduler, to build its manager; the launcher, for the bootstrap server):
installing it needs ``kvfsm.manager`` (NIXL, UCX, uvloop), and done at interpreter start-up, or
when SGLang loads its plugins at the top of every process, it would import them in processes
and at moments where a server without the hook imports nothing of the kind. Here the server's
start-up imports exactly what any kvfsm server's does, in the same order. The checksum digest
waits for SGLang's own checksum module for the same reason."""

import os
import sys


def _after_import(trigger, then):  # type: ignore[no-untyped-def]
    """Runs ``then(module)`` right after the module named ``trigger`` is executed."""
    import importlib.abc
    import importlib.machinery

    class _InstallAfterImport(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):  # type: ignore[no-untyped-def]
            if name != trigger:
                return None
            sys.meta_path.remove(self)
            spec = importlib.machinery.PathFinder.find_spec(name, path)
            if spec is None or spec.loader is None:
                return spec
            execute = spec.loader.exec_module

            def exec_then_install(module):  # type: ignore[no-untyped-def]
                execute(module)
                then(module)

            spec.loader.exec_module = exec_then_install  # type: ignore[method-assign]
            return spec

    sys.meta_path.insert(0, _InstallAfterImport())


def _install_corrupting_proxy(module):  # type: ignore[no-untyped-def]
    import kvfsm_e2e_corrupt

    kvfsm_e2e_corrupt.install()


def _install_cpu_checksum(module):  # type: ignore[no-untyped-def]
    import kvfsm_e2e_cpu_checksum

    kvfsm_e2e_cpu_checksum.install(module)


if os.environ.get("KVFSM_E2E_CORRUPT_ARM"):
    _after_import("kvfsm.sglang._manager", _install_corrupting_proxy)
if os.environ.get("KVFSM_E2E_CPU_KV_CHECKSUM"):
    _after_import("sglang.srt.disaggregation.checksum", _install_cpu_checksum)
