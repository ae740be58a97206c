"""The end-to-end demo behind ``marl demo``: embedded SmolLM2-135M-Instruct, 4-bit, Rotten Tomatoes prompts.

Everything runs offline from installed packages (see :mod:`marl.assets`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass
class DemoArguments:
    """Settings of ``marl demo``."""

    num_prompts: int = 4
    max_new_tokens: int = 24
    temperature: float = 0.7
    seed: int = 0


def sample_base_completions(arguments: DemoArguments) -> list[tuple[str, str]]:
    """Load the embedded base in 4-bit NF4 and sample one completion per held-out Rotten Tomatoes prompt.

    Example:
        >>> pairs = sample_base_completions(DemoArguments(num_prompts=2))  # doctest: +SKIP
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig

    from marl import assets

    model_path = assets.resolve_model_path(assets.EMBEDDED_MODEL_ID)
    quantization_config = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.float32,
    )
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_path, quantization_config=quantization_config)
    model.eval()
    prompts = assets.build_rl_prompts(assets.split_rotten_tomatoes()["eval"], seed=arguments.seed)
    prompts = prompts["prompt"][: arguments.num_prompts]
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    torch.manual_seed(arguments.seed)
    with torch.no_grad():
        output = model.generate(
            **batch,
            max_new_tokens=arguments.max_new_tokens,
            do_sample=True,
            temperature=arguments.temperature,
            top_k=0,
            top_p=1.0,
            pad_token_id=tokenizer.pad_token_id,
        )
    completions = tokenizer.batch_decode(output[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
    return list(zip(prompts, completions, strict=True))


def run_demo(arguments: DemoArguments) -> None:
    """Run the demo and print what the base model writes for a few held-out prompts."""
    from rich.console import Console
    from rich.table import Table

    from marl import assets

    console = Console()
    start = time.perf_counter()
    console.print(f"Loading {assets.EMBEDDED_MODEL_ID} (4-bit NF4, double quantization)")
    pairs = sample_base_completions(arguments)
    table = Table(title=f"Base model on held-out Rotten Tomatoes prompts (T={arguments.temperature})")
    table.add_column("prompt")
    table.add_column("completion")
    table.add_column("VADER", justify="right")
    for (prompt, completion), score in zip(
        pairs, assets.gold_judge_scores([p + c for p, c in pairs]), strict=True
    ):
        table.add_row(prompt, completion.strip(), f"{score:+.2f}")
    console.print(table)
    console.print(f"done in {time.perf_counter() - start:.1f} s")
