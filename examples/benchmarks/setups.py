"""What the marl-vs-TRL benchmark runs: its setups, and what it prepares for them (model folder, reward
adapter, prompts, physical floor) in the parent process."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from built_models import BUILT_SHAPES, LLAMA31_SHAPES, build_model, build_prompts
from floors import phase_work
from measure import memory_floor, rollout_kv_tokens

REPO_ROOT = Path(__file__).resolve().parents[2]
QUANTIZATIONS = ("none", "4bit")  # the quicker one first
# The reward adapter that the project's own recipe trains on the bundled model. For another base the
# benchmark makes a freshly initialised adapter of the same shape (timings and memory do not depend on its
# quality).
BUNDLED_REWARD_ADAPTER = REPO_ROOT / "adapters" / "smollm2-135m-rotten-tomatoes-reward"
RANDOM_QWEN2 = "qwen2-0.5b-shaped-random"


@dataclasses.dataclass
class BenchConfig:
    """Everything both systems share; written verbatim into the results file."""

    setup: str
    model: str  # a model id for marl.data.assets.resolve_model_path, RANDOM_QWEN2, or a local folder
    device: str  # "cpu" or "cuda"
    dtype: str  # compute dtype: "float32" or "bfloat16"
    prompts_per_update: int
    rloo_k: int
    response_length: int
    updates: int
    seed: int = 0
    temperature: float = 0.7
    learning_rate: float = 1e-5
    kl_coef: float = 0.05
    cliprange: float = 0.2
    num_ppo_epochs: int = 1
    lora_r: int = 16
    lora_alpha: int = 32
    lora_dropout: float = 0.0
    lora_target_modules: str = "all-linear"
    gradient_checkpointing: bool = True
    prompt_words: int = 4  # short prompts: the first words of a review
    context_tokens: int = 0  # > 0: prompts of at least this many tokens (reviews as context + instruction)
    threads: int = 0  # torch intra-op threads; 0 = all cores
    compare_sharing: bool = False  # marl also runs with share_prompt_prefix=False (where marl has it)
    cache_implementation: str = ""  # TRL's generate cache (its `cache_implementation`); "" = its default
    # "rloo": marl's rloo preset against TRL's RLOOTrainer; "grpo": marl's grpo preset against TRL's
    # GRPOTrainer (`trl`), both with GRPOConfig's defaults (kl_coef/beta 0 unless --kl-coef is given)
    algorithm: str = "rloo"

    @property
    def batch_size(self) -> int:
        """Completions per update (episodes)."""
        return self.prompts_per_update * self.rloo_k


_BUILT_GPU = dict(
    device="cuda", dtype="bfloat16", prompts_per_update=8, rloo_k=8, response_length=256, updates=4,
    context_tokens=256, cache_implementation="static",
)  # fmt: skip
# One intra-op thread on CPU: on a small shared machine two OpenMP threads stall whenever another process
# takes a core (updates measured from 6 s to 120 s); one thread kept updates within 15 %.
_SMOLLM2_CPU = dict(model="smollm2-135m-instruct", device="cpu", dtype="float32", rloo_k=4, threads=1)
SETUPS = {
    "cpu-short": dict(_SMOLLM2_CPU, prompts_per_update=4, response_length=16, updates=3),
    "cpu-long": dict(
        _SMOLLM2_CPU, prompts_per_update=1, response_length=32, updates=2, context_tokens=128,
        compare_sharing=True,
    ),
    "cpu-long4": dict(
        _SMOLLM2_CPU, prompts_per_update=4, response_length=32, updates=2, context_tokens=128,
    ),
    "cpu-weights": dict(
        _SMOLLM2_CPU, model=RANDOM_QWEN2, prompts_per_update=1, response_length=16, updates=2
    ),
    # Qwen2.5-shaped bases built from a config with a tokenizer the benchmark trains (built_models.py): they
    # need nothing but the repository on a bare GPU machine. TRL samples with a static cache (its
    # `cache_implementation`), the nearest it has to marl's graph decode without vLLM.
    "gpu-0.5b": dict(_BUILT_GPU, model="qwen2.5-0.5b-shaped"),
    "gpu-1.5b": dict(_BUILT_GPU, model="qwen2.5-1.5b-shaped"),
    # Llama-3.1-8B's shapes, GRPO (its preset; TRL's GRPOTrainer), for a 4-bit run inside 24 GB
    "gpu-8b": dict(_BUILT_GPU, model="llama3.1-8b-shaped", algorithm="grpo", kl_coef=0.0),
}  # fmt: skip
# --dry-run: a setup of a Llama shape shrinks to the tiny Llama (the others to DRY_RUN's tiny Qwen2)
DRY_RUN_LLAMA = "tiny-llama-shaped"
SETUP_GROUPS = {"cpu": ("cpu-short", "cpu-long", "cpu-long4", "cpu-weights"), "gpu": ("gpu-0.5b", "gpu-1.5b")}
LLAMA_SETUPS = tuple(name for name, setup in SETUPS.items() if setup.get("model") in LLAMA31_SHAPES)
# What the GPU setups compare: marl with its three samplers (the graph decode compiled and captured in plain
# CUDA graphs), TRL's two trainers (without vLLM).
GPU_SYSTEMS = ("marl-graph", "marl-cudagraph", "marl", "marl-generate", "trl", "trl-grpo")
# --dry-run: every setup shrunk to a tiny model on the CPU, one run of every system, so that a GPU run cannot
# fail on something a CPU could have caught (tests/test_benchmark_vs_trl.py runs it).
DRY_RUN = dict(
    model="tiny-qwen2-shaped", device="cpu", prompts_per_update=2, rloo_k=2, response_length=8, updates=2,
    context_tokens=16, threads=1,
)  # fmt: skip
# Seconds of one run (process start to exit) on the reference machine when it is otherwise idle (2 cores, one
# torch thread), by (setup, quantization) and system, for the estimate printed at the start. From the 5-run
# results of 2026-11-21 (cpu-short) and the CPU seconds of single runs on a shared machine (the others).
RUN_SECONDS = {
    ("cpu-short", "none"): {"marl": 37, "trl": 38},
    ("cpu-short", "4bit"): {"marl": 40, "trl": 45},
    ("cpu-long", "none"): {"marl": 35, "trl": 45},
    ("cpu-long", "4bit"): {"marl": 42, "trl": 55},
    ("cpu-weights", "none"): {"marl": 30, "trl": 30},
    ("cpu-weights", "4bit"): {"marl": 45, "trl": 60},
}
DEFAULT_RUN_SECONDS = 120

# Qwen2.5-0.5B's shapes with the bundled SmolLM2 tokenizer's vocabulary (no tokenizer can be downloaded).
# Every Linear's input features is a multiple of 64, as the 4-bit kernels want.
QWEN2_HALF_B_SHAPES = dict(
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    rope_theta=1_000_000.0,
    tie_word_embeddings=True,
)

CONTEXT_HEAD = "Reviews of recent films by professional critics:\n"
CONTEXT_TAIL = "\nWrite one more short review of a film, in the style of the reviews above:\n"


def build_context_prompts(snippets: Sequence[str], count: int, min_tokens: int, count_tokens) -> list[str]:
    """``count`` prompts of at least ``min_tokens`` tokens: consecutive snippets as a list of reviews, then an
    instruction. ``count_tokens(text)`` counts the tokens of a prompt as the model reads it.

    Example:
        >>> words = lambda text: len(text.split())
        >>> prompts = build_context_prompts(["a b c", "d e", "f g h i"], 2, 27, words)
        >>> [words(p) for p in prompts], prompts[0].count("- ")
        ([29, 27], 2)
    """
    prompts, position = [], 0
    for _ in range(count):
        lines: list[str] = []
        while True:
            if position >= len(snippets):
                raise ValueError(f"{len(snippets)} snippets are too few for {count} prompts of {min_tokens}")
            lines.append("- " + snippets[position])
            position += 1
            prompt = CONTEXT_HEAD + "\n".join(lines) + CONTEXT_TAIL
            if count_tokens(prompt) >= min_tokens:
                break
        prompts.append(prompt)
    return prompts


def prepare_model(config: BenchConfig, work_dir: Path) -> str:
    """A local model folder: the bundled model, or a Qwen2-shaped model with random weights."""
    if config.model in BUILT_SHAPES:
        import torch

        device = "cuda" if config.device == "cuda" and torch.cuda.is_available() else "cpu"
        target = work_dir / f"{config.model}-{config.dtype}"
        return build_model(config.model, config.dtype, target, seed=config.seed, device=device)
    from marl.data.assets import EMBEDDED_MODEL_ID, resolve_model_path

    if config.model != RANDOM_QWEN2:
        return resolve_model_path(config.model)
    target = work_dir / f"{config.model}-{config.dtype}"
    if (target / "config.json").is_file():
        return str(target)
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(EMBEDDED_MODEL_ID))
    qwen_config = Qwen2Config(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype=config.dtype,
        **QWEN2_HALF_B_SHAPES,
    )
    torch.manual_seed(config.seed)
    model = Qwen2ForCausalLM(qwen_config).to(getattr(torch, config.dtype))
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)
    return str(target)


def prepare_reward_adapter(
    config: BenchConfig, model_path: str, work_dir: Path, requested: str | None
) -> str:
    """The reward adapter both systems score with: as requested, the bundled one, or a fresh one made here."""
    if requested:
        return requested
    if config.model == "smollm2-135m-instruct" and (BUNDLED_REWARD_ADAPTER / "adapter_config.json").is_file():
        return str(BUNDLED_REWARD_ADAPTER)
    target = work_dir / f"reward-adapter-{Path(model_path).name}"
    if (target / "adapter_config.json").is_file():
        return str(target)
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(config.seed)
    classifier = AutoModelForSequenceClassification.from_pretrained(
        model_path, num_labels=1, dtype=torch.float32
    )
    adapter_config = LoraConfig(
        r=config.lora_r,
        lora_alpha=config.lora_alpha,
        target_modules=config.lora_target_modules,
        task_type="SEQ_CLS",
    )
    get_peft_model(classifier, adapter_config).save_pretrained(target)
    return str(target)


def prepare_prompts(config: BenchConfig, model_path: str) -> list[str]:
    """Exactly the prompts the run consumes (prompts per update x updates), the same list for both systems."""
    from transformers import AutoTokenizer

    needed = config.prompts_per_update * config.updates
    if config.model in BUILT_SHAPES:  # generated text, exactly context_tokens tokens
        return build_prompts(AutoTokenizer.from_pretrained(model_path), needed, config.context_tokens)
    from marl.data.assets import build_rl_prompts, split_rotten_tomatoes

    snippets = split_rotten_tomatoes(seed=config.seed)["rl"]
    if config.context_tokens:
        tokenizer = AutoTokenizer.from_pretrained(model_path)
        return build_context_prompts(
            snippets["text"], needed, config.context_tokens, lambda text: len(tokenizer(text)["input_ids"])
        )
    return build_rl_prompts(snippets, num_words=config.prompt_words)["prompt"][:needed]


def compute_floor(
    config: BenchConfig, quantization: str, model_path: str, reward_adapter: str, prompts: list[str]
) -> dict[str, float]:
    """The physical floor of this configuration, from the model's shapes (a meta-device model, no weights).

    Uses the arithmetic of ``marl.model.memory`` (the same the memory card prints): NF4 with double
    quantisation
    for the Linear layers of a 4-bit base, the compute dtype for everything else (embeddings, norms, lm_head).
    """
    import torch
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from marl.model.memory import (
        adamw_training_bytes,
        kv_cache_bytes,
        lora_parameter_count,
        quantized_weight_bytes,
    )

    dtype = getattr(torch, config.dtype)
    dtype_bytes = torch.empty((), dtype=dtype).element_size()
    model_config = AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_config)
    output_embeddings = model.get_output_embeddings()
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear) and m is not output_embeddings]
    linear_weight_ids = {id(m.weight) for m in linears}
    base_bytes = sum(
        quantized_weight_bytes(m.weight.numel(), None if quantization == "none" else quantization, dtype)
        for m in linears
    )
    base_bytes += sum(p.numel() * dtype_bytes for p in model.parameters() if id(p) not in linear_weight_ids)
    policy_params = sum(lora_parameter_count(m.in_features, m.out_features, config.lora_r) for m in linears)
    with safe_open(str(Path(reward_adapter) / "adapter_model.safetensors"), framework="pt") as handle:
        reward_params = sum(math.prod(handle.get_slice(name).get_shape()) for name in handle.keys())  # noqa: SIM118
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    longest_prompt = max(len(ids) for ids in tokenizer(prompts)["input_ids"])
    kv_tokens = rollout_kv_tokens(
        longest_prompt, config.prompts_per_update, config.rloo_k, config.response_length
    )
    return memory_floor(
        base_weight_bytes=base_bytes,
        policy_adapter_bytes=adamw_training_bytes(policy_params),
        frozen_adapter_bytes=reward_params * dtype_bytes,
        kv_bytes=kv_cache_bytes(model_config, kv_tokens, dtype),
    )


def phase_work_of(
    config: BenchConfig, base_weight_bytes: float, model_path: str, prompts: list[str]
) -> dict[str, dict[str, int]]:
    """FLOPs and weight bytes of each phase of one update (:func:`floors.phase_work`): the parameters of a
    meta-device model, the weights as stored, the mean prompt length."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path))
    params = sum(parameter.numel() for parameter in model.parameters())
    lengths = [len(ids) for ids in AutoTokenizer.from_pretrained(model_path)(prompts)["input_ids"]]
    return phase_work(
        params=params,
        weight_bytes=int(base_weight_bytes),
        prompt_tokens=round(sum(lengths) / len(lengths)),
        prompts=config.prompts_per_update,
        rows=config.batch_size,
        steps=config.response_length,
    )


def prompt_token_range(model_path: str, prompts: list[str]) -> list[int]:
    from transformers import AutoTokenizer

    lengths = [len(ids) for ids in AutoTokenizer.from_pretrained(model_path)(prompts)["input_ids"]]
    return [min(lengths), max(lengths)]


def reward_adapter_note(reward_adapter: str, requested: str | None, config: BenchConfig) -> str:
    if Path(reward_adapter) == BUNDLED_REWARD_ADAPTER:
        return "`adapters/smollm2-135m-rotten-tomatoes-reward` (the project's recipe)"
    if requested:
        return "given with --reward-adapter"
    return (
        f"freshly initialised LoRA r{config.lora_r} + score head (timing and memory do not depend on weights)"
    )


def trl_sampling_and_objective(config: Any, seed: int) -> dict[str, Any]:
    """TRL 1.16 ``RLOOConfig`` fields that make TRL sample and optimise what a marl config (``rloo_k``,
    ``response_length``, ``temperature``, ``learning_rate``, ``kl_coef``, ``cliprange``, ``num_ppo_epochs``)
    does: fixed-length completions from the plain temperature distribution, the same clipped objective and a
    linear schedule without warm-up."""
    return dict(
        num_generations=config.rloo_k,
        max_completion_length=config.response_length,
        generation_kwargs={"min_new_tokens": config.response_length},
        temperature=config.temperature,
        top_k=0,
        top_p=1.0,
        learning_rate=config.learning_rate,
        lr_scheduler_type="linear",
        warmup_steps=0,
        beta=config.kl_coef,
        epsilon=config.cliprange,
        num_iterations=config.num_ppo_epochs,
        seed=seed,
    )
