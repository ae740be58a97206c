"""The training loop and what it owns: the update, parallelism, checkpoints, the run folder, reward-adapter
training."""
