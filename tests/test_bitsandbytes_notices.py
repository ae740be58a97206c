"""bitsandbytes' notice about its hub kernel for fused 4-bit CPU inference, which marl never runs, is dropped
in every process that imports marl, and only that notice: the CPU condition that makes bitsandbytes log it
(AVX512-BF16, no ``kernels`` package) is forced in a fresh process, so the test holds on any CPU."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from support.avx512_bf16 import python_running

REPOSITORY = Path(__file__).resolve().parents[1]
NOTICE = "Failed to load CPU gemm_4bit_forward from kernels-community"
OTHER = "another notice of bitsandbytes' CPU backend"


def stderr_of(*lines: str) -> str:
    environment = {**os.environ, "PYTHONPATH": str(REPOSITORY), "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        python_running(*lines), capture_output=True, text=True, env=environment, check=True
    )
    return result.stderr


def test_only_the_unused_kernel_notice_is_dropped_once_marl_is_imported():
    other = f"logging.getLogger('bitsandbytes.backends.cpu.ops').warning({OTHER!r})"
    # without marl the forced condition makes bitsandbytes log the notice (PEFT imports bitsandbytes)
    assert NOTICE in stderr_of(
        "import peft", "import bitsandbytes.functional as f", "assert f.has_avx512bf16()"
    )
    # marl's modules import PEFT (and through it bitsandbytes) only after the package itself
    assert stderr_of("import logging, marl, peft", other).splitlines() == [OTHER]
    assert stderr_of("import logging, marl.model.quantization, bitsandbytes", other).splitlines() == [OTHER]
