"""Where scores come from: reward sources and the kinds that build them, their weighted sum, judges and TRL
interop.

- :mod:`marl.rewards.batch`: the rows to score, the :class:`RewardSource` protocol, the parts a source reads;
- :mod:`marl.rewards.adapter`: reward adapters as sources, and the one chunked scoring loop;
- :mod:`marl.rewards.functions`: the user's reward functions, imported and checked;
- :mod:`marl.rewards.judges`: the judges that evaluate a policy;
- :mod:`marl.rewards.weighted`: several sources as one weighted reward;
- :mod:`marl.rewards.kinds`: the registry of reward source kinds (the extension point);
- :mod:`marl.rewards.interop`: a reward adapter as a reward function for TRL's trainers.
"""

from marl.rewards.adapter import AdapterReward, EosTerminatedAdapterReward
from marl.rewards.batch import RewardParts, RewardScores, RewardSource, ScoringBatch, ScoringChunk
from marl.rewards.functions import FunctionReward, load_reward_fn
from marl.rewards.interop import RewardAdapterFunction
from marl.rewards.judges import CheckedJudge, load_judge
from marl.rewards.kinds import (
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
    "RewardAdapterFunction",
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
