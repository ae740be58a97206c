"""``--sweep FIELD=V1,V2``: the grid's members, their configs, and every refusal (one line, naming the field,
why and the fix) before any work."""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from marl.config import RLOOConfig
from marl.config.sweep import SHARED_FIELDS, SWEEPABLE_FIELDS, SweepMember, parse_sweep
from marl.errors import ConfigError

FIELDS = {field.name for field in dataclasses.fields(RLOOConfig)}


def test_every_field_is_either_sweepable_or_shared_with_a_reason():
    assert set(SWEEPABLE_FIELDS) <= FIELDS
    assert set(SHARED_FIELDS) <= FIELDS
    assert not set(SWEEPABLE_FIELDS) & set(SHARED_FIELDS)
    assert set(SWEEPABLE_FIELDS) | set(SHARED_FIELDS) == FIELDS  # a new field must be classified
    assert all(reason for reason in [*SWEEPABLE_FIELDS.values(), *SHARED_FIELDS.values()])


def test_members_are_the_product_in_the_order_given(tmp_path):
    base = RLOOConfig(output_dir=str(tmp_path), seed=7, rloo_k=4)
    members = parse_sweep(["learning_rate=1e-4,3e-4", "kl_coef=0.05,0.1,0.2"], base)
    assert len(members) == 6
    assert all(isinstance(member, SweepMember) for member in members)
    assert [(m.config.learning_rate, m.config.kl_coef) for m in members] == [
        (lr, kl) for lr in (1e-4, 3e-4) for kl in (0.05, 0.1, 0.2)
    ]
    first = members[0]
    assert first.name == "learning_rate=1e-4,kl_coef=0.05"
    assert first.config.output_dir == str(tmp_path / first.name)
    # everything not swept is the base config's
    untouched = {
        f for f in FIELDS if f not in ("learning_rate", "kl_coef", "output_dir", "policy_adapter_name")
    }
    for member in members:
        assert {f: getattr(member.config, f) for f in untouched} == {f: getattr(base, f) for f in untouched}
    assert base.learning_rate == RLOOConfig().learning_rate  # the base config is not changed
    assert len({m.name for m in members}) == len({m.config.policy_adapter_name for m in members}) == 6
    assert all("." not in m.config.policy_adapter_name for m in members)  # a module name cannot hold dots


def test_values_are_parsed_with_the_fields_type():
    base = RLOOConfig()
    (member,) = parse_sweep(
        ["reward_weights=1:0.5", "normalize_advantage=true", "seed=3", "lr_scheduler_type=cosine"], base
    )
    config = member.config
    assert config.reward_weights == [1.0, 0.5] and config.normalize_advantage is True
    assert config.seed == 3 and isinstance(config.seed, int) and config.lr_scheduler_type == "cosine"
    (member,) = parse_sweep(["kl_placement=loss"], base)  # the older flag follows the new one
    assert member.config.kl_placement == "loss" and member.config.token_level_kl


def test_a_one_value_list_sets_the_field_and_names_it():
    (member,) = parse_sweep(["kl_coef=0.1"], RLOOConfig(output_dir="out"))
    assert member.name == "kl_coef=0.1" and member.config.kl_coef == 0.1
    assert member.config.output_dir == "out/kl_coef=0.1"


@pytest.mark.parametrize(
    ("specs", "message"),
    [
        ([], "no --sweep given"),
        (["learning_rate"], r"'learning_rate' is not FIELD=V1,V2"),
        (["learning_rate="], "is not FIELD=V1,V2"),
        (["learning_rate=1e-4,,3e-4"], "is not FIELD=V1,V2"),
        (["=1,2"], "is not FIELD=V1,V2"),
        (["learnin_rate=1e-4,3e-4"], "no such setting; did you mean learning_rate"),
        (["beta=0.1,0.2"], "no such setting; did you mean kl_coef"),
        (["rloo_k=2,4"], r"rloo_k: cannot differ .*one batched decode.*Set --rloo_k once"),
        (["quantization=4bit,none"], "quantization: cannot differ .*one base"),
        # a path or hub id is refused for what it is, not for the characters of a folder name
        (["model_name_or_path=org/name,/home/me/base"], "model_name_or_path: cannot differ .*share one base"),
        (["policy_adapter=adapters/sft,b"], "policy_adapter: cannot differ .*fresh LoRA"),
        (["temperature=0.7,1.0"], "temperature: cannot differ"),
        (["algorithm=rloo,grpo"], "algorithm: cannot differ .*sweep its fields"),
        (["output_dir=a,b"], "output_dir: cannot differ"),
        (["seed=1,2", "seed=3"], "seed is given twice"),
        (["seed=1,2,1"], r"\['1'\] appear more than once"),
        (["learning_rate=1e-4,0.0001"], "appear more than once"),
        (["learning_rate=fast,1e-4"], "'fast' is not a number"),
        (["seed=1.5"], "'1.5' is not an integer"),
        (["normalize_advantage=maybe"], "not true or false"),
        (["learning_rate=1e-4,-1"], "member learning_rate=-1: .*non-negative"),
        (["kl_coef=0.1,a/b"], "characters a folder name"),
        (["learning_rate=nan"], "member learning_rate=nan: .*not a finite number"),
    ],
)
def test_bad_specs_are_refused_in_one_line(specs, message):
    with pytest.raises(ConfigError, match=message) as caught:
        parse_sweep(specs, RLOOConfig())
    assert "\n" not in str(caught.value)


@settings(max_examples=30, deadline=None)
@given(
    st.lists(st.integers(0, 10_000), min_size=1, max_size=4, unique=True),
    st.lists(st.floats(1e-6, 1e-2, allow_nan=False), min_size=1, max_size=3, unique=True),
)
def test_any_grid_gives_unique_members_with_their_values(seeds, rates):
    specs = [f"seed={','.join(map(str, seeds))}", f"learning_rate={','.join(map(repr, rates))}"]
    members = parse_sweep(specs, RLOOConfig())
    assert len(members) == len(seeds) * len(rates)
    assert len({member.name for member in members}) == len(members)
    assert len({member.config.output_dir for member in members}) == len(members)
    pairs = [(member.config.seed, member.config.learning_rate) for member in members]
    assert pairs == [(seed, rate) for seed in seeds for rate in rates]
    assert all(math.isfinite(rate) for _, rate in pairs)
