"""Prompt and preference datasets, chat rendering, and the offline assets (bundled model, review data,
judge)."""
