"""Drafter trainers (installed as ``adaflash_hf.trainers``), each a TRL-style trio: config, trainer, script."""

from adaflash_hf.trainers.opd_config import OPDConfig
from adaflash_hf.trainers.opd_trainer import OPDTrainer
from adaflash_hf.trainers.train_drafter_config import DrafterTrainingConfig
from adaflash_hf.trainers.train_drafter_trainer import DrafterTrainer

__all__ = ["DrafterTrainer", "DrafterTrainingConfig", "OPDConfig", "OPDTrainer"]
