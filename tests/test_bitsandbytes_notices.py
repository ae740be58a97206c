"""bitsandbytes' notice about its hub kernel for fused 4-bit CPU inference, which marl never runs, is dropped
in every process that imports marl, and only that notice: the CPU condition that makes bitsandbytes log it
(AVX512-BF16, no ``kernels`` package) is forced in a fresh process, so the test holds on any CPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPOSITORY = Path(__file__).resolve().parents[1]
NOTICE = "Failed to load CPU gemm_4bit_forward from kernels-community"
OTHER = "another notice of bitsandbytes' CPU backend"

# bitsandbytes asks its native library whether the CPU has AVX512-BF16 when its CPU backend is imported;
# the answer is forced to yes, and the ``kernels`` package made unimportable, before anything imports it.
AVX512_BF16_WITHOUT_KERNELS = """
import importlib.abc, importlib.util, logging, sys

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


def stderr_of(*lines: str) -> str:
    script = "\n".join([AVX512_BF16_WITHOUT_KERNELS, *lines])
    environment = {**os.environ, "PYTHONPATH": str(REPOSITORY), "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=environment, check=True
    )
    return result.stderr


def test_only_the_unused_kernel_notice_is_dropped_once_marl_is_imported():
    other = f"logging.getLogger('bitsandbytes.backends.cpu.ops').warning({OTHER!r})"
    # without marl the forced condition makes bitsandbytes log the notice (PEFT imports bitsandbytes)
    assert NOTICE in stderr_of(
        "import peft", "import bitsandbytes.functional as f", "assert f.has_avx512bf16()"
    )
    # marl's modules import PEFT (and through it bitsandbytes) only after the package itself
    assert stderr_of("import marl", "import peft", other).splitlines() == [OTHER]
    assert stderr_of("import marl.model.quantization", "import bitsandbytes", other).splitlines() == [OTHER]
