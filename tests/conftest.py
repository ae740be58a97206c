"""Shared fixtures and the ``--run-slow`` option. The tiny models behind the fixtures are built by
``tests/support/tiny.py`` (helpers the tests import) and ``tests/support/families.py`` (the family table)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from hypothesis import settings

from support.tiny import save_reward_adapter, save_tiny_model, train_reward_adapter_with_trl

# Tests share 2 cores with other processes; one intra-op thread keeps them predictable.
torch.set_num_threads(int(os.environ.get("MARL_TEST_THREADS", "1")))
# Property tests check values, not speed: on a loaded 2-core machine one example can take longer than
# hypothesis's 200 ms deadline, and a deadline failure says nothing about the property.
settings.register_profile("marl", deadline=None)
settings.load_profile("marl")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--run-slow", action="store_true", help="also run tests marked slow (CI does)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip_slow = pytest.mark.skip(reason="slow: pass --run-slow to run")
    skip_cuda = pytest.mark.skip(reason="needs a CUDA device (bash scripts/gpu-check.sh runs these)")
    for item in items:
        if "slow" in item.keywords and not config.getoption("--run-slow"):
            item.add_marker(skip_slow)
        if "cuda" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_cuda)


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    """accelerate keeps one process-global state (device, precision): no test may inherit another's."""
    yield
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory: pytest.TempPathFactory):
    """``tiny_model_factory(architecture="llama") -> Path`` of a saved tiny model (built once per session)."""
    cache: dict[str, Path] = {}

    def make(architecture: str = "llama") -> Path:
        if architecture not in cache:
            cache[architecture] = save_tiny_model(
                tmp_path_factory.mktemp(f"tiny-{architecture}"), architecture
            )
        return cache[architecture]

    return make


@pytest.fixture(scope="session")
def tiny_llama_dir(tiny_model_factory) -> Path:
    return tiny_model_factory("llama")


@pytest.fixture(scope="session")
def reward_adapter_factory(tiny_model_factory, tmp_path_factory):
    """``reward_adapter_factory(architecture) -> Path`` of a RewardTrainer-made adapter (built once per
    session)."""
    cache: dict[str, Path] = {}

    def make(architecture: str = "llama") -> Path:
        if architecture not in cache:
            cache[architecture] = train_reward_adapter_with_trl(
                tiny_model_factory(architecture), tmp_path_factory.mktemp(f"reward-{architecture}")
            )
        return cache[architecture]

    return make


@pytest.fixture(scope="session")
def family_dir(tmp_path_factory: pytest.TempPathFactory):
    """``family_dir(name) -> Path`` of a saved tiny model of a family in ``tests/support/families.py`` (built
    once per session)."""
    from support.families import build_family

    cache: dict[str, Path] = {}

    def make(name: str) -> Path:
        if name not in cache:
            cache[name] = build_family(name, tmp_path_factory.mktemp(f"family-{name}"))
        return cache[name]

    return make


@pytest.fixture(scope="session")
def tiny_reward_adapter(tiny_llama_dir, tmp_path_factory) -> Path:
    """A reward adapter (LoRA + score head) on the tiny llama, built once per session."""
    return save_reward_adapter(tiny_llama_dir, tmp_path_factory.mktemp("tiny-reward") / "reward")
