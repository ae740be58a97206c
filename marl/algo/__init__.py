"""The RL math as pure functions: rewards shaping, advantage estimators, policy losses, metric records."""
