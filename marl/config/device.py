"""The settings chosen for the device a run trains on, when they are not given, and how ``--sampler graph``
captures its decode step there (``--graph_capture``).

On a CUDA device: bf16 mixed precision (fp16 on a card without bfloat16) and gradient checkpointing, as TRL's
configs default them, and the ``graph`` sampler; on a CPU neither precision nor checkpointing (CPU bfloat16
matmuls are slow and round more, and activations sit in the machine's memory) and the ``static`` sampler.
On a GPU a small decode step is bound by kernel launches, which ``graph`` removes by replaying the step
captured per row bucket, after a first sampling call that compiles
(``benchmarks/results/2026-11-27-gpu-sequence.md``); on a CPU each row costs compute and a launch costs
little, so ``static``, which drops finished rows every step, is fastest there.

``RLOOConfig``'s ``bf16``, ``fp16``, ``gradient_checkpointing`` and ``sampler`` are unset (``None``) unless
given on the command line, in the ``--config`` file or in Python; a given value always wins.
:func:`resolve_device_settings` is the one owner of the rule: ``train-rloo`` resolves for the device it will
train on (right after its flags are parsed), ``marl plan`` for its ``--device``, and ``RLOOTrainer`` for its
model's device when a config built in Python reaches it unresolved. The choices and their reasons go to
``config.chosen_for_device``, which the start of a run prints and ``rloo_config.json`` records.

``--graph_capture`` (``--sampler graph`` on a GPU only):

- ``compile``: ``torch.compile(mode="reduce-overhead", fullgraph=True)``, inductor's fused kernels replayed in
  CUDA graphs; each row bucket is compiled first;
- ``cuda_graphs``: the eager decode step captured as it is in one ``torch.cuda.CUDAGraph`` per row bucket and
  cache length, no inductor: a capture costs a few eager steps, a replay launches the eager step's kernels
  without Python (a small model's decode step is bound by those launches, not by what fusion saves).

Example:
    >>> unset = {"bf16": None, "fp16": None, "gradient_checkpointing": None, "sampler": None}
    >>> {name: value for name, (value, _) in choose_device_settings(unset, Device("cuda")).items()}
    {'bf16': True, 'fp16': False, 'gradient_checkpointing': True, 'sampler': 'graph'}
    >>> choose_device_settings(
    ...     {**unset, "fp16": True, "gradient_checkpointing": False, "sampler": "static"}, Device("cuda")
    ... )
    {'bf16': (False, 'off: --fp16 is given')}
    >>> from types import SimpleNamespace
    >>> check_graph_capture(SimpleNamespace(graph_capture="cuda_graphs", sampler="static"))
    Traceback (most recent call last):
    ...
    marl.errors.ConfigError: --graph_capture cuda_graphs applies to --sampler graph only (this run samples ...
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from marl.errors import ConfigError

DEVICE_FIELDS = ("bf16", "fp16", "gradient_checkpointing", "sampler")
DEVICE_TYPES = ("cuda", "cpu")
# The sampler of each device type when --sampler is not given, and why (the module's docstring says more).
DEVICE_SAMPLERS = {
    "cuda": ("graph", "a CUDA device (the decode step replayed from CUDA graphs, without the kernel launches "
             "that bound a small decode step; its first sampling call compiles)"),
    "cpu": ("static", "a CPU (finished rows leave the decode every step)"),
}  # fmt: skip
# The help texts of the fields, here beside the rule they describe.
HELP = {
    "bf16": "bfloat16 compute (mixed precision through accelerate). Default: on with a CUDA device that has "
    "bfloat16 (TRL's default), off on a CPU (marl.config.device).",
    "fp16": "float16 compute (mixed precision through accelerate). Default: on with a CUDA device without "
    "bfloat16, otherwise off.",
    "gradient_checkpointing": "Recompute activations in the backward pass to save memory (about a third more "
    "update compute). Default: on with a CUDA device (TRL's default), off on a CPU.",
    "sampler": "What draws the completions: 'static' (a decode loop over a static KV cache, the same tokens "
    "as 'transformers' for one seed), 'graph' (that decode in fixed row buckets, compiled and captured in "
    "CUDA graphs on a GPU; the same tokens too), 'transformers' (generate on the training model) or a name "
    "registered with marl.rollout.samplers.register_sampler. Default: graph on a CUDA device, static on a "
    "CPU (marl.config.device).",
}


def device_sampler(device_type: str) -> str:
    """The sampler a run on ``device_type`` uses when ``--sampler`` is not given (:data:`DEVICE_SAMPLERS`).

    Example:
        >>> device_sampler("cuda"), device_sampler("cpu")
        ('graph', 'static')
    """
    return DEVICE_SAMPLERS["cuda" if device_type == "cuda" else "cpu"][0]


def device_field(name: str) -> Any:
    """The ``RLOOConfig`` field ``name`` of :data:`DEVICE_FIELDS`: unset (``None``) until the device is known,
    with its help text."""
    return field(default=None, metadata={"help": HELP[name]})


@dataclass(frozen=True)
class Device:
    """Where a run trains, as far as its defaults depend on it: ``"cuda"`` or ``"cpu"``, and whether the CUDA
    device computes in bfloat16 (compute capability 8.0, Ampere, or newer)."""

    type: str
    supports_bf16: bool = True

    @classmethod
    def named(cls, device_type: str) -> Device:
        """``device_type`` on this machine: a CUDA device's bfloat16 support is asked of torch when a card is
        present, and assumed otherwise (``marl plan --device cuda`` on a machine without one plans in
        bfloat16, as its weights do).

        Example:
            >>> Device.named("cpu")
            Device(type='cpu', supports_bf16=False)
        """
        if device_type not in DEVICE_TYPES:
            raise ConfigError(
                f"--device {device_type!r} is not one of {list(DEVICE_TYPES)}: pass cuda or cpu"
            )
        if device_type == "cpu":
            return cls("cpu", supports_bf16=False)
        import torch

        return cls("cuda", not torch.cuda.is_available() or torch.cuda.is_bf16_supported())

    @classmethod
    def current(cls) -> Device:
        """The device a run started here trains on: the CUDA device when there is one, else the CPU."""
        import torch

        return cls.named("cuda" if torch.cuda.is_available() else "cpu")


def choose_device_settings(
    given: Mapping[str, bool | str | None], device: Device
) -> dict[str, tuple[bool | str, str]]:
    """The value and the reason of every field of :data:`DEVICE_FIELDS` that ``given`` leaves unset
    (``None``). A precision given (``bf16`` or ``fp16``) leaves the other off; none given: bf16 on a CUDA
    device with bfloat16, fp16 on one without, neither on a CPU. The sampler: :data:`DEVICE_SAMPLERS`."""
    chosen: dict[str, tuple[bool | str, str]] = {}
    cuda = device.type == "cuda"
    precision_given = [name for name in ("bf16", "fp16") if given.get(name) is not None]
    for name in ("bf16", "fp16"):
        if given.get(name) is not None:
            continue
        if precision_given:
            chosen[name] = (False, f"off: --{precision_given[0]} is given")
        elif not cuda:
            chosen[name] = (False, "off: a CPU computes in float32")
        elif name == "bf16":
            on = device.supports_bf16
            reason = "the CUDA device computes in bfloat16" if on else "the CUDA device has no bfloat16"
            chosen[name] = (on, f"{'on' if on else 'off'}: {reason}" + (" (TRL's default)" if on else ""))
        else:
            on = not device.supports_bf16
            chosen[name] = (on, "on: the CUDA device has no bfloat16" if on else "off: bf16 is on")
    if given.get("gradient_checkpointing") is None:
        chosen["gradient_checkpointing"] = (
            (True, "on: a CUDA device (TRL's default; about a third more update compute for a small fraction "
                   "of the activation memory)")
            if cuda
            else (False, "off: a CPU (activations sit in the machine's memory)")
        )  # fmt: skip
    if given.get("sampler") is None:
        sampler, why = DEVICE_SAMPLERS[device.type]
        chosen["sampler"] = (sampler, f"{sampler}: {why}")
    return chosen


def resolve_device_settings(settings: Any, device: Device) -> dict[str, str]:
    """Set ``settings``' unset device fields for ``device`` (:func:`choose_device_settings`) and return what
    was chosen and why (also kept as ``settings.chosen_for_device``, beside earlier choices); a config already
    resolved is left as it is.

    Example:
        >>> from types import SimpleNamespace
        >>> settings = SimpleNamespace(bf16=None, fp16=None, gradient_checkpointing=True, sampler="static")
        >>> resolve_device_settings(settings, Device("cpu", supports_bf16=False))
        {'bf16': 'off: a CPU computes in float32', 'fp16': 'off: a CPU computes in float32'}
        >>> settings.bf16, settings.gradient_checkpointing
        (False, True)
    """
    given = {name: getattr(settings, name) for name in DEVICE_FIELDS}
    chosen = choose_device_settings(given, device)
    for name, (value, _reason) in chosen.items():
        setattr(settings, name, value)
    reasons = {name: reason for name, (_value, reason) in chosen.items()}
    settings.chosen_for_device = {**getattr(settings, "chosen_for_device", {}), **reasons}
    return reasons


def describe_choices(reasons: Mapping[str, str], device_type: str) -> str:
    """One line saying what was chosen for the device and why, and how to choose otherwise (empty when
    nothing was chosen).

    Example:
        >>> print(describe_choices({"gradient_checkpointing": "on: a CUDA device"}, "cuda"))
        chosen for the cuda device: gradient_checkpointing on: a CUDA device; give a flag (e.g. \
--gradient_checkpointing false) to choose otherwise
    """
    if not reasons:
        return ""
    choices = "; ".join(f"{name} {reason}" for name, reason in reasons.items())
    example = next(iter(reasons))
    if example == "sampler":
        other = "static" if reasons[example].startswith("graph") else "graph"
    else:
        other = "false" if reasons[example].startswith("on") else "true"
    return (
        f"chosen for the {device_type} device: {choices}; give a flag (e.g. --{example} {other}) to "
        "choose otherwise"
    )


# How --sampler graph captures its decode step on a GPU (the module docstring says more).
GRAPH_CAPTURES = ("compile", "cuda_graphs")
DEFAULT_GRAPH_CAPTURE = "compile"
GRAPH_CAPTURE_HELP = (
    "How --sampler graph captures its decode step on a GPU: 'compile' (torch.compile with "
    "mode='reduce-overhead': inductor's kernels in CUDA graphs, each row bucket compiled first) or "
    "'cuda_graphs' (the eager step captured in one torch.cuda.CUDAGraph per row bucket and cache length, no "
    "inductor: seconds to capture, no fusion). A capture that fails decodes eager, with the reason logged. "
    "On a CPU both decode eager."
)


def graph_capture_field() -> Any:
    """The ``graph_capture`` field of :class:`marl.RLOOConfig`."""
    return field(
        default=DEFAULT_GRAPH_CAPTURE, metadata={"help": GRAPH_CAPTURE_HELP, "choices": GRAPH_CAPTURES}
    )


def check_graph_capture(config: Any) -> None:
    """Refuse a ``graph_capture`` other than the default for a sampler that captures nothing (the flag would
    do nothing); an unset sampler is the device's, ``graph`` on a CUDA device (:data:`DEVICE_SAMPLERS`).
    Its choices are checked with every field's (:func:`marl.config.checks.check_fields`)."""
    if config.graph_capture != DEFAULT_GRAPH_CAPTURE and config.sampler not in (None, "graph"):
        raise ConfigError(
            f"--graph_capture {config.graph_capture} applies to --sampler graph only (this run samples with "
            f"--sampler {config.sampler}). Add --sampler graph, or drop --graph_capture"
        )
