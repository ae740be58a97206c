"""Will it fit? The peak memory of an RLOO run predicted from its config and the model's ``config.json``.

See :mod:`marl.plan.planner` (what a plan adds up, and the plan and its parts), :mod:`marl.plan.phases` (the
phases traced on the meta device, as each system compared runs them), :mod:`marl.plan.trace` (the meta-device
model and how bytes are counted there), :mod:`marl.plan.advice` (the changes that would make a run fit) and
:mod:`marl.plan.fit` (``--fit auto``: the planner applied to a run).
"""

from marl.plan.planner import MemoryPlan, PhasePlan, PlanTarget, load_model_config, plan_memory

__all__ = ["MemoryPlan", "PhasePlan", "PlanTarget", "load_model_config", "plan_memory"]
