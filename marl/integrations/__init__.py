"""marl's pieces inside other libraries' trainers.

- :mod:`marl.integrations.trl`: a reward adapter on the policy's own base as a reward function for TRL's
  ``GRPOTrainer`` and ``RLOOTrainer``, in place of a second, separately loaded reward model.
"""
