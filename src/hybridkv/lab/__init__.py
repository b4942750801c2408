"""The policy lab: replay real traffic (block-hash traces) through a manager, on a clock."""

from hybridkv.lab.cost_model import GPU_PRESETS, CostModel, GPUPreset
from hybridkv.lab.replay import Replay
from hybridkv.lab.replay_config import ReplayConfig
from hybridkv.lab.result import ReplayResult, percentile

__all__ = [
    "GPU_PRESETS",
    "CostModel",
    "GPUPreset",
    "Replay",
    "ReplayConfig",
    "ReplayResult",
    "percentile",
]
