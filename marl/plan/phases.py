"""The phases of an RLOO update, run on a meta-device model with the shapes of a run, as each system compared
runs them: what each phase makes.

Each program calls the same code the trainer calls (the family's forward, PEFT's LoRA layers, the static
KV cache, :func:`marl.model.rows.pack_rows`, :func:`marl.model.forward.logprobs_from_hidden`) on
tensors of the run's shapes, and :class:`marl.plan.trace.LiveBytes` records the largest sum of what they
hold at once: the working set of that phase, above the weights and the training state.

- **sampling**: one chunk of the sampler: its prompts prefilled into a ``StaticCache`` sized prompt +
  response, the cache repeated for the k samples, the float32 distribution of every row, one decode step;
- **scoring**: one chunk of rows through the policy (then the reference) with no gradient, each prompt once
  when packed, the LM head and log-softmax per chunk of positions; and the reward adapter's pass (the
  backbone and a score head, no LM head);
- **graph sampler's buffers** (``--sampler graph``): the key/value buffers of its largest row bucket, kept
  from its first sampling call to the end of the run (its captured steps read them), so held in every phase;
- **update**: one micro-batch forward with gradients, its log-probs and entropies, a loss, the backward
  pass (with gradient checkpointing when the run has it), the LoRA gradients it leaves.

The same job as three systems would hold it (:data:`SYSTEMS`), the planner's models of those systems, used to
put marl's prediction beside theirs; only marl's is validated against measurements:

- ``marl``: one base; policy LoRA, reference (adapters off) and reward LoRAs on it; prompts computed once
  for their k samples (static cache, packed scoring and update); the LM head and float32 log-softmax in
  chunks of positions.
- ``trl-rloo``: the policy's base shared with the reference (``peft_config``), the reward model a second
  base (a sequence classifier: no LM head) with its LoRA and head; the whole rollout generated at once with
  every prompt repeated k times, scored micro-batch by micro-batch, every completion with its own prompt,
  the logits of every completion position at once.
- ``ppo``: four bases (policy, reference, reward, value); a trainable LoRA and a head on the value model
  too; the value model's backbone runs with gradients beside the policy's in the update; otherwise as
  ``trl-rloo``.

Every system keeps its trainable LoRA and AdamW state in float32 here.

Example:
    >>> shapes = PhaseShapes(prompt_length=32, response_length=16, rloo_k=4, rows_per_pass=8,
    ...     micro_batch_rows=8, share_prompt_prefix=True, gradient_checkpointing=False, temperature=0.7)
    >>> shapes.packed_length, shapes.groups_per_micro_batch
    (96, 2)
    >>> sorted(SYSTEMS), SYSTEMS["ppo"].value_model
    (['marl', 'ppo', 'trl-rloo'], True)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from marl.model.families import LogitHead, backbone
from marl.model.forward import logprobs_from_hidden
from marl.model.graph_decode import row_buckets, width_bucket
from marl.model.rows import pack_rows
from marl.model.sampling import _repeat_rows, cache_argument
from marl.plan.trace import LiveBytes


@dataclass(frozen=True)
class PhaseShapes:
    """The shapes of one run that decide what its phases hold (one process)."""

    prompt_length: int  # tokens of the longest prompt of a batch
    response_length: int
    rloo_k: int
    rows_per_pass: int  # local_rollout_forward_batch_size: rows per sampling / scoring chunk
    micro_batch_rows: int  # per_device_train_batch_size
    share_prompt_prefix: bool
    gradient_checkpointing: bool
    temperature: float = 1.0

    @property
    def prompts_per_pass(self) -> int:
        return max(1, self.rows_per_pass // self.rloo_k)

    @property
    def packed_length(self) -> int:
        """One prompt and its k completions in one sequence."""
        return self.prompt_length + self.rloo_k * self.response_length

    @property
    def micro_batch_packs(self) -> bool:
        """The update packs a micro-batch when it holds whole prompt groups (as the trainer decides)."""
        return self.share_prompt_prefix and self.micro_batch_rows % self.rloo_k == 0

    @property
    def groups_per_micro_batch(self) -> int:
        return max(1, self.micro_batch_rows // self.rloo_k)


@dataclass(frozen=True)
class SystemLayout:
    """How one system lays the job out in memory."""

    label: str
    packs: bool  # prompts computed once for their k samples (sampling, scoring, update)
    full_logits: bool  # the logits of every completion position at once (else chunked float32)
    value_model: bool  # PPO: a reference base, a value base with a trainable LoRA, a second backbone pass
    notes: tuple[str, ...] = ()

    def resident(
        self,
        *,
        base_bytes: int,
        classifier_bytes: int,
        policy_parameters: int,
        reward_bytes: int,
        num_rewards: int,
        reference_copy: bool,
    ) -> dict[str, int]:
        """Bytes that stay for the whole run, by part."""
        trainable = 4 * policy_parameters
        parts = {
            "base weights": base_bytes,
            "policy LoRA (float32)": trainable,
            "reward LoRAs + score heads": reward_bytes,
            "reference copy of the policy": trainable if reference_copy and self.packs else 0,
            "AdamW moments (float32)": 2 * trainable,
        }
        if not self.packs:  # separate reward model(s): each a sequence classifier on its own base
            parts["reward model bases"] = num_rewards * classifier_bytes
        if self.value_model:
            parts["reference model base"] = base_bytes
            parts["value model base + LoRA + AdamW"] = classifier_bytes + 3 * trainable
        return parts


SYSTEMS: dict[str, SystemLayout] = {
    "marl": SystemLayout("marl", packs=True, full_logits=False, value_model=False),
    "trl-rloo": SystemLayout(
        "TRL RLOOTrainer + peft_config (planner's model)",
        packs=False,
        full_logits=True,
        value_model=False,
        notes=("a prediction of the planner's model of TRL 1.16's RLOOTrainer, not a measurement",),
    ),
    "ppo": SystemLayout(
        "PPO, four copies (planner's model)",
        packs=False,
        full_logits=True,
        value_model=True,
        notes=("a prediction of the planner's model of PPO with four models, not a measurement",),
    ),
}


def _device(model: nn.Module) -> torch.device:
    """Where the phases run: the model's device (``meta`` when planning; a real one to check the counts)."""
    return next(model.parameters()).device


def _zeros(device: torch.device, *shape: int, dtype: torch.dtype = torch.long) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype, device=device)


def _packed(groups: int, shapes: PhaseShapes, mask_dtype: torch.dtype, device: torch.device):
    """marl's packed rows for ``groups`` prompts of ``prompt_length`` tokens and k full completions, made by
    :func:`pack_rows` on small CPU index tensors and moved to ``device``."""
    k, prompt, steps = shapes.rloo_k, shapes.prompt_length, shapes.response_length
    rows = groups * k
    packed = pack_rows(
        torch.ones(rows, prompt, dtype=torch.long),
        torch.ones(rows, prompt, dtype=torch.long),
        torch.ones(rows, steps, dtype=torch.long),
        torch.ones(rows, steps, dtype=torch.bool),
        torch.arange(groups).repeat(k),
        mask_dtype,
    )
    names = ("input_ids", "attention_mask", "position_ids", "predictors")
    return {name: getattr(packed, name).to(device) for name in names}


def _hidden_for_logprobs(model: nn.Module, rows: int, shapes: PhaseShapes, packed: bool) -> torch.Tensor:
    """Final hidden states ``[rows * T, H]`` that predict the completions' tokens."""
    body, device = backbone(model.get_base_model()), _device(model)
    if packed:
        groups = max(1, rows // shapes.rloo_k)
        inputs = _packed(groups, shapes, torch.bool, device)
        hidden = body(
            input_ids=inputs["input_ids"],
            attention_mask=_per_layer_type(model, inputs["attention_mask"]),
            position_ids=inputs["position_ids"],
            use_cache=False,
        ).last_hidden_state
        return hidden.reshape(-1, hidden.shape[-1])[inputs["predictors"].reshape(-1)]
    length = shapes.prompt_length + shapes.response_length
    hidden = body(
        input_ids=_zeros(device, rows, length),
        attention_mask=_causal_mask(model, rows, length),
        position_ids=_zeros(device, rows, length),
        use_cache=False,
    ).last_hidden_state
    return hidden[:, shapes.prompt_length - 1 : -1].reshape(-1, hidden.shape[-1])


def _logprobs(
    hidden: torch.Tensor,
    logit_head: Callable,
    shapes: PhaseShapes,
    full_logits: bool,
    with_entropy: bool = False,
    recompute: bool = False,
):
    """Log-probs of the predicted tokens: marl's chunked head and float32 log-softmax, or (``full_logits``,
    as TRL computes them) the logits of every position at once, divided by the temperature, then a
    log-softmax."""
    targets = _zeros(hidden.device, hidden.shape[0])
    if not full_logits:
        return logprobs_from_hidden(hidden, targets, logit_head, shapes.temperature,
                                    with_entropy=with_entropy, recompute=recompute)  # fmt: skip
    logits = logit_head(hidden) / shapes.temperature
    logprobs = logits.gather(-1, targets[:, None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)
    return (logprobs, None) if with_entropy else logprobs


def _causal_mask(model: nn.Module, rows: int, length: int) -> torch.Tensor | dict[str, torch.Tensor]:
    """The 4-D boolean mask SDPA receives for ``rows`` padded rows of ``length`` tokens (transformers builds
    it from the 2-D padding mask; here it is given, so that no data-dependent check runs on the meta
    device), one per layer type for models that mix full and sliding-window layers."""
    return _per_layer_type(
        model, torch.ones(rows, 1, length, length, dtype=torch.bool, device=_device(model))
    )


def _cache_mask(model: nn.Module, rows: int, queries: int, keys: int) -> torch.Tensor | None:
    """The 4-D mask of ``queries`` new tokens over a static cache of ``keys`` positions, or ``None`` for a
    model with sliding-window layers (whose caches are shorter: transformers makes their masks from the
    positions, as it does for unpadded rows)."""
    layer_types = getattr(model.get_base_model().config.get_text_config(), "layer_types", None) or ()
    if "sliding_attention" in layer_types:
        return None
    return torch.ones(rows, 1, queries, keys, dtype=torch.bool, device=_device(model))


def _per_layer_type(model: nn.Module, mask: torch.Tensor) -> torch.Tensor | dict[str, torch.Tensor]:
    """``mask`` as a model that mixes full and sliding-window layers takes a given 4-D mask: one per type."""
    layer_types = getattr(model.get_base_model().config.get_text_config(), "layer_types", None)
    return {kind: mask for kind in set(layer_types)} if layer_types and len(set(layer_types)) > 1 else mask


def sampling_peak(model: nn.Module, shapes: PhaseShapes, shared_prefill: bool = True) -> int:
    """Bytes the static sampler holds at most for one chunk: prefill, cache of every row, distributions.
    Without ``shared_prefill`` every row prefills its own copy of its prompt (``generate`` on repeated
    prompts)."""
    from transformers import StaticCache

    prompts, k = shapes.prompts_per_pass, shapes.rloo_k
    if not shared_prefill:
        prompts, k = prompts * k, 1
    rows, width = prompts * k, shapes.prompt_length + shapes.response_length
    device = _device(model)
    with LiveBytes() as live, torch.no_grad():
        cache = StaticCache(config=model.get_base_model().config, max_cache_len=width)
        logits = model(
            input_ids=_zeros(device, prompts, shapes.prompt_length),
            attention_mask=_cache_mask(model, prompts, shapes.prompt_length, width),
            position_ids=_zeros(device, prompts, shapes.prompt_length),
            **cache_argument(model, cache),
            use_cache=True,
            logits_to_keep=1,
        ).logits
        _repeat_rows(cache, k)
        logits = logits[:, -1].float().repeat_interleave(k, dim=0)
        mask = _zeros(device, rows, width)
        completions = _zeros(device, rows, shapes.response_length)
        probs = torch.softmax(logits / shapes.temperature, dim=-1)
        drawn = torch.multinomial(probs, num_samples=1)
        step = model(
            input_ids=drawn,
            attention_mask=_cache_mask(model, rows, 1, width),
            position_ids=_zeros(device, rows, 1),
            **cache_argument(model, cache),
            use_cache=True,
            logits_to_keep=1,
        ).logits
        torch.softmax(step[:, -1].float() / shapes.temperature, dim=-1)
        del cache, mask, completions
    return live.peak


def decode_cache_bytes(model: nn.Module, rows: int, length: int) -> int:
    """Bytes of the keys and values a ``StaticCache`` of ``rows`` rows and ``length`` positions holds, as the
    model fills it (its layers' dtypes and shapes, sliding-window layers shorter)."""
    from transformers import StaticCache

    device = _device(model)
    cache = StaticCache(config=model.get_base_model().config, max_cache_len=length)
    with torch.no_grad():
        model(
            input_ids=_zeros(device, rows, 1),
            attention_mask=_cache_mask(model, rows, 1, length),
            position_ids=_zeros(device, rows, 1),
            **cache_argument(model, cache),
            use_cache=True,
            logits_to_keep=1,
        )
    return sum(
        tensor.numel() * tensor.element_size()
        for layer in cache.layers
        for tensor in (layer.keys, layer.values)
    )


def graph_buffer_bytes(model: nn.Module, shapes: PhaseShapes) -> tuple[int, int]:
    """The ``graph`` sampler's key/value buffers (:class:`marl.model.graph_decode.BucketedDecoder`): the
    bytes it keeps for the run, and those beyond the cache of :func:`sampling_peak`'s rows (its largest
    bucket rounds the rows of a pass up to a power of two, its cache length the prompt width).

    Example:
        >>> kept, beyond = graph_buffer_bytes(model, shapes)  # doctest: +SKIP
    """
    rows = shapes.prompts_per_pass * shapes.rloo_k
    bucket = row_buckets(max(shapes.rows_per_pass, rows))[0]
    length = width_bucket(shapes.prompt_length) + shapes.response_length
    kept = decode_cache_bytes(model, bucket, length)
    return kept, max(0, kept - decode_cache_bytes(model, rows, shapes.prompt_length + shapes.response_length))


def scoring_peak(
    model: nn.Module,
    logit_head: Callable,
    shapes: PhaseShapes,
    score_head_outputs: int,
    full_logits: bool = False,
) -> int:
    """Bytes one scoring chunk holds at most: the policy's and the reference's log-probs (no gradient), then
    a reward adapter's pass (backbone + score head)."""
    rows = shapes.prompts_per_pass * shapes.rloo_k
    peaks = []
    for view in (contextlib.nullcontext, model.disable_adapter):
        with LiveBytes() as live, torch.no_grad(), view():
            hidden = _hidden_for_logprobs(model, rows, shapes, shapes.share_prompt_prefix)
            _logprobs(hidden, logit_head, shapes, full_logits)
            del hidden
        peaks.append(live.peak)
    with LiveBytes() as live, torch.no_grad():
        hidden = _hidden_for_logprobs(model, rows, shapes, shapes.share_prompt_prefix)
        head = _zeros(hidden.device, score_head_outputs, hidden.shape[-1], dtype=hidden.dtype)
        score = torch.nn.functional.linear(hidden, head)
        del hidden, score
    peaks.append(live.peak)
    return max(peaks)


def update_peak(
    model: nn.Module,
    logit_head: Callable,
    shapes: PhaseShapes,
    full_logits: bool = False,
    value_pass: bool = False,
) -> int:
    """Bytes one micro-batch of the update holds at most: forward with gradients, log-probs and entropies,
    the backward pass, and the LoRA gradients it leaves (which stay until the optimizer step).
    ``value_pass``: a second backbone pass with gradients alive at the same time (PPO's value model)."""
    rows = shapes.micro_batch_rows
    model.train()
    try:
        with LiveBytes() as live:
            hidden = _hidden_for_logprobs(model, rows, shapes, shapes.micro_batch_packs)
            logprobs, _ = _logprobs(hidden, logit_head, shapes, full_logits, with_entropy=True,
                                    recompute=shapes.gradient_checkpointing)  # fmt: skip
            del hidden
            loss = logprobs.sum()
            if value_pass:
                loss = loss + _hidden_for_logprobs(model, rows, shapes, shapes.micro_batch_packs).sum()
            loss.backward()
            del logprobs, loss
        return live.peak
    finally:
        model.eval()
        for parameter in model.parameters():
            parameter.grad = None


def logit_head_of(model: nn.Module) -> LogitHead:
    """The LM head with the family's logit transform (as the trainer applies it)."""
    return LogitHead.of(model.get_base_model())
