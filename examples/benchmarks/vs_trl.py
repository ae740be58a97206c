"""marl's RLOOTrainer against TRL's RLOOTrainer on the same job: peak memory and throughput, side by side.

Both systems train a LoRA policy with RLOO on the same base model (same quantization, same ``LoraConfig``),
the same prompts, the same reward adapter, the same k, batch, number of updates, seed, temperature, learning
rate and a fixed completion length. The difference being measured is the one a user sees:

- marl: ONE base model; policy, reference and reward are adapters on it (``marl.MultiAdapterModel``).
- TRL: the policy is the base + ``peft_config`` (TRL already takes the reference by disabling the adapter),
  and the reward is what a TRL user loads: a second copy of the base as ``AutoModelForSequenceClassification``
  with the reward adapter on top (``PeftModel.from_pretrained``), passed in ``reward_funcs``.

Every run is its own process (peak memory is per process); runs alternate between the systems, and the report
gives medians, min-max and the ratio marl/TRL, next to a computed physical floor of memory.

Configuration mapping (marl/the classic RLOO trainer -> TRL 1.16, whose RLOO is built on its GRPO loop):

    rloo_k          -> num_generations
    kl_coef         -> beta
    cliprange       -> epsilon
    num_ppo_epochs  -> num_iterations
    response_length -> max_completion_length   (and min_new_tokens = response_length in both)

Commands:

    # (a) CPU, the bundled SmolLM2-135M-Instruct, 4-bit NF4 and unquantized, 3 runs per system each
    python examples/benchmarks/vs_trl.py --setup cpu-smollm2
    # (b) one CUDA GPU, a 0.5B Qwen2-shaped model from a config (random weights, bf16), 4-bit and unquantized
    python examples/benchmarks/vs_trl.py --setup gpu-qwen2
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
SYSTEMS = ("marl", "trl")
QUANTIZATIONS = ("none", "4bit")  # the quicker one first
# The reward adapter that the project's own recipe trains on the bundled model. When it is absent, the
# benchmark makes a freshly initialised adapter of the same shape (timings and memory do not depend on
# its quality).
BUNDLED_REWARD_ADAPTER = REPO_ROOT / "adapters" / "smollm2-135m-rotten-tomatoes-reward"
LORA_TARGET_MODULES = "all-linear"

CONFIG_MAPPING = (
    ("rloo_k", "num_generations"),
    ("kl_coef", "beta"),
    ("cliprange", "epsilon"),
    ("num_ppo_epochs", "num_iterations"),
    ("response_length", "max_completion_length (+ generation_kwargs min_new_tokens)"),
    ("per_device_train_batch_size (completions per update)", "per_device_train_batch_size"),
    ("gradient_accumulation_steps / num_mini_batches = 1", "gradient_accumulation_steps = 1"),
    ("total_episodes = updates x batch", "max_steps = updates"),
)


@dataclasses.dataclass
class BenchConfig:
    """Everything both systems share; written verbatim into the results file."""

    setup: str
    model: str  # a model id for marl.assets.resolve_model_path, or a local folder
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
    gradient_checkpointing: bool = False
    prompt_words: int = 4
    threads: int = 0  # torch intra-op threads; 0 = all cores

    @property
    def batch_size(self) -> int:
        """Completions per update (episodes)."""
        return self.prompts_per_update * self.rloo_k


SETUPS = {
    "cpu-smollm2": dict(
        model="smollm2-135m-instruct",
        device="cpu",
        dtype="float32",
        prompts_per_update=4,
        rloo_k=4,
        response_length=16,
        updates=3,
        gradient_checkpointing=True,
        # One intra-op thread: on a small shared machine two OpenMP threads stall whenever another process
        # takes a core (updates measured from 6 s to 120 s); one thread gave updates within 15 %.
        threads=1,
    ),
    "gpu-qwen2": dict(
        model="qwen2-0.5b-shaped-random",
        device="cuda",
        dtype="bfloat16",
        prompts_per_update=32,
        rloo_k=4,
        response_length=128,
        updates=6,
        gradient_checkpointing=True,
    ),
}

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


# ------------------------------------------------------------------------------------------------------------
# Pure arithmetic: the physical floor and the summary


def rollout_kv_tokens(prompt_tokens: int, num_prompts: int, rloo_k: int, response_length: int) -> int:
    """Tokens whose keys/values a rollout must hold when each prompt is cached once for its k samples.

    Example:
        >>> rollout_kv_tokens(prompt_tokens=8, num_prompts=4, rloo_k=4, response_length=16)
        288
    """
    return num_prompts * (prompt_tokens + rloo_k * response_length)


def memory_floor(
    base_weight_bytes: float,
    policy_adapter_bytes: float,
    frozen_adapter_bytes: float,
    kv_bytes: int,
) -> dict[str, float]:
    """What training must hold at least: base as stored, policy LoRA with AdamW, frozen adapters, KV cache.

    ``policy_adapter_bytes`` counts the trainable adapter with its gradients and AdamW's two moments.

    Example:
        >>> memory_floor(1000.0, 160.0, 20.0, 30)["total"]
        1210.0
    """
    parts = {
        "base weights (as stored)": float(base_weight_bytes),
        "policy adapter + grads + AdamW": float(policy_adapter_bytes),
        "frozen adapters (reward LoRA + head)": float(frozen_adapter_bytes),
        "KV cache bound (prefix shared)": float(kv_bytes),
    }
    parts["total"] = sum(parts.values())
    return parts


def spread(values: Sequence[float]) -> dict[str, float]:
    """Median, min and max of a list of measurements.

    Example:
        >>> spread([3.0, 1.0, 2.0])
        {'median': 2.0, 'min': 1.0, 'max': 3.0}
    """
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def ratio(numerator: float, denominator: float) -> float:
    """numerator / denominator, NaN when the denominator is zero (a failed peer run must not read as a win).

    Example:
        >>> ratio(1.0, 4.0)
        0.25
    """
    return numerator / denominator if denominator else float("nan")


# ------------------------------------------------------------------------------------------------------------
# Measurement helpers (run inside the worker processes)


def _status_kib(field: str) -> int:
    """A ``VmRSS``/``VmHWM``-style field of /proc/self/status in KiB (Linux)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not found in /proc/self/status")


def _reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark of this process so that VmHWM covers only what follows."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


class RssSampler:
    """Peak anonymous and file-backed resident memory, sampled from /proc/self/status in a daemon thread.

    ``ru_maxrss`` also counts pages of memory-mapped checkpoint files (``safetensors`` are mapped, not read):
    clean, shared with the page cache, reclaimable, and counted once per mapping. The anonymous peak is the
    memory the process really allocated.
    """

    def __init__(self, interval: float = 0.05) -> None:
        import threading

        self.peak_anon_kib = 0
        self.peak_file_kib = 0
        self._interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            time.sleep(self._interval)

    def sample(self) -> None:
        self.peak_anon_kib = max(self.peak_anon_kib, _status_kib("RssAnon"))
        self.peak_file_kib = max(self.peak_file_kib, _status_kib("RssFile"))

    def stop(self) -> dict[str, float]:
        self._stop.set()
        self._thread.join()
        self.sample()
        return {
            "peak_anon_rss_mib": self.peak_anon_kib / 1024,
            "peak_file_rss_mib": self.peak_file_kib / 1024,
        }


class UpdateClock:
    """Timestamps at the end of every update; throughput is measured over the updates after the first."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.update_ends: list[float] = []

    def tick(self) -> None:
        self.update_ends.append(time.perf_counter())

    def throughput(self, episodes_per_update: int, tokens_per_update: int) -> dict[str, float]:
        if len(self.update_ends) < 2:
            raise RuntimeError(
                f"need 2 or more updates to exclude the warm-up, got {len(self.update_ends)}: raise --updates"
            )
        timed_updates = len(self.update_ends) - 1
        seconds = self.update_ends[-1] - self.update_ends[0]
        durations = [
            b - a for a, b in zip([self.start, *self.update_ends[:-1]], self.update_ends, strict=True)
        ]
        return {
            "eps": episodes_per_update * timed_updates / seconds,
            "tokens_per_s": tokens_per_update * timed_updates / seconds,
            "update_seconds": durations,
        }


def _torch_setup(config: BenchConfig):
    import torch

    if config.threads:
        torch.set_num_threads(config.threads)
    if config.device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"setup {config.setup!r} needs a CUDA GPU and none is visible")
    return torch


def _bnb_config(config: BenchConfig, quantization: str):
    """The one BitsAndBytesConfig both systems get (NF4, double quantisation, compute in the run's dtype)."""
    import torch
    from transformers import BitsAndBytesConfig

    if quantization == "none":
        return None
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=getattr(torch, config.dtype),
    )


def _lora_config(config: BenchConfig):
    from peft import LoraConfig

    return LoraConfig(
        r=config.lora_r,
        lora_alpha=config.lora_alpha,
        lora_dropout=config.lora_dropout,
        target_modules=LORA_TARGET_MODULES,
        task_type="CAUSAL_LM",
    )


def _quiet_libraries() -> None:
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()


def _memory_result(torch, config: BenchConfig, baseline_kib: int, peak_reset: bool) -> dict[str, float]:
    mib = 1024.0
    result = {
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / mib,
        "baseline_rss_mib": baseline_kib / mib,
        "peak_above_baseline_mib": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - baseline_kib) / mib,
        "train_peak_rss_mib": _status_kib("VmHWM") / mib if peak_reset else float("nan"),
    }
    if config.device == "cuda":
        result["cuda_max_allocated_mib"] = torch.cuda.max_memory_allocated() / 2**20
        result["cuda_max_reserved_mib"] = torch.cuda.max_memory_reserved() / 2**20
    return result


def run_trl(config: BenchConfig, quantization: str, model_path: str, reward_adapter: str, prompts: list[str]):
    """One TRL run: policy = base + peft_config; reward = a separate SequenceClassification copy + PEFT."""
    torch = _torch_setup(config)
    import datasets
    from peft import PeftModel
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, TrainerCallback
    from trl import RLOOConfig as TRLRLOOConfig
    from trl import RLOOTrainer as TRLRLOOTrainer

    _quiet_libraries()
    baseline_kib = _status_kib("VmRSS")
    sampler = RssSampler()
    dtype = getattr(torch, config.dtype)
    bnb = _bnb_config(config, quantization)
    device_map = {"": 0} if config.device == "cuda" else None

    tokenizer = AutoTokenizer.from_pretrained(model_path, padding_side="left")
    reward_model = AutoModelForSequenceClassification.from_pretrained(
        model_path, num_labels=1, dtype=dtype, quantization_config=bnb, device_map=device_map
    )
    reward_model = PeftModel.from_pretrained(reward_model, reward_adapter)
    reward_model.eval()
    # TRL sets the pad id only on PreTrainedModel rewards; a PeftModel needs it set by the user.
    reward_model.config.pad_token_id = tokenizer.pad_token_id

    clock = UpdateClock()

    class StepClock(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            clock.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            clock.tick()

    completion_lengths: list[float] = []

    class CompletionLengths(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "completions/mean_length" in logs:
                completion_lengths.append(logs["completions/mean_length"])

    with tempfile.TemporaryDirectory(prefix="vs-trl-") as output_dir:
        args = TRLRLOOConfig(
            output_dir=output_dir,
            max_steps=config.updates,
            per_device_train_batch_size=config.batch_size,
            gradient_accumulation_steps=1,
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
            seed=config.seed,
            bf16=config.dtype == "bfloat16",
            use_cpu=config.device == "cpu",
            gradient_checkpointing=config.gradient_checkpointing,
            model_init_kwargs={"dtype": dtype, "device_map": device_map},
            logging_steps=1,
            save_strategy="no",
            report_to="none",
            disable_tqdm=True,
        )
        trainer = TRLRLOOTrainer(
            model=model_path,
            reward_funcs=reward_model,
            args=args,
            train_dataset=datasets.Dataset.from_dict({"prompt": prompts}),
            processing_class=tokenizer,
            reward_processing_classes=tokenizer,
            peft_config=_lora_config(config),
            quantization_config=bnb,
            callbacks=[StepClock(), CompletionLengths()],
        )
        if config.device == "cuda":
            torch.cuda.synchronize()
        peak_reset = _reset_peak_rss()
        trainer.train()
    result = clock.throughput(config.batch_size, config.batch_size * config.response_length)
    result.update(_memory_result(torch, config, baseline_kib, peak_reset))
    result.update(sampler.stop())
    result["completion_length_checked"] = completion_lengths
    return result


def run_marl(
    config: BenchConfig, quantization: str, model_path: str, reward_adapter: str, prompts: list[str]
):
    """One marl run: one base, the policy/reference/reward as adapters on it."""
    torch = _torch_setup(config)
    import datasets
    from transformers import AutoTokenizer

    from marl import MultiAdapterModel, RLOOConfig, RLOOTrainer

    _quiet_libraries()
    baseline_kib = _status_kib("VmRSS")
    sampler = RssSampler()
    model = MultiAdapterModel.from_pretrained(
        model_path,
        quantization=None if quantization == "none" else quantization,
        reward_adapter=reward_adapter,
        policy_adapter=_lora_config(config),
        dtype=getattr(torch, config.dtype),
        device_map={"": 0} if config.device == "cuda" else None,
        gradient_checkpointing=config.gradient_checkpointing,
    )
    tokenizer = AutoTokenizer.from_pretrained(model.name_or_path, padding_side="left")
    # Fixed completion length, as in the TRL run: EOS is suppressed until response_length tokens exist.
    model.peft_model.get_base_model().generation_config.min_new_tokens = config.response_length
    with tempfile.TemporaryDirectory(prefix="vs-trl-") as output_dir:
        rloo_config = RLOOConfig(
            output_dir=output_dir,
            rloo_k=config.rloo_k,
            per_device_train_batch_size=config.batch_size,
            gradient_accumulation_steps=1,
            num_mini_batches=1,
            num_ppo_epochs=config.num_ppo_epochs,
            total_episodes=config.batch_size * config.updates,
            local_rollout_forward_batch_size=config.batch_size,
            response_length=config.response_length,
            stop_token="eos",
            temperature=config.temperature,
            learning_rate=config.learning_rate,
            lr_scheduler_type="linear",
            warmup_steps=0,
            kl_coef=config.kl_coef,
            cliprange=config.cliprange,
            missing_eos_penalty=None,
            normalize_reward=False,
            normalize_advantage=False,
            seed=config.seed,
            bf16=config.dtype == "bfloat16",
            gradient_checkpointing=config.gradient_checkpointing,
            logging_steps=1,
            num_sample_generations=0,
            save_steps=0,
            report_to=["none"],
        )
        trainer = RLOOTrainer(
            config=rloo_config,
            model=model,
            tokenizer=tokenizer,
            train_dataset=datasets.Dataset.from_dict({"prompt": prompts}),
        )
        if config.device == "cuda":
            torch.cuda.synchronize()
        peak_reset = _reset_peak_rss()
        history = trainer.train()
    # marl logs every update with `episode` and `eps` (episodes per second since the loop started), so the
    # time at the end of update i is episode_i / eps_i after the start.
    clock = UpdateClock()
    clock.start = 0.0
    clock.update_ends = [record["episode"] / record["eps"] for record in history]
    result = clock.throughput(config.batch_size, config.batch_size * config.response_length)
    result.update(_memory_result(torch, config, baseline_kib, peak_reset))
    result.update(sampler.stop())
    # No completion may stop early: with EOS suppressed every one has response_length tokens.
    result["completions_with_eos"] = [record["val/num_eos_tokens"] for record in history]
    return result


WORKERS = {"marl": run_marl, "trl": run_trl}


# ------------------------------------------------------------------------------------------------------------
# Preparation in the parent process: model folder, reward adapter, prompts, floor


def prepare_model(config: BenchConfig, work_dir: Path) -> str:
    """A local model folder: the bundled model, or (GPU setup) a Qwen2-shaped model with random weights."""
    from marl.assets import EMBEDDED_MODEL_ID, resolve_model_path

    if config.model != "qwen2-0.5b-shaped-random":
        return resolve_model_path(config.model)
    target = work_dir / config.model
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
        r=config.lora_r, lora_alpha=config.lora_alpha, target_modules=LORA_TARGET_MODULES, task_type="SEQ_CLS"
    )
    get_peft_model(classifier, adapter_config).save_pretrained(target)
    return str(target)


def prepare_prompts(config: BenchConfig) -> list[str]:
    """Exactly the prompts the run consumes (prompts per update x updates), the same list for both systems."""
    from marl.assets import build_rl_prompts, split_rotten_tomatoes

    needed = config.prompts_per_update * config.updates
    prompts = build_rl_prompts(split_rotten_tomatoes(seed=config.seed)["rl"], num_words=config.prompt_words)
    return prompts["prompt"][:needed]


def compute_floor(
    config: BenchConfig, quantization: str, model_path: str, reward_adapter: str, prompts: list[str]
) -> dict[str, float]:
    """The physical floor of this configuration, from the model's shapes (a meta-device model, no weights).

    Uses the arithmetic of ``marl.memory`` (the same the memory card prints): NF4 with double quantisation
    for the Linear layers of a 4-bit base, the compute dtype for everything else (embeddings, norms, lm_head).
    """
    import torch
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from marl.memory import adamw_training_bytes, kv_cache_bytes, lora_parameter_count, quantized_weight_bytes

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


# ------------------------------------------------------------------------------------------------------------
# Orchestration


def run_in_subprocess(job: dict, work_dir: Path, label: str) -> dict:
    """Run one measured training in a fresh interpreter and return its JSON result."""
    job_file = work_dir / f"{label}.job.json"
    result_file = work_dir / f"{label}.result.json"
    job_file.write_text(json.dumps(job))
    command = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--worker",
        str(job_file),
        "--result",
        str(result_file),
    ]
    log_file = work_dir / f"{label}.log"
    with log_file.open("w") as log:
        completed = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, check=False)
    if completed.returncode != 0 or not result_file.is_file():
        tail = "\n".join(log_file.read_text().splitlines()[-30:])
        raise RuntimeError(
            f"run {label} failed (exit {completed.returncode}); last lines of {log_file}:\n{tail}"
        )
    return json.loads(result_file.read_text())


def worker_main(job_path: str, result_path: str) -> None:
    job = json.loads(Path(job_path).read_text())
    config = BenchConfig(**job["config"])
    result = WORKERS[job["system"]](
        config, job["quantization"], job["model_path"], job["reward_adapter"], job["prompts"]
    )
    Path(result_path).write_text(json.dumps(result))


def machine_description() -> dict[str, str]:
    cpu_model = "unknown"
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    mem_kib = 0
    meminfo = Path("/proc/meminfo")
    if meminfo.is_file():
        mem_kib = int(meminfo.read_text().split("MemTotal:")[1].split()[0])
    description = {
        "cpu": cpu_model,
        "cores (nproc)": str(os.cpu_count()),
        "RAM": f"{mem_kib / 2**20:.1f} GiB",
        "OS": platform.platform(),
        "python": platform.python_version(),
    }
    import torch

    if torch.cuda.is_available():
        description["gpu"] = torch.cuda.get_device_name(0)
    return description


def library_versions() -> dict[str, str]:
    from importlib.metadata import version

    return {
        name: version(name) for name in ("torch", "transformers", "peft", "bitsandbytes", "trl", "accelerate")
    }


def load_average() -> str:
    path = Path("/proc/loadavg")
    return path.read_text().strip() if path.is_file() else "n/a"


def summarize(runs: list[dict], quantization: str) -> dict[str, dict[str, dict[str, float]]]:
    """Per system, the spread of each metric over the runs of one quantization."""
    metrics = (
        "peak_rss_mib",
        "peak_above_baseline_mib",
        "train_peak_rss_mib",
        "peak_anon_rss_mib",
        "eps",
        "tokens_per_s",
        "cuda_max_allocated_mib",
    )
    summary: dict[str, dict[str, dict[str, float]]] = {}
    for system in SYSTEMS:
        mine = [
            run["result"] for run in runs if run["system"] == system and run["quantization"] == quantization
        ]
        summary[system] = {m: spread([r[m] for r in mine]) for m in metrics if mine and m in mine[0]}
    return summary


def _fmt(values: dict[str, float], digits: int) -> str:
    return f"{values['median']:.{digits}f} ({values['min']:.{digits}f}–{values['max']:.{digits}f})"


MEASUREMENT_NOTES = (
    "Peak RSS is `ru_maxrss` of the run's process: it includes the Python/torch runtime and model loading. "
    "'Above the import baseline' subtracts the RSS measured after the imports, before any model is loaded. "
    "'During training only' resets the kernel's peak mark (`/proc/self/clear_refs`) after set-up and reads "
    "`VmHWM` at the end. RSS also counts the pages of memory-mapped checkpoint files (safetensors are "
    "mapped, not copied: clean, reclaimable, shared with the page cache, and counted once per mapping, so "
    "two models mapping the same file count it twice); the anonymous peak, sampled from `/proc/self/status` "
    "every 50 ms, is the memory the process really allocated. Throughput counts the updates after the first "
    "(warm-up excluded), from a timestamp at the end of every update (TRL: `TrainerCallback.on_step_end`; "
    "marl: `episode / eps` of every update in metrics.jsonl)."
)


def render_markdown(report: dict) -> str:
    config = report["config"]
    gpu = config["device"] == "cuda"
    memory_metric = "cuda_max_allocated_mib" if gpu else "peak_rss_mib"
    memory_label = "peak CUDA memory allocated (MiB)" if gpu else "peak RSS (MiB)"
    lines = [
        f"# marl vs TRL RLOOTrainer: {config['setup']} ({report['date']})",
        "",
        "Command:",
        "",
        "```",
        report["command"],
        "```",
        "",
        f"Wall time of the whole benchmark: {report['wall_minutes']:.1f} min.",
        "",
        "## Machine and versions",
        "",
        "| | |",
        "|---|---|",
        *[f"| {k} | {v} |" for k, v in report["machine"].items()],
        *[f"| {k} | {v} |" for k, v in report["versions"].items()],
        f"| model | `{config['model']}` ({report['model_path_note']}) |",
        f"| reward adapter | {report['reward_adapter_note']} |",
        "",
        "Load average (`/proc/loadavg`) before each batch of runs: "
        + "; ".join(f"{q}: `{load}`" for q, load in report["loadavg"].items()),
        "",
        "## Results (median over runs, min–max in brackets; ratio = marl / TRL of the medians)",
        "",
        "| quantization | metric | marl | TRL | marl/TRL | target | floor (MiB) | marl/floor |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for quantization, block in report["results"].items():
        marl, trl = block["summary"]["marl"], block["summary"]["trl"]
        floor_mib = block["floor"]["total"] / 2**20
        rows = [(memory_label, memory_metric, "≤ 0.45")]
        if not gpu:
            rows += [
                ("peak RSS above the import baseline (MiB)", "peak_above_baseline_mib", ""),
                ("peak RSS during training only (MiB)", "train_peak_rss_mib", ""),
                ("peak anonymous RSS, sampled (MiB)", "peak_anon_rss_mib", ""),
            ]
        rows += [("episodes/s", "eps", "≥ 1.5"), ("generated tokens/s", "tokens_per_s", "")]
        for label, metric, target in rows:
            digits = 0 if metric.endswith("mib") else 2
            floor_cells = "| |"
            if metric in ("cuda_max_allocated_mib", "peak_above_baseline_mib"):
                floor_cells = f"{floor_mib:.0f} | {ratio(marl[metric]['median'], floor_mib):.2f} (≤ 1.3) |"
            lines.append(
                f"| {quantization} | {label} | {_fmt(marl[metric], digits)} | {_fmt(trl[metric], digits)} | "
                f"{ratio(marl[metric]['median'], trl[metric]['median']):.2f} | {target} | {floor_cells}"
            )
    lines += [
        "",
        MEASUREMENT_NOTES + " Every completion has exactly "
        f"{config['response_length']} tokens (`min_new_tokens = max_new_tokens` in both); checked: TRL's "
        f"logged `completions/mean_length` took the values {report['length_checks']['trl']}, marl's "
        f"`val/num_eos_tokens` the values {report['length_checks']['marl']}.",
        "",
        "## Physical floor",
        "",
        "| part | " + " | ".join(report["results"]) + " |",
        "|---|" + "---|" * len(report["results"]),
    ]
    blocks = list(report["results"].values())
    parts = blocks[0]["floor"]
    for part in parts:
        cells = [f"{block['floor'][part] / 2**20:.1f} MiB" for block in report["results"].values()]
        lines.append(f"| {part} | " + " | ".join(cells) + " |")
    # TRL holds the same tensors plus the reward model's own copy of the base.
    trl_floors = [block["floor"]["total"] + block["floor"]["base weights (as stored)"] for block in blocks]
    lines.append(
        "| TRL's floor (+ the reward model's own base) | "
        + " | ".join(f"{floor / 2**20:.1f} MiB" for floor in trl_floors)
        + " |"
    )
    lines.append(
        "| best possible marl/TRL (floor / TRL's floor) | "
        + " | ".join(
            f"{ratio(block['floor']['total'], floor):.2f}"
            for block, floor in zip(blocks, trl_floors, strict=True)
        )
        + " |"
    )
    baselines = {
        q: spread([r["result"]["baseline_rss_mib"] for r in block["runs"]])
        for q, block in report["results"].items()
    }
    if not gpu:
        lines += [
            "",
            "The floor counts tensors only. A CPU process also holds the interpreter and the "
            "torch/transformers libraries: RSS after imports, before any model is loaded, was "
            + "; ".join(f"{q}: {_fmt(b, 0)} MiB" for q, b in baselines.items())
            + ".",
        ]
    lines += [
        "",
        "## Shared configuration",
        "",
        "| field | value |",
        "|---|---|",
        *[f"| {k} | {v} |" for k, v in config.items()],
        f"| policy LoRA target modules | {LORA_TARGET_MODULES} |",
        "| quantization config | NF4, double quantisation, compute dtype = dtype (both systems) |",
        "| reward normalisation / advantage normalisation / missing-EOS penalty | off / off / none (both) |",
        "",
        "Configuration mapping (marl → TRL 1.16 `RLOOConfig`):",
        "",
        "| marl | TRL |",
        "|---|---|",
        *[f"| `{a}` | `{b}` |" for a, b in CONFIG_MAPPING],
        "",
        "## Every run",
        "",
        "| quantization | order | system | peak RSS (MiB) | train-phase peak RSS (MiB) | "
        "peak anon RSS (MiB) | "
        + ("CUDA max allocated (MiB) | " if gpu else "")
        + "episodes/s | tokens/s | update seconds |",
        "|---|---|---|---|---|---|" + ("---|" if gpu else "") + "---|---|---|",
    ]
    for quantization, block in report["results"].items():
        for order, run in enumerate(block["runs"]):
            r = run["result"]
            cuda_cell = f"{r['cuda_max_allocated_mib']:.0f} | " if gpu else ""
            lines.append(
                f"| {quantization} | {order + 1} | {run['system']} | {r['peak_rss_mib']:.0f} | "
                f"{r['train_peak_rss_mib']:.0f} | {r['peak_anon_rss_mib']:.0f} | {cuda_cell}"
                f"{r['eps']:.2f} | {r['tokens_per_s']:.1f} | "
                + ", ".join(f"{s:.1f}" for s in r["update_seconds"])
                + " |"
            )
    return "\n".join(lines) + "\n"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--setup", choices=sorted(SETUPS), default="cpu-smollm2", help="configuration preset")
    parser.add_argument("--quantization", choices=[*QUANTIZATIONS, "both"], default="both")
    parser.add_argument("--runs", type=int, default=3, help="measured runs per system and quantization")
    parser.add_argument("--systems", default="marl,trl", help="comma list of systems to run (default both)")
    parser.add_argument(
        "--reward-adapter", default=None, help="reward adapter folder (default: bundled or fresh)"
    )
    parser.add_argument(
        "--work-dir", default=None, help="where generated models/adapters/logs go (default: temp)"
    )
    parser.add_argument(
        "--output", default=None, help="results markdown (default benchmarks/results/DATE-SETUP.md)"
    )
    for field in dataclasses.fields(BenchConfig):
        if field.name in ("setup",):
            continue
        flag = "--" + field.name.replace("_", "-")
        kind = {"str": str, "int": int, "float": float, "bool": bool}[field.type]
        if kind is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None)
        else:
            parser.add_argument(flag, type=kind, default=None, help=f"override the preset's {field.name}")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def build_config(args: argparse.Namespace) -> BenchConfig:
    values = dict(SETUPS[args.setup], setup=args.setup)
    for field in dataclasses.fields(BenchConfig):
        override = getattr(args, field.name, None)
        if field.name != "setup" and override is not None:
            values[field.name] = override
    return BenchConfig(**values)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        worker_main(args.worker, args.result)
        return
    config = build_config(args)
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    if unknown := set(systems) - set(SYSTEMS):
        raise SystemExit(f"--systems: unknown {sorted(unknown)}; choose from {list(SYSTEMS)}")
    if args.runs < 1:
        raise SystemExit("--runs must be at least 1 (3 or more for a median worth quoting)")
    quantizations = QUANTIZATIONS if args.quantization == "both" else (args.quantization,)
    started = time.perf_counter()
    work_dir = Path(args.work_dir or tempfile.mkdtemp(prefix="marl-vs-trl-"))
    work_dir.mkdir(parents=True, exist_ok=True)
    model_path = prepare_model(config, work_dir)
    reward_adapter = prepare_reward_adapter(config, model_path, work_dir, args.reward_adapter)
    prompts = prepare_prompts(config)
    report: dict = {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "command": "python " + " ".join([os.path.relpath(__file__, REPO_ROOT), *sys.argv[1:]]),
        "config": dataclasses.asdict(config),
        "machine": machine_description(),
        "versions": library_versions(),
        "model_path_note": "bundled GGUF converted by marl.assets"
        if config.model == "smollm2-135m-instruct"
        else "built from a config with random weights",
        "reward_adapter_note": (
            "`adapters/smollm2-135m-rotten-tomatoes-reward` (the project's recipe)"
            if Path(reward_adapter) == BUNDLED_REWARD_ADAPTER
            else (
                "given with --reward-adapter"
                if args.reward_adapter
                else "freshly initialised LoRA r"
                f"{config.lora_r} + score head (same shapes; timing and memory do not depend on its weights)"
            )
        ),
        "loadavg": {},
        "results": {},
    }
    output = None
    if set(systems) == set(SYSTEMS):
        output = (
            Path(args.output)
            if args.output
            else (REPO_ROOT / "benchmarks" / "results" / f"{report['date'][:10]}-{config.setup}.md")
        )
    for quantization in quantizations:
        report["loadavg"][quantization] = load_average()
        print(f"[{quantization}] load average {report['loadavg'][quantization]}", flush=True)
        runs = []
        for index in range(args.runs):
            order = systems if index % 2 == 0 else systems[::-1]
            for system in order:
                label = f"{quantization}-{system}-{index}"
                job = {
                    "system": system,
                    "quantization": quantization,
                    "config": dataclasses.asdict(config),
                    "model_path": model_path,
                    "reward_adapter": reward_adapter,
                    "prompts": prompts,
                }
                result = run_in_subprocess(job, work_dir, label)
                runs.append({"system": system, "quantization": quantization, "result": result})
                print(
                    f"  {label}: peak RSS {result['peak_rss_mib']:.0f} MiB, {result['eps']:.2f} episodes/s, "
                    f"updates {', '.join(f'{s:.1f}' for s in result['update_seconds'])} s",
                    flush=True,
                )
        report["results"][quantization] = {
            "runs": runs,
            "summary": summarize(runs, quantization) if set(systems) == set(SYSTEMS) else {},
            "floor": compute_floor(config, quantization, model_path, reward_adapter, prompts),
        }
        # Written after every batch, so that an interrupted benchmark keeps what it measured.
        write_report(report, started, work_dir, output)


def write_report(report: dict, started: float, work_dir: Path, output: Path | None) -> None:
    """Save the raw JSON and, when both systems ran, the markdown table."""
    report["wall_minutes"] = (time.perf_counter() - started) / 60
    all_runs = [run for block in report["results"].values() for run in block["runs"]]
    report["length_checks"] = {
        "trl": sorted(
            {v for r in all_runs if r["system"] == "trl" for v in r["result"]["completion_length_checked"]}
        ),
        "marl": sorted(
            {v for r in all_runs if r["system"] == "marl" for v in r["result"]["completions_with_eos"]}
        ),
    }
    (work_dir / "report.json").write_text(json.dumps(report, indent=1))
    print(f"raw results: {work_dir / 'report.json'}", flush=True)
    if output is None:
        return
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(render_markdown(report))
    print(f"results: {output}", flush=True)


if __name__ == "__main__":
    main()
