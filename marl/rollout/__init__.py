"""Rollouts: prompts in, sampled and scored completions out (no gradients)."""
