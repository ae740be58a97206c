"""Where scores come from: reward sources and the kinds that build them, their weighted sum, and judges.

- :mod:`marl.rewards.batch`: the rows to score, the :class:`RewardSource` protocol, the parts a source reads;
- :mod:`marl.rewards.adapter`: reward adapters as sources, and the one chunked scoring loop;
- :mod:`marl.rewards.functions`: the user's reward functions and the judges that evaluate a policy, imported
  and checked;
- :mod:`marl.rewards.trl_calls`: reward functions called as TRL calls them;
- :mod:`marl.rewards.weighted`: several sources as one weighted reward;
- :mod:`marl.rewards.reward_kinds`: the registry of reward source kinds (the extension point).

A reward adapter as a reward function for TRL's trainers is :mod:`marl.integrations.trl`.
"""

from marl.rewards.adapter import AdapterReward, EosTerminatedAdapterReward
from marl.rewards.batch import RewardParts, RewardScores, RewardSource, ScoringBatch, ScoringChunk
from marl.rewards.functions import CheckedJudge, FunctionReward, load_judge, load_reward_fn
from marl.rewards.reward_kinds import (
    REWARD_KINDS,
    RewardSetting,
    get_reward_kind,
    parse_reward_setting,
    plan_rewards,
    register_reward_kind,
)
from marl.rewards.weighted import WeightedRewards, build_rewards

__all__ = [
    "REWARD_KINDS",
    "AdapterReward",
    "CheckedJudge",
    "EosTerminatedAdapterReward",
    "FunctionReward",
    "RewardParts",
    "RewardScores",
    "RewardSetting",
    "RewardSource",
    "ScoringBatch",
    "ScoringChunk",
    "WeightedRewards",
    "build_rewards",
    "get_reward_kind",
    "load_judge",
    "load_reward_fn",
    "parse_reward_setting",
    "plan_rewards",
    "register_reward_kind",
]
