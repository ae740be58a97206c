"""The out-of-memory guard: each phase of an update (sampling, scoring, the update) runs under it, its peak
memory measured for the log beside the plan's, and an out-of-memory error met by halving that phase's size and
running it again (``for attempt in guard.attempts(phase, restore): with attempt: ...``).

**Measured peaks** (:mod:`marl.model.process_memory`): the peak of every phase of every update; the run
logs the latest as ``memory/<phase>_peak_mb`` beside the plan's ``memory/<phase>_plan_mb`` (on CUDA the plan
less its CUDA runtime, which ``max_memory_allocated`` does not see; on CPU the whole plan) and prints the
largest of the run against the plan at the end.

**Out of memory** (``torch.OutOfMemoryError``, one process only): the phase's work is dropped, what the phase
changed is put back (the update: the policy's weights, optimizer, schedule and the rollout's provided
log-probs, copied to the CPU at the update's start), the freed memory given back, the random state set back to
the phase's start, and the phase's size halved:

- sampling: ``rows_per_pass`` of the sampler's ``settings``, in whole prompts (at least one prompt's k rows),
  where the sampler has them (an optional part of :class:`marl.rollout.samplers.Sampler`). The sampler
  draws chunk by chunk, so a retried sampling draws what a run started at the halved size draws;
- scoring: ``rows_per_pass`` of the scorer and of every reward source that chunks (log-probs and scores
  per row: only floating-point rounding can differ);
- the update: ``per_device_train_batch_size`` halved and ``gradient_accumulation_steps`` doubled, so that each
  optimizer step sees the same rows and the same loss (not for ``--loss_type bnpo``, whose loss is a mean
  over each micro-batch's tokens; never below one prompt group where micro-batches hold whole groups).

Then the phase runs again from its start; the rollout already sampled is kept. Each change is printed once and
kept for the rest of the run. When the smallest size fails too, :class:`marl.errors.PhaseMemoryError` names
the phase and the sizes tried (the trainer checkpoints the last completed update first). A phase whose part
cannot be resized (a sampler without ``settings.rows_per_pass``) runs as it is: its out-of-memory error is not
retried, one line says so, and the run ends as at the smallest size. A size is described only once its
phase fails, so that a part is asked only for what its protocol names. Under several
processes an out-of-memory error is not retried: the other processes wait in a collective that the failed one
never reaches.

Test hook: ``MARL_TEST_OUT_OF_MEMORY=PHASE:N`` raises torch's own ``OutOfMemoryError`` at the N-th forward
pass of PHASE counted over the run (once); ``PHASE:N+`` at that one and every later one (the smallest size
fails too).

Example:
    >>> halved_chunk_rows(64, k=4), halved_chunk_rows(12, k=4), halved_chunk_rows(6, k=4)
    (32, 4, None)
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from tqdm import tqdm

from marl.config.batch_sizes import micro_batch_changes_the_loss
from marl.errors import ConfigError, PhaseMemoryError
from marl.model.process_memory import free_cached, peak_bytes, reset_peak
from marl.train.checkpoints import rng_state, set_rng_state

PHASES = ("sampling", "scoring", "update")
TEST_HOOK = "MARL_TEST_OUT_OF_MEMORY"
MB = 1e6
Result = TypeVar("Result")


def is_measurement(metric: str) -> bool:
    """Whether ``metric`` measures the machine rather than the training (``eps`` and the measured peaks): the
    metrics two runs of the same command may differ in, on CPU as well.

    Example:
        >>> [is_measurement(name) for name in ("eps", "memory/update_peak_mb", "memory/update_plan_mb", "lr")]
        [True, True, False, False]
    """
    return metric == "eps" or metric.endswith("_peak_mb")


def halved_chunk_rows(rows: int, k: int) -> int | None:
    """Half of ``rows`` rows per chunk in whole prompts of ``k`` rows (at least one prompt); ``None`` when a
    chunk already holds one prompt's rows."""
    prompts = max(1, rows // k)
    return None if prompts == 1 else (prompts // 2) * k


@dataclass
class Resizable:
    """A phase's size: ``describe()`` says it as flags, ``halve()`` halves it (``False``: at its smallest);
    ``fixed``: why it cannot be resized at all (``None``: it can)."""

    describe: Callable[[], str]
    halve: Callable[[], bool]
    fixed: str | None = None


def sampler_chunk_rows(sampler: Any) -> int | None:
    """The rows per chunk of ``sampler``: ``settings.rows_per_pass`` where its settings are a dataclass that
    has them (the optional part of the sampler protocol the guard resizes), else ``None``.

    Example:
        >>> from types import SimpleNamespace
        >>> from marl.rollout.samplers import SamplerSettings
        >>> settings = SamplerSettings(temperature=1.0, response_length=8, rows_per_pass=16)
        >>> sampler_chunk_rows(SimpleNamespace(settings=settings)), sampler_chunk_rows(object())
        (16, None)
    """
    settings = getattr(sampler, "settings", None)
    rows = getattr(settings, "rows_per_pass", None)
    resizable = dataclasses.is_dataclass(settings) and not isinstance(settings, type)
    return rows if resizable and isinstance(rows, int) else None


def sampling_size(sampler: Any, k: int) -> Resizable:
    """The sampler's rows per chunk (``rows_per_pass`` of its settings); fixed where it has none."""
    if sampler_chunk_rows(sampler) is None:
        name = type(sampler).__name__
        return Resizable(
            lambda: f"sampling as {name} draws",
            lambda: False,
            fixed=f"the sampler {name} cannot be resized (it has no settings.rows_per_pass)",
        )

    def halve() -> bool:
        rows = halved_chunk_rows(sampler.settings.rows_per_pass, k)
        if rows is not None:
            sampler.settings = dataclasses.replace(sampler.settings, rows_per_pass=rows)
        return rows is not None

    return Resizable(lambda: f"sampling rows per chunk {sampler.settings.rows_per_pass}", halve)


def scoring_size(scorer: Any, reward: Any, k: int) -> Resizable:
    """The scorer's rows per chunk, and those of the reward sources that chunk (reward adapters)."""

    def halve() -> bool:
        rows = halved_chunk_rows(scorer.rows_per_pass, k)
        if rows is None:
            return False
        scorer.rows_per_pass = rows
        for source in reward.sources:  # sources that chunk (optional in their protocol) take the same rows
            if isinstance(getattr(source, "rows_per_pass", None), int):
                source.rows_per_pass = rows
        return True

    return Resizable(lambda: f"scoring rows per chunk {scorer.rows_per_pass}", halve)


def update_size(configs: list[Any]) -> Resizable:
    """The micro-batch of every config that updates together (a sweep's members share it)."""
    first = configs[0]

    def halve() -> bool:
        micro, k = first.per_device_train_batch_size, first.rloo_k
        smallest = k if micro % k == 0 else 1  # micro-batches of whole groups stay whole groups
        if micro_batch_changes_the_loss(first.loss_type) or micro % 2 or micro // 2 < smallest:
            return False
        for config in configs:
            config.per_device_train_batch_size //= 2
            config.gradient_accumulation_steps *= 2
        return True

    return Resizable(
        lambda: (
            f"--per_device_train_batch_size {first.per_device_train_batch_size} "
            f"--gradient_accumulation_steps {first.gradient_accumulation_steps}"
        ),
        halve,
    )


def _parse_test_hook(text: str) -> tuple[str, int, bool] | None:
    """``PHASE:N`` or ``PHASE:N+`` as (phase, N, whether every later forward pass fails too)."""
    if not text:
        return None
    phase, _, at = text.partition(":")
    if phase not in PHASES or not at.removesuffix("+").isdigit():
        raise ConfigError(f"{TEST_HOOK}={text!r}: use PHASE:N or PHASE:N+, PHASE one of {PHASES}")
    return phase, int(at.removesuffix("+")), at.endswith("+")


@dataclass
class PhaseGuard:
    """Runs the phases of a run (see the module docstring).

    Attributes:
        device: where the phases run.
        sizes: each phase's :class:`Resizable`.
        embeddings: the base's input embeddings (every forward pass runs them: the test hook's place).
        retry: whether an out-of-memory error is retried smaller (one process only).
        planned: each phase's planned peak in bytes as ``max_memory_allocated`` or the CPU measure sees it,
            when known (the app sets it from the plan); ``replan()`` gives it again after a size changed.
        peaks: each phase's latest measured peak (bytes); ``largest``: the largest of the run.
        changes: the size changes made, as printed.
    """

    device: torch.device
    sizes: dict[str, Resizable]
    embeddings: torch.nn.Module
    retry: bool = True
    planned: dict[str, int] | None = None
    replan: Callable[[], dict[str, int]] | None = None
    peaks: dict[str, int] = field(default_factory=dict)
    largest: dict[str, int] = field(default_factory=dict)
    changes: list[str] = field(default_factory=list)
    _hook: tuple[str, int, bool] | None = field(default=None, init=False)
    _forwards: dict[str, int] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        self._hook = _parse_test_hook(os.environ.get(TEST_HOOK, ""))

    def attempts(self, phase: str, restore: Callable[[], None] | None = None) -> Iterator[Attempt]:
        """The attempts of ``phase``, each to run its work under ``with attempt:``; after an attempt out of
        memory, ``restore()`` puts back what it changed and the next attempt runs at half the size (see the
        module docstring). The loop ends with the first attempt that finishes.

        Example:
            >>> for attempt in guard.attempts("update", restore=snapshot.restore):  # doctest: +SKIP
            ...     with attempt:
            ...         stats = work()
        """
        size, tried = self.sizes[phase], []
        while True:
            attempt = Attempt(self, phase)
            yield attempt
            if attempt.failed is None:
                return
            # the failed attempt's frames are gone here: what it held can be given back
            if restore is not None:
                restore()
            free_cached(self.device)
            set_rng_state(attempt.start)
            tried = tried or [size.describe()]  # described once it failed: the part is asked nothing before
            if size.fixed is not None:
                print(f"marl: out of memory in {phase}: {size.fixed}, so it is not retried", file=sys.stderr)
                raise PhaseMemoryError(phase, tried, attempt.failed)
            if not size.halve():
                raise PhaseMemoryError(phase, tried, attempt.failed)
            tried.append(size.describe())
            self.changes.append(f"out of memory in {phase}: {tried[-2]} -> {tried[-1]}, kept for the rest")
            # on a line of its own: a progress bar drawn on stderr is cleared, then drawn again below it
            tqdm.write(f"marl: {self.changes[-1]} of the run ({attempt.failed})", file=sys.stderr)
            if self.replan is not None:  # the plan's peaks follow the sizes now in force
                self.planned = self.replan()

    def run(
        self, phase: str, work: Callable[[], Result], restore: Callable[[], None] | None = None
    ) -> Result:
        """``work()`` as ``phase``: :meth:`attempts` for a phase that is one call (sampling, scoring)."""
        for attempt in self.attempts(phase, restore):
            with attempt:
                result = work()
        return result

    @contextlib.contextmanager
    def _test_hook(self, phase: str) -> Iterator[None]:
        if self._hook is None or self._hook[0] != phase:
            yield
            return
        _, at, onwards = self._hook

        def maybe_fail(module: Any, args: Any) -> None:
            self._forwards[phase] = self._forwards.get(phase, 0) + 1
            if self._forwards[phase] == at or (onwards and self._forwards[phase] > at):
                raise torch.OutOfMemoryError(f"{TEST_HOOK}: forward pass {self._forwards[phase]} of {phase}")

        handle = self.embeddings.register_forward_pre_hook(maybe_fail)
        try:
            yield
        finally:
            handle.remove()

    def metrics(self) -> dict[str, float]:
        """The latest measured peak of each phase and its plan, in MB."""
        metrics = {f"memory/{phase}_peak_mb": peak / MB for phase, peak in self.peaks.items()}
        for phase, planned in (self.planned or {}).items():
            metrics[f"memory/{phase}_plan_mb"] = planned / MB
        return metrics

    def summary(self, unplanned: str | None = None) -> str | None:
        """One line: each phase's largest measured peak of the run against its plan; ``unplanned``: why the
        plan is not compared (it models another setting than the run's), said instead."""
        if not self.largest:
            return None
        parts = []
        for phase in PHASES:
            if phase not in self.largest:
                continue
            measured, planned = self.largest[phase], (self.planned or {}).get(phase)
            text = f"{phase} {measured / MB:,.0f} MB"
            if planned and unplanned is None:
                text += f" (plan {planned / MB:,.0f} MB, {measured / planned:.0%})"
            parts.append(text)
        where = "allocated on the GPU" if self.device.type == "cuda" else "resident above the imports"
        said = f"; {unplanned}" if unplanned is not None and self.planned else ""
        return f"peak memory per phase ({where}): " + ", ".join(parts) + said


class Attempt:
    """One run of a phase's work under :meth:`PhaseGuard.attempts`: on entering, the random state is kept,
    the peak reset and the test hook armed; on a clean exit the peak is recorded; an out-of-memory error
    (one process only) is swallowed and kept as ``failed`` for the guard to retry smaller."""

    def __init__(self, guard: PhaseGuard, phase: str) -> None:
        self.guard, self.phase = guard, phase
        self.failed: str | None = None
        self.start: dict[str, Any] = {}
        self._hook = contextlib.ExitStack()

    def __enter__(self) -> Attempt:
        self.start = rng_state()
        reset_peak(self.guard.device)
        self._hook.enter_context(self.guard._test_hook(self.phase))
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, trace: Any) -> bool:
        self._hook.close()
        guard = self.guard
        if kind is None:
            peak = peak_bytes(guard.device)
            if peak is not None:
                guard.peaks[self.phase] = peak
                guard.largest[self.phase] = max(peak, guard.largest.get(self.phase, 0))
            return False
        if not issubclass(kind, torch.OutOfMemoryError) or not guard.retry:
            return False
        # only the message is kept: the error's traceback holds the failed attempt's tensors
        self.failed = str(error).splitlines()[0] if str(error) else "out of memory"
        return True


class PolicySnapshot:
    """What an update changes, copied to the CPU at its start so that an out-of-memory error in the middle
    of it can be undone: the policy's weights, the optimizer's state, the schedule, the rollout's log-probs
    (``None`` where the update provides them)."""

    def __init__(self, step: Any, rollout: Any) -> None:
        self.step, self.rollout = step, rollout
        self.weights = [p.detach().to("cpu", copy=True) for p in step.parameters]
        self.optimizer = _to_cpu(step.optimizer.state_dict())
        self.scheduler = step.scheduler.state_dict()
        self.learning_rate = step.last_learning_rate
        self.logprobs = rollout.logprobs

    def restore(self) -> None:
        step = self.step
        step.optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            for parameter, saved in zip(step.parameters, self.weights, strict=True):
                parameter.copy_(saved)
        step.optimizer.load_state_dict(self.optimizer)
        step.scheduler.load_state_dict(self.scheduler)
        step.last_learning_rate = self.learning_rate
        self.rollout.logprobs = self.logprobs
        step.sampler.policy_weights_changed()


def restore_all(snapshots: list[PolicySnapshot]) -> None:
    """Undo what an update did to each policy of a sweep (one snapshot per policy)."""
    for snapshot in snapshots:
        snapshot.restore()


def _to_cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {key: _to_cpu(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_to_cpu(item) for item in value)
    return value


def guard_for(parts: Any, model: Any, configs: list[Any]) -> PhaseGuard:
    """The guard of a run's phases on its :class:`marl.train.training_parts.TrainingParts` and ``model``
    (``configs``: those whose micro-batch changes together: the run's own, or a sweep's members')."""
    k = configs[0].rloo_k
    return PhaseGuard(
        device=parts.parallelism.device,
        sizes={
            "sampling": sampling_size(parts.sampler, k),
            "scoring": scoring_size(parts.scorer, parts.reward, k),
            "update": update_size(configs),
        },
        embeddings=model.peft_model.get_base_model().get_input_embeddings(),
        retry=parts.parallelism.num_processes == 1,
    )
