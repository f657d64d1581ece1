"""AdaFlash drafter model files (installed as ``adaflash_hf.modeling``; flat so they also work as Hub remote code)."""

from .configuration_adaflash import AdaFlashConfig
from .modeling_adaflash import AdaFlashDrafter, AdaFlashDrafterOutput, AdaFlashPreTrainedModel

__all__ = ["AdaFlashConfig", "AdaFlashDrafter", "AdaFlashDrafterOutput", "AdaFlashPreTrainedModel"]
