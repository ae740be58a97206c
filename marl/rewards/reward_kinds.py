"""Reward source kinds: the one place that turns a reward setting (a kind and its spec) into a
:class:`~marl.rewards.batch.RewardSource`. ``marl train-rloo``, ``marl evaluate`` and ``marl demo`` build
their sources through :func:`plan_rewards`, never by naming a class.

A kind is a factory called with its spec as soon as the settings are known, before the model loads: it checks
what it can there (a function is imported, so a typo fails before the wait) and returns a builder, which is
called with the loaded :class:`~marl.rewards.batch.RewardParts` (model, tokenizer, rows per pass) and returns
the source. The kinds marl ships:

=============== ======================================================= ==========================
kind            spec and what it scores                                 used by
=============== ======================================================= ==========================
``adapter``     a reward adapter's name; the rows as sampled            ``--reward_adapter``
``eos_adapter`` a reward adapter's name; each text ending in EOS        ``marl demo``, ``evaluate``
``function``    ``module:function``, called as ``f(prompts, texts)``    ``--reward_fn``
=============== ======================================================= ==========================

``marl train-rloo --reward KIND:SPEC`` picks any registered kind by name (:func:`parse_reward_setting`), e.g.
``--reward eos_adapter:sentiment`` reads the adapter that ``--reward_adapter sentiment=DIR`` loaded on texts
ending in EOS instead of on the rows as sampled.

Adding a kind (a remote judge, a rule) is one module with its source and factory, plus one entry in
:data:`REWARD_KINDS` (or one :func:`register_reward_kind` call from your own code).

Example:
    >>> sorted(REWARD_KINDS)
    ['adapter', 'eos_adapter', 'function']
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple, Protocol

from marl.errors import ConfigError
from marl.registry import Registry
from marl.rewards.adapter import adapter_kind, eos_adapter_kind
from marl.rewards.batch import RewardBuilder, RewardParts, RewardSource
from marl.rewards.functions import function_kind


class RewardKind(Protocol):
    """A reward kind's factory: called with the setting's spec before the model loads, it checks the spec
    and returns the builder of the source (``builder(parts) -> RewardSource``)."""

    def __call__(self, spec: str) -> RewardBuilder: ...


# --reward KIND:SPEC picks any kind; --reward_adapter builds 'adapter' sources, --reward_fn 'function' ones.
REWARD_KINDS: Registry[RewardKind] = Registry(
    "reward source kind",
    "--reward",
    "marl.rewards.reward_kinds.register_reward_kind",
    {"adapter": adapter_kind, "eos_adapter": eos_adapter_kind, "function": function_kind},
)


def register_reward_kind(name: str, factory: RewardKind) -> None:
    """Make ``factory`` the reward kind ``name``; a name is registered once (``del REWARD_KINDS[name]`` first
    to replace it).

    Example:
        >>> register_reward_kind("adapter", adapter_kind)
        Traceback (most recent call last):
        ...
        marl.errors.ConfigError: reward source kind 'adapter' is already registered; ...
    """
    REWARD_KINDS.register(name, factory)


def get_reward_kind(name: str) -> RewardKind:
    """The factory of reward kind ``name``.

    Example:
        >>> get_reward_kind("function") is function_kind
        True
        >>> get_reward_kind("nope")
        Traceback (most recent call last):
        ...
        marl.errors.ConfigError: --reward 'nope' is not a registered reward source kind; pass one of [...
    """
    return REWARD_KINDS.lookup(name)


class RewardSetting(NamedTuple):
    """One reward source to build: its kind (a name in :data:`REWARD_KINDS`) and the kind's spec."""

    kind: str
    spec: str


def parse_reward_setting(text: str) -> RewardSetting:
    """A ``--reward KIND:SPEC`` entry as a setting: the kind is what comes before the first colon (a name in
    :data:`REWARD_KINDS`), the spec everything after it.

    Example:
        >>> parse_reward_setting("function:mypkg.rewards:length")
        RewardSetting(kind='function', spec='mypkg.rewards:length')
        >>> parse_reward_setting("sentiment")
        Traceback (most recent call last):
        ...
        marl.errors.ConfigError: --reward 'sentiment' must look like KIND:SPEC, e.g. eos_adapter:NAME ...
    """
    kind, separator, spec = text.partition(":")
    if not separator or not kind or not spec:
        raise ConfigError(
            f"--reward {text!r} must look like KIND:SPEC, e.g. eos_adapter:NAME (a --reward_adapter name) or "
            f"function:module:function; the kinds are {sorted(REWARD_KINDS)}"
        )
    get_reward_kind(kind)
    return RewardSetting(kind, spec)


class RewardPlan(NamedTuple):
    """Reward settings whose specs were checked; :meth:`build` makes their sources from the loaded model."""

    settings: tuple[RewardSetting, ...]
    builders: tuple[RewardBuilder, ...]

    def build(self, parts: RewardParts) -> list[RewardSource]:
        """The sources, in the order of the settings (the order of ``--reward_weights``)."""
        sources = []
        for setting, build in zip(self.settings, self.builders, strict=True):
            source = build(parts)
            if not isinstance(source, RewardSource):
                raise ConfigError(
                    f"reward source kind {setting.kind!r} built a {type(source).__name__} for "
                    f"{setting.spec!r}, not a reward source: it needs a name and a score(batch) method"
                )
            sources.append(source)
        return sources


def plan_rewards(settings: Iterable[RewardSetting | tuple[str, str]]) -> RewardPlan:
    """Check every setting's kind and spec now, before the model loads; build the sources later with
    :meth:`RewardPlan.build`.

    Example:
        >>> plan = plan_rewards([RewardSetting("function", "math:fsum")])
        >>> [source.name for source in plan.build(RewardParts(model=None, tokenizer=None))]
        ['fsum']
        >>> plan_rewards([("function", "no_colon")])
        Traceback (most recent call last):
        ...
        marl.errors.DataError: --reward_fn 'no_colon' must look like 'module:function' or ...
    """
    checked = tuple(RewardSetting(*setting) for setting in settings)
    return RewardPlan(checked, tuple(get_reward_kind(setting.kind)(setting.spec) for setting in checked))
