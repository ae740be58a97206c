"""Does marl learn as well as TRL's RLOOTrainer (or GRPOTrainer) on the same job? Both trained, both
evaluated by the same code.

The job is the demo's: the bundled SmolLM2-135M-Instruct in 4-bit NF4, a fresh LoRA policy (r=16, alpha=32,
all linear layers), the shipped Rotten Tomatoes reward adapter, the bundled "continue the review" prompts,
k completions per prompt of a fixed length, the demo's learning rate, KL coefficient, temperature, batch and
number of updates, and the same seed.

- marl: :func:`marl.apps.demo.demo_rloo_config` on one base under ``--algorithm`` (``rloo``, the default, or
  ``grpo``: group-mean advantages scaled by the group's std, DAPO token loss, k3 KL in the loss with the
  demo's β); the reward adapter scores prompt + completion + EOS
  (:class:`marl.rewards.EosTerminatedAdapterReward`), as it was trained.
- TRL 1.16 ``RLOOTrainer`` (``GRPOTrainer`` with ``--algorithm grpo``, the same settings through
  CONFIG_MAPPING): the policy is the base + ``peft_config`` (reference = adapters disabled); the
  reward is what a TRL user loads, ``AutoModelForSequenceClassification`` + ``PeftModel.from_pretrained``,
  called from a reward function that scores prompt + completion + EOS with the padding id the adapter was
  trained with (its ``marl_reward.json``), so both read the score where the adapter was trained to read it.
  Completions are fixed-length through ``min_new_tokens``.

Each training run is its own process; then both policies and the base are evaluated by
:func:`marl.apps.evaluate.generate_and_score` on the same held-out prompts: VADER win rate over the base, mean
VADER score, mean reward-adapter score, KL to the base, wall time. The results go to a dated markdown file
with the configuration mapping, and a PNG overlays the two systems' training curves.

    python examples/benchmarks/learning_vs_trl.py --seeds 0 1 2
    python examples/benchmarks/learning_vs_trl.py --algorithm grpo --seeds 0 1 2 --side_by_side
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import subprocess
import sys
import time
from pathlib import Path

from learning_report import SYSTEMS, plot, report

REPO_ROOT = Path(__file__).resolve().parents[2]
TRAINERS = {"rloo": "RLOOTrainer", "grpo": "GRPOTrainer"}  # --algorithm -> TRL 1.16's trainer of it
# marl -> TRL 1.16, per algorithm. Rows whose two sides are field names are the same setting under two names:
# tests/test_benchmark_vs_trl.py checks that both job configs hold the same value there.
_COMMON_MAPPING = (
    ("rloo_k", "num_generations"),
    ("kl_coef", "beta"),
    ("cliprange", "epsilon"),
    ("num_ppo_epochs", "num_iterations"),
    ("learning_rate", "learning_rate"),
    ("temperature", "temperature"),
    ("response_length", "max_completion_length"),
    ("per_device_train_batch_size", "per_device_train_batch_size"),
    ("per_device_train_batch_size x num_mini_batches (completions per rollout)", "generation_batch_size"),
    ("num_mini_batches (optimizer steps per rollout)", "steps_per_generation"),
    ("no stop token (every completion response_length long)", "generation_kwargs min_new_tokens"),
    ("total_episodes / batch (updates)", "max_steps / steps_per_generation"),
    ("linear schedule, no warm-up", "lr_scheduler_type linear, warmup_steps 0"),
    ("top_k=0, top_p=1 (plain temperature sampling)", "top_k=0, top_p=1"),
)
CONFIG_MAPPING = {
    "rloo": _COMMON_MAPPING,
    "grpo": (
        *_COMMON_MAPPING,
        ("advantage_estimator grpo", "GRPOTrainer's group-mean advantage"),
        ("scale_rewards", "scale_rewards"),
        ("loss_type", "loss_type"),
        ("epsilon_high", "epsilon_high"),
        ("importance_sampling_level", "importance_sampling_level"),
        ("mask_truncated_completions", "mask_truncated_completions"),
        ("use_bias_correction_kl", "use_bias_correction_kl"),
        ("kl_placement loss (k3 term, weight kl_coef)", "beta > 0 (k3 term in the loss)"),
    ),
}
_COMMON_DIFFERENCES = (
    "TRL keeps the LoRA weights, their gradients and Adam's state in bf16 when the base is quantized; marl "
    "keeps them in float32.",
    "marl's optimizer steps hold whole prompt groups (so that each prompt is computed once); TRL shuffles "
    "the rollout and draws the completions of a step at random.",
    "TRL samples with `min_new_tokens` (EOS masked while sampling, not when scoring); marl samples with no "
    "stop token and keeps EOS in the distribution it scores.",
)
DIFFERENCES = {
    "rloo": _COMMON_DIFFERENCES,
    "grpo": (
        *_COMMON_DIFFERENCES,
        "Advantages, loss and KL are the same computation (marl's parity tests against TRL 1.16's "
        "GRPOTrainer code): group mean, divided by the group's std; DAPO token loss; k3 KL in the loss "
        "weighted by β and the importance ratio (use_bias_correction_kl). The DAPO normaliser is the same "
        "number in both: TRL divides by the rollout's completion tokens / steps_per_generation, marl by the "
        "optimizer step's tokens, and every completion has the same length.",
        "The advantages of a marl step are those of whole groups (each step's advantages sum to zero with "
        "scale_rewards group); TRL's random steps mix groups.",
        "The curves' KL differs in kind: marl logs the sum over tokens of log π/π_ref of the sampled tokens "
        "(k1); TRL logs the mean per-token k3, scaled here by the completion length. The held-out KL in the "
        "tables is computed by the same code for both.",
    ),
}


@dataclasses.dataclass
class Job:
    """One training run: the demo's settings for one system and seed, under an ``--algorithm`` preset."""

    system: str
    seed: int
    output_dir: str
    total_episodes: int | None = None  # None: the demo's
    num_eval_prompts: int | None = None  # None: the demo's
    algorithm: str = "rloo"


def demo_settings(job: Job):
    from marl.apps.demo import REWARD_ADAPTER_NAME, DemoArguments, demo_rloo_config

    # The one-reward demo: TRL's trainers are compared on the one reward model they both load.
    arguments = DemoArguments(seed=job.seed, rewards="sentiment")
    if job.total_episodes is not None:
        arguments = dataclasses.replace(arguments, total_episodes=job.total_episodes)
    if job.num_eval_prompts is not None:
        arguments = dataclasses.replace(arguments, num_eval_prompts=job.num_eval_prompts)
    reward_adapter = str(REPO_ROOT / "adapters" / REWARD_ADAPTER_NAME)  # the shipped one, in this checkout
    return (
        arguments,
        demo_rloo_config(arguments, Path(job.output_dir) / "run", reward_adapter, algorithm=job.algorithm),
        reward_adapter,
    )


def trl_config(job: Job, config):
    """TRL 1.16's config of ``job``: its ``RLOOConfig`` or ``GRPOConfig`` set as the marl ``config`` is (see
    CONFIG_MAPPING)."""
    from setups import trl_sampling_and_objective
    from trl import GRPOConfig
    from trl import RLOOConfig as TrlRLOOConfig

    loss = {}
    if job.algorithm == "grpo":
        loss = dict(
            loss_type=config.loss_type,
            scale_rewards=config.scale_rewards,
            epsilon_high=config.epsilon_high,
            importance_sampling_level=config.importance_sampling_level,
            mask_truncated_completions=config.mask_truncated_completions,
            use_bias_correction_kl=config.use_bias_correction_kl,
        )
    updates = config.batch_sizes(1, 10**6).num_total_batches
    return (GRPOConfig if job.algorithm == "grpo" else TrlRLOOConfig)(
        output_dir=str(Path(job.output_dir) / "trl"),
        per_device_train_batch_size=config.per_device_train_batch_size,
        steps_per_generation=config.num_mini_batches,
        max_steps=updates * config.num_mini_batches,
        **trl_sampling_and_objective(config, seed=job.seed),
        **loss,
        bf16=False,
        use_cpu=True,
        logging_steps=config.num_mini_batches,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
    )


def train_marl(job: Job) -> dict:
    from transformers import AutoTokenizer

    from marl.data.prompts import rotten_tomatoes_prompts
    from marl.model.multi_adapter import MultiAdapterModel
    from marl.rewards import EosTerminatedAdapterReward
    from marl.train.trainer import RLOOTrainer

    _, config, _ = demo_settings(job)
    model = MultiAdapterModel.from_config(config)
    tokenizer = AutoTokenizer.from_pretrained(model.name_or_path)
    reward = EosTerminatedAdapterReward(
        model, tokenizer, rows_per_pass=config.local_rollout_forward_batch_size
    )
    started = time.perf_counter()
    trainer = RLOOTrainer(
        config, model, tokenizer, rotten_tomatoes_prompts("train", seed=job.seed), reward_funcs=reward
    )
    history = trainer.train()
    return {
        "train_seconds": time.perf_counter() - started,
        "adapter": config.output_dir,
        "curve": [
            {"episode": r["episode"], "score": r["objective/scores"], "kl": r["objective/kl"]}
            for r in history
        ],
    }


def train_trl(job: Job) -> dict:
    import torch
    import trl
    from peft import LoraConfig, PeftModel
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from marl.data.assets import resolve_model_path
    from marl.data.prompts import rotten_tomatoes_prompts
    from marl.model.adapters import read_reward_pad_token_id
    from marl.model.quantization import bitsandbytes_config

    _, config, reward_adapter = demo_settings(job)
    path = resolve_model_path(config.model_name_or_path)
    quantization = bitsandbytes_config("4bit", torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
    reward_tokenizer = AutoTokenizer.from_pretrained(path)
    reward_pad = read_reward_pad_token_id(Path(reward_adapter))
    classifier = AutoModelForSequenceClassification.from_pretrained(
        path, num_labels=1, dtype=torch.float32, quantization_config=quantization
    )
    classifier.config.pad_token_id = reward_pad
    reward_model = PeftModel.from_pretrained(classifier, reward_adapter).eval()

    def sentiment(prompts, completions, **kwargs):
        """The reward adapter on prompt + completion + EOS, padded with its training pad (read as trained)."""
        eos = reward_tokenizer.eos_token_id
        texts = [prompt + completion for prompt, completion in zip(prompts, completions, strict=True)]
        rows = [[*reward_tokenizer(text, add_special_tokens=False)["input_ids"], eos] for text in texts]
        width = max(len(row) for row in rows)
        ids = torch.tensor([row + [reward_pad] * (width - len(row)) for row in rows])
        with torch.no_grad():
            return (
                reward_model(input_ids=ids, attention_mask=(ids != reward_pad).long()).logits[:, 0].tolist()
            )

    rollout = config.per_device_train_batch_size * config.num_mini_batches
    args = trl_config(job, config)
    lora = LoraConfig(
        r=config.lora_r, lora_alpha=config.lora_alpha, target_modules="all-linear", task_type="CAUSAL_LM"
    )
    trainer = getattr(trl, TRAINERS[job.algorithm])(
        model=path,
        reward_funcs=[sentiment],
        args=args,
        train_dataset=rotten_tomatoes_prompts("train", seed=job.seed),
        processing_class=tokenizer,
        peft_config=lora,
        quantization_config=quantization,
    )
    started = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - started
    adapter_dir = Path(job.output_dir) / "trl-adapter"
    trainer.model.save_pretrained(str(adapter_dir))
    curve = [
        {
            "episode": entry["step"] * config.per_device_train_batch_size,
            "score": entry["rewards/sentiment/mean"],
            # TRL logs the mean KL per token; completions have a fixed length: this is the sum per completion
            "kl": entry.get("kl", float("nan")) * config.response_length,
        }
        for entry in trainer.state.log_history
        if "rewards/sentiment/mean" in entry
    ]
    return {"train_seconds": seconds, "adapter": str(adapter_dir), "curve": curve, "rollout": rollout}


def evaluate(job: Job, adapter: str) -> dict:
    """The same evaluation for every policy: marl's, on held-out prompts, with VADER."""
    from transformers import AutoTokenizer

    from marl import MultiAdapterModel
    from marl.apps.evaluate import generate_and_score, summarize
    from marl.data.prompts import rotten_tomatoes_prompts
    from marl.rewards import load_judge

    arguments, config, reward_adapter = demo_settings(job)
    model = MultiAdapterModel.from_pretrained(
        config.model_name_or_path, quantization="4bit", reward_adapter=reward_adapter, policy_adapter=adapter,
        reference="base",
    )  # fmt: skip
    tokenizer = AutoTokenizer.from_pretrained(model.name_or_path)
    prompts = list(rotten_tomatoes_prompts("test", seed=job.seed)["prompt"][: arguments.num_eval_prompts])
    samples = generate_and_score(
        model, tokenizer, prompts, load_judge(None), response_length=config.response_length,
        temperature=config.temperature, batch_size=100, seed=job.seed, stop_at_eos=False, progress=False,
    )  # fmt: skip
    return summarize(samples)


def worker(job_file: str) -> None:
    job = Job(**json.loads(Path(job_file).read_text()))
    import torch

    # One thread per run: a run never stalls on a core that the other system's run (side by side) or another
    # process takes, and both systems get the same share of the machine.
    torch.set_num_threads(1)
    result = (train_marl if job.system == "marl" else train_trl)(job)
    started = time.perf_counter()
    result["evaluation"] = evaluate(job, result["adapter"])
    result["eval_seconds"] = time.perf_counter() - started
    (Path(job.output_dir) / "result.json").write_text(json.dumps(result, indent=2) + "\n")


def run(jobs: list[Job]) -> list[dict]:
    """Run the jobs at the same time, each in its own single-threaded process; their results in order."""
    processes = []
    try:
        for job in jobs:
            folder = Path(job.output_dir)
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "job.json").write_text(json.dumps(dataclasses.asdict(job)))
            command = [sys.executable, __file__, "--worker", str(folder / "job.json")]
            with (folder / "log.txt").open("w") as log:
                processes.append(
                    subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT)
                )
        while True:
            codes = [process.poll() for process in processes]
            failed = [job for job, code in zip(jobs, codes, strict=True) if code not in (None, 0)]
            if failed:
                job = failed[0]
                raise SystemExit(f"{job.system} seed {job.seed} failed: see {job.output_dir}/log.txt")
            if all(code == 0 for code in codes):
                break
            time.sleep(1.0)
    finally:
        for process in processes:  # a failed run stops its sibling
            if process.poll() is None:
                process.terminate()
                process.wait()
    return [json.loads((Path(job.output_dir) / "result.json").read_text()) for job in jobs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument(
        "--algorithm",
        choices=list(TRAINERS),
        default="rloo",
        help="marl's --algorithm preset, against TRL 1.16's trainer of it (rloo: RLOOTrainer, grpo: "
        "GRPOTrainer); the demo's k, batch, learning rate, KL coefficient, epochs and episodes either way.",
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--total_episodes", type=int, default=None, help="Default: the demo's.")
    parser.add_argument("--num_eval_prompts", type=int, default=None, help="Default: the demo's.")
    parser.add_argument("--work_dir", default=None, help="Default: runs/learning-vs-trl[-<algorithm>].")
    parser.add_argument(
        "--side_by_side",
        action="store_true",
        help="Train marl and TRL of a seed at the same time, one thread each (needs >= 2 free cores).",
    )
    parser.add_argument(
        "--output", default=None, help="Results markdown (default benchmarks/results/<date>-...)"
    )
    options = parser.parse_args()
    if options.worker:
        worker(options.worker)
        return
    suffix = "" if options.algorithm == "rloo" else f"-{options.algorithm}"
    work_dir = options.work_dir or f"runs/learning-vs-trl{suffix}"
    stamp = datetime.date.today().isoformat()
    name = f"{stamp}-learning-vs-trl{suffix}.md"
    output = Path(options.output or REPO_ROOT / "benchmarks" / "results" / name)
    results: dict[str, list[dict]] = {system: [] for system in SYSTEMS}
    for seed in options.seeds:
        jobs = [
            Job(system, seed, str(Path(work_dir) / f"{system}-seed{seed}"), options.total_episodes,
                options.num_eval_prompts, options.algorithm)
            for system in SYSTEMS
        ]  # fmt: skip
        # Both systems of a seed at once (side by side) or one after the other: either way a slower period of
        # the machine hits both.
        batches = [jobs] if options.side_by_side else [[job] for job in jobs]
        for batch in batches:
            print(f"seed {seed}: {', '.join(job.system for job in batch)} ...", flush=True)
            for job, result in zip(batch, run(batch), strict=True):
                result["seed"] = seed
                results[job.system].append(result)
                win, minutes = result["evaluation"]["comparison"]["win_rate"], result["train_seconds"] / 60
                print(f"  {job.system}: win rate {win:.1%}, {minutes:.1f} min", flush=True)
    first = Job("marl", options.seeds[0], work_dir, options.total_episodes, options.num_eval_prompts)
    arguments, _, _ = demo_settings(first)
    settings = {
        **dataclasses.asdict(arguments),
        "algorithm": options.algorithm,
        "seeds": options.seeds,
        "side_by_side": options.side_by_side,
    }
    command = " ".join(["python", "examples/benchmarks/learning_vs_trl.py", *sys.argv[1:]])
    output.parent.mkdir(parents=True, exist_ok=True)
    trainer = TRAINERS[options.algorithm]
    text = report(
        results, settings, command, trainer, CONFIG_MAPPING[options.algorithm], DIFFERENCES[options.algorithm]
    )
    output.write_text(text)
    plot(results, output.with_suffix(".png"))
    (output.with_suffix(".json")).write_text(json.dumps(results, indent=2) + "\n")
    print(f"results: {output}")


if __name__ == "__main__":
    main()
