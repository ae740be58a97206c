"""``marl demo``, one program in one folder: its settings and starting policy
(:mod:`~marl.apps.demo.arguments`), its rewards (:mod:`~marl.apps.demo.rewards`), the pipeline for one policy
or a sweep (:mod:`~marl.apps.demo.pipeline`) and the verdict (:mod:`~marl.apps.demo.verdict`)."""

from marl.apps.demo.arguments import (
    REWARD_ADAPTER_NAME,
    SHIPPED_ADAPTERS_DIR,
    DemoArguments,
    check_demo_sweep,
    demo_rloo_config,
)
from marl.apps.demo.pipeline import run_demo
from marl.apps.demo.verdict import verdict_rows

__all__ = [
    "REWARD_ADAPTER_NAME",
    "SHIPPED_ADAPTERS_DIR",
    "DemoArguments",
    "check_demo_sweep",
    "demo_rloo_config",
    "run_demo",
    "verdict_rows",
]
