"""A fresh Python process as on a CPU with AVX512-BF16 and without the ``kernels`` package, whatever CPU runs
the test: there bitsandbytes' CPU backend logs, as it is imported, that it could not fetch its hub kernel for
fused 4-bit inference."""

from __future__ import annotations

import sys

# bitsandbytes asks its native library whether the CPU has AVX512-BF16 when its CPU backend is imported;
# the answer is forced to yes, and ``kernels`` made unimportable, before anything imports bitsandbytes.
FORCE_THE_CONDITION = """
import importlib.abc, importlib.util, sys

sys.modules["kernels"] = None


class ForceAvx512Bf16(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "bitsandbytes.functional":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            module.has_avx512bf16 = lambda: True

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, ForceAvx512Bf16())
"""


def python_running(*lines: str) -> list[str]:
    """The command line of a fresh Python process that runs ``lines`` under the condition."""
    return [sys.executable, "-c", "\n".join([FORCE_THE_CONDITION, *lines])]


def module_running(module: str, *words: str) -> list[str]:
    """``python -m MODULE WORDS`` under the condition."""
    run = f"import runpy\nrunpy.run_module({module!r}, run_name='__main__', alter_sys=True)"
    return [*python_running(run), *words]
