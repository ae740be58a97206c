"""Building the model: from a config, and each adapter folder read once."""

from __future__ import annotations

import shutil
from collections import Counter
from pathlib import Path

import torch

from marl import MultiAdapterModel, RLOOConfig
from marl.model import adapters

IDS = torch.tensor([[5, 9, 13, 17, 21, 25], [0, 0, 7, 11, 15, 19]])
MASK = torch.tensor([[1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1]])


def test_overrides_reach_from_pretrained(tiny_llama_dir):
    config = RLOOConfig(model_name_or_path=str(tiny_llama_dir), lora_r=4)
    model = MultiAdapterModel.from_config(config, reference="initial-policy", policy_name="writer")
    assert model.default_policy == "writer" and model.reference_mode == "initial-policy"


def test_a_reward_folder_is_read_once_before_the_base_loads(
    tiny_llama_dir, tiny_reward_adapter, tmp_path, monkeypatch
):
    folder = tmp_path / "reward"
    shutil.copytree(tiny_reward_adapter, folder)
    adapters.write_reward_reading(folder, pad_token_id=0, pad_token="<pad>")
    elsewhere = tmp_path / "moved"
    reads: Counter[str] = Counter()

    def counted(name, function):
        def wrapper(*args, **kwargs):
            reads[name] += 1
            return function(*args, **kwargs)

        return wrapper

    for name in ("read_adapter_config", "load_adapter_state", "read_reward_pad_token_id"):
        monkeypatch.setattr(adapters, name, counted(name, getattr(adapters, name)))
    read_folder = adapters.read_adapter_folder

    def read_then_move_away(directory, **options):
        record = read_folder(directory, **options)
        shutil.move(directory, elsewhere)  # anything that opened the folder again now fails
        return record

    monkeypatch.setattr(adapters, "read_adapter_folder", counted("read_adapter_folder", read_then_move_away))

    model = MultiAdapterModel.from_pretrained(tiny_llama_dir, reward_adapter=folder)

    assert reads == {
        "read_adapter_folder": 1,
        "read_adapter_config": 1,
        "load_adapter_state": 1,
        "read_reward_pad_token_id": 1,
    }
    assert not folder.exists()
    assert model.rewards["reward"].pad_token_id == 0
    monkeypatch.undo()
    reference = MultiAdapterModel.from_pretrained(tiny_llama_dir, reward_adapter=elsewhere)
    torch.testing.assert_close(
        model.compute_reward_score(IDS, MASK), reference.compute_reward_score(IDS, MASK)
    )


def test_add_reward_adapter_reads_its_folder_once(tiny_llama_dir, tiny_reward_adapter, monkeypatch):
    model = MultiAdapterModel.from_pretrained(tiny_llama_dir)
    calls: list[Path] = []
    read_folder = adapters.read_adapter_folder

    def counted(directory, **options):
        calls.append(Path(directory))
        return read_folder(directory, **options)

    monkeypatch.setattr(adapters, "read_adapter_folder", counted)
    model.add_reward_adapter("fluency", tiny_reward_adapter)
    assert calls == [Path(tiny_reward_adapter)]
    assert model.compute_reward_score(IDS, MASK, name="fluency").shape == (2,)
