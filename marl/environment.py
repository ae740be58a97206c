"""What a result was measured on: package versions and the machine, for summaries and benchmark reports."""

from __future__ import annotations

import os
import platform
from collections.abc import Sequence

# marl is installed as the distribution marl-rlhf (the name "marl" on the public index is another project).
PACKAGES = ("marl-rlhf", "torch", "transformers", "peft", "trl", "bitsandbytes", "accelerate", "datasets")


def package_versions(packages: tuple[str, ...] = PACKAGES) -> dict[str, str]:
    """The installed version of each package (``"not installed"`` when it is missing).

    Example:
        >>> package_versions(("no-such-package",))
        {'no-such-package': 'not installed'}
    """
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for package in packages:
        try:
            found[package] = version(package)
        except PackageNotFoundError:
            found[package] = "not installed"
    return found


def unmet_requirements(requirements: Sequence[str]) -> list[str]:
    """The requirements (PEP 508 strings such as ``"torch>=2.13.0"``) that the installed packages do not meet,
    each with what is installed: for a run of marl from a checkout, which pip never checked.

    Example:
        >>> unmet_requirements(["no-such-package>=1.0"])
        ['no-such-package>=1.0 (not installed)']
        >>> unmet_requirements(["packaging>=0.1"])
        []
    """
    from packaging.requirements import Requirement

    unmet = []
    for text in requirements:
        requirement = Requirement(text)
        installed = package_versions((requirement.name,))[requirement.name]
        if installed == "not installed" or not requirement.specifier.contains(installed, prereleases=True):
            unmet.append(f"{text} ({installed})")
    return unmet


def machine_description() -> dict[str, str]:
    """The processor, its core count, the memory, the OS and Python, and whether a GPU is visible."""
    import torch

    memory = ""
    if os.path.exists("/proc/meminfo"):
        with open("/proc/meminfo") as handle:
            total_kib = int(next(line for line in handle if line.startswith("MemTotal")).split()[1])
        memory = f"{total_kib / 2**20:.0f} GiB"
    processor = platform.processor() or platform.machine()
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as handle:
            names = [line.split(":", 1)[1].strip() for line in handle if line.startswith("model name")]
        processor = names[0] if names else processor
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    return {
        "processor": processor,
        "cores": str(os.cpu_count()),
        "memory": memory,
        "system": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "gpu": gpu,
        "torch threads": str(torch.get_num_threads()),
    }
