"""``marl demo``, one program in one folder: its settings (:mod:`~marl.apps.demo.arguments`), what it
does before training (:mod:`~marl.apps.demo.start`), its rewards (:mod:`~marl.apps.demo.rewards`), its
optional warm start (:mod:`~marl.apps.demo.policy`), the run (:mod:`~marl.apps.demo.run`), the sweep
(:mod:`~marl.apps.demo.sweep`) and the verdict (:mod:`~marl.apps.demo.verdict`)."""

from marl.apps.demo.arguments import (
    REWARD_ADAPTER_NAME,
    SHIPPED_ADAPTERS_DIR,
    DemoArguments,
    check_demo_sweep,
    demo_rloo_config,
)
from marl.apps.demo.run import run_demo
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
