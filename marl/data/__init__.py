"""Prompt and preference datasets, chat rendering, the tokenised prompts of a rollout, the offline assets
(bundled model, review data) and the fixed-rule measures that evaluate a policy (the VADER judge)."""
