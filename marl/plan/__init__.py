"""Will it fit? The peak memory of an RLOO run predicted from its config and the model's ``config.json``.

See :mod:`marl.plan.planner` (what a plan adds up), :mod:`marl.plan.records` (the plan and its parts),
:mod:`marl.plan.phases` (the phases traced on the meta device), :mod:`marl.plan.trace` (how bytes are counted
there) and :mod:`marl.plan.advice` (the changes that would make a run fit).
"""

from marl.plan.planner import load_model_config, plan_memory
from marl.plan.records import MemoryPlan, PhasePlan, PlanTarget

__all__ = ["MemoryPlan", "PhasePlan", "PlanTarget", "load_model_config", "plan_memory"]
