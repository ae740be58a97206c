"""Rollouts: prompts in, sampled and scored completions out (no gradients).

prompts (:mod:`marl.data.prompts`: tokenised once, chosen per update) → a sampler
(:mod:`marl.rollout.samplers`, chosen by name) draws the completions (:mod:`marl.rollout.completions`: cut
after their stop token) → the scorer (:mod:`marl.rollout.scoring`) computes their log-probs and reward rows;
:mod:`marl.rollout.collect` runs the three for one update.
"""
