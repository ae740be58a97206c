"""The ``hf-generate`` system of ``vs_trl.py``: transformers' own compiled decode as a baseline beside marl's
``graph`` sampler (issue 61).

marl runs as in every other marl system (one base, policy/reference/reward adapters, the same scoring and
update), but samples with :class:`CompiledGenerateSampler`: ``generate`` on marl's PEFT model, policy adapter
active, eval mode, no grad, with ``cache_implementation="static"`` and transformers' default
``CompileConfig()`` (inductor, ``mode="reduce-overhead"``: CUDA graphs). The path each run took goes to the
results' ``path`` column: ``compiled+graphs`` where ``generate`` compiled its decode step (and no CUDA graph
was skipped), else ``eager (why)``.

Why TRL GRPOTrainer's ``cache_implementation="static"`` runs decoded eager (H200: TRL 48.9 ms a step,
marl's eager static decode 43.3 ms, marl ``graph`` 11.3 ms; benchmarks/results/2026-11-27-gpu-sequence.md),
read in the installed trl 1.16.0, transformers 5.24.0, peft 0.21.2 (site-packages paths):

- The cause: TRL turns compilation off. ``trl/trainer/grpo_trainer.py:1173`` builds
  ``GenerationConfig(**generation_kwargs, disable_compile=True)`` (``rloo_trainer.py:805`` the same) and
  passes it to ``unwrapped_model.generate(..., generation_config=self.generation_config)``
  (``grpo_trainer.py:1873``). ``transformers/generation/utils.py:2444-2446``
  (``_valid_auto_compile_criteria``) returns False on ``disable_compile`` before any other check, so the
  decode loop calls ``self.__call__``, not ``self.get_compiled_call(...)`` (``utils.py:3201-3205``).
  ``args.generation_kwargs`` is merged into ``generation_kwargs`` before (``grpo_trainer.py:1170-1171``), so
  a user cannot turn it back on: ``disable_compile`` there would be a second value of one keyword
  (``TypeError``).
- Not training mode: the model is in train mode while TRL samples (``transformers/trainer.py:2080``,
  ``model.train()`` before ``_prepare_inputs``, which generates; nothing sets eval), but the criteria never
  read ``self.training``. (With ``lora_dropout=0`` it changes no token either.)
- Not gradient checkpointing: TRL turns it off around generation (``trl/models/utils.py:136-138``,
  ``_unwrap_model_for_generation``), and the criteria do not read it.
- Not PEFT: ``PeftModelForCausalLM.generate`` (``peft/peft_model.py:2229-2244``) calls the transformers
  model's own ``generate``, whose criteria then see a CUDA device and the ``StaticCache`` that
  ``cache_implementation="static"`` builds (``is_compileable = True``, ``transformers/cache_utils.py:413``).
- Not the version: transformers 5.24 does auto-compile a static-cache decode on CUDA (``utils.py:2450-2459``);
  only TRL's flag stops it.
- 4-bit stops it too, whoever calls: bitsandbytes' quantizers keep the base ``is_compileable = False``
  (``transformers/quantizers/base.py:288-290``; checked at ``utils.py:2462-2463``), so this system decodes
  eager on a 4-bit base; it runs in the bf16 stages only.

So what this system needs, against TRL's call: no ``disable_compile`` (marl's exact ``GenerationConfig``
leaves it unset) and a static cache; marl's ``transformers`` sampler shares each prompt's prefill through a
``DynamicCache`` it passes in, which ``generate`` refuses beside ``cache_implementation`` and never compiles
(``utils.py:2255-2259``, ``2458``), so this sampler lets ``generate`` prefill all k copies of a prompt, as
TRL's does. Eval mode and no grad are marl's own for every sampler (:func:`marl.model.forward.inference`).

Example:
    >>> register_sampler("compiled-generate-example")
    >>> from marl.rollout.samplers import SAMPLERS, get_sampler
    >>> get_sampler("compiled-generate-example").__name__
    'CompiledGenerateSampler'
    >>> del SAMPLERS["compiled-generate-example"]
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import CompileConfig

from marl.model.forward import inference
from marl.model.rows import RowRoutes
from marl.model.sampling import sample
from marl.rollout.samplers import SampledChunk, TransformersSampler

# transformers' own choice when none is given (modeling_utils.py `_default_compile_config`): inductor,
# mode="reduce-overhead", fullgraph=False, dynamic=None. Passed explicitly so the path is named, not implied.
COMPILE_CONFIG = CompileConfig()
# generate's devices for auto-compilation (transformers/generation/utils.py:2450)
_COMPILING_DEVICES = ("cuda", "xpu", "neuron", "tpu")


class CompiledGenerateSampler(TransformersSampler):
    """marl's ``transformers`` sampler with ``generate``'s static cache and its compiled decode step.

    Attributes:
        path: ``"compiled+graphs"``, ``"compiled (N CUDA graphs skipped)"`` or ``"eager (why)"``: what the
            last chunk's ``generate`` ran (``"not sampled"`` before the first).
    """

    path = "not sampled"

    def _sample_chunk(
        self, ids: torch.Tensor, mask: torch.Tensor, k: int, routes: RowRoutes | None = None
    ) -> SampledChunk:
        if routes is not None:
            raise ValueError("the compiled-generate sampler samples one policy at a time, not routed rows")
        peft_model = self.model.peft_model
        skips_before = _cudagraph_skips()
        with inference(peft_model):
            completions = sample(
                peft_model,
                ids.repeat_interleave(k, dim=0),
                mask.repeat_interleave(k, dim=0),
                self.sampling,
                cache_implementation="static",
                compile_config=COMPILE_CONFIG,
            )
        self.path = decode_path(peft_model.get_base_model(), _cudagraph_skips() - skips_before)
        return completions, None


def decode_path(causal_lm: Any, cudagraph_skips: int) -> str:
    """What ``generate`` ran on ``causal_lm``: compiled where it built its compiled call
    (``get_compiled_call`` stores ``_compiled_call``; it is called only when ``_valid_auto_compile_criteria``
    holds), with CUDA graphs unless inductor skipped some (``cudagraph_skips`` during the call); else eager
    and why.

    Example:
        >>> from transformers import Qwen2Config, Qwen2ForCausalLM
        >>> decode_path(Qwen2ForCausalLM(Qwen2Config(hidden_size=8, intermediate_size=8, num_hidden_layers=1,
        ...     num_attention_heads=2, num_key_value_heads=1, vocab_size=16)), 0)
        'eager (generate compiles its decode on cuda/xpu/neuron/tpu only: this ran on cpu)'
    """
    if getattr(causal_lm, "_compiled_call", None) is not None:
        return (
            "compiled+graphs" if cudagraph_skips == 0 else f"compiled ({cudagraph_skips} CUDA graphs skipped)"
        )
    if causal_lm.device.type not in _COMPILING_DEVICES:
        devices = "/".join(_COMPILING_DEVICES)
        return f"eager (generate compiles its decode on {devices} only: this ran on {causal_lm.device.type})"
    quantizer = getattr(causal_lm, "hf_quantizer", None)
    if quantizer is not None and not quantizer.is_compileable:
        return f"eager ({type(quantizer).__name__} is not compileable)"
    return "eager (generate's compile criteria were not met)"


def _cudagraph_skips() -> int:
    """How many times inductor has skipped CUDA graphs in this process (its own counter)."""
    from torch._dynamo.utils import counters

    return int(counters["inductor"]["cudagraph_skips"])


def register_sampler(name: str) -> None:
    """``--sampler name``: :class:`CompiledGenerateSampler` in marl's sampler registry (kept where it is)."""
    from marl.rollout.samplers import SAMPLERS
    from marl.rollout.samplers import register_sampler as register

    if SAMPLERS.get(name) is not CompiledGenerateSampler:
        register(name, CompiledGenerateSampler)
