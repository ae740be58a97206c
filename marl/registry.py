"""Named implementations at marl's extension points: advantage estimators, samplers, reward kinds,
parallelisms. Each point keeps one :class:`Registry`; one set of rules for all four: a name is registered once
(replacing an implementation silently would change what a recorded run's config means), and an unknown name is
a :class:`~marl.errors.ConfigError` naming the flag, the known names and how to add one.

Example:
    >>> shapes = Registry("shape", "--shape", "my_package.register_shape", {"circle": round})
    >>> shapes.lookup("circle") is round
    True
    >>> shapes.lookup("square")
    Traceback (most recent call last):
    ...
    marl.errors.ConfigError: --shape 'square' is not a registered shape; pass one of ['circle'] (a new one ...
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Generic, TypeVar

from marl.errors import ConfigError

Implementation = TypeVar("Implementation", bound=Callable[..., Any])


class Registry(dict[str, Implementation], Generic[Implementation]):
    """A ``name -> implementation`` dict (``del registry[name]`` unregisters) with checked registration and
    lookup. ``what`` names the kind of thing, ``flag`` how a user picks one (``None``: no single flag picks
    it), ``register_with`` the function that adds one."""

    def __init__(
        self,
        what: str,
        flag: str | None,
        register_with: str,
        entries: Mapping[str, Implementation] | None = None,
    ) -> None:
        super().__init__(entries or {})
        self.what, self.flag, self.register_with = what, flag, register_with

    def register(self, name: str, implementation: Implementation) -> None:
        """Add ``implementation`` as ``name``; refuse an empty or taken name and a non-callable."""
        if not isinstance(name, str) or not name:
            raise ConfigError(f"{self.what} names must be non-empty strings, got {name!r}")
        if not callable(implementation):
            raise ConfigError(
                f"{self.what} {name!r}: the factory must be callable, got {type(implementation).__name__}"
            )
        if name in self:
            raise ConfigError(
                f"{self.what} {name!r} is already registered; pick another name, or delete its entry first "
                "to replace it"
            )
        self[name] = implementation

    def lookup(self, name: str) -> Implementation:
        """The implementation registered as ``name``."""
        if name not in self:
            named = f"{self.flag} {name!r}" if self.flag else repr(name)
            raise ConfigError(
                f"{named} is not a registered {self.what}; pass one of {sorted(self)} (a new one is "
                f"registered with {self.register_with})"
            )
        return self[name]
