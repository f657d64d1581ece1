"""Online learning around the serving side: trajectories and the replay buffer (``buffer``), versioned weights,
hot reload and atomic checkpoints (``weights``), the train cycle (``live``), and the asynchronous serve/train loop
(``loop``) with its settings (``config``). Nothing here imports ``adaflash_hf.trainers``: the loop is handed its trainer."""

from adaflash_hf.online.buffer import EngineRecorder, ReplayBuffer, Trajectory, record_generate
from adaflash_hf.online.config import OnlineConfig
from adaflash_hf.online.weights import HotReloader, PayloadError, latest_checkpoint, publish_weights

__all__ = [
    "EngineRecorder",
    "HotReloader",
    "OnlineConfig",
    "PayloadError",
    "ReplayBuffer",
    "Trajectory",
    "latest_checkpoint",
    "publish_weights",
    "record_generate",
]
