"""adaflash-hf: AdaFlash adaptive-length block-diffusion drafters for Hugging Face transformers and TRL.

``import adaflash_hf`` registers ``AdaFlashConfig``/``AdaFlashDrafter`` with the Auto classes and installs the
narrow ``generate(..., assistant_model=drafter)`` hook (see ``adaflash_hf.generation``).
"""

__version__ = "0.1.0"

from adaflash_hf.modeling import AdaFlashConfig, AdaFlashDrafter, AdaFlashDrafterOutput
from adaflash_hf.registration import register

register()

__all__ = ["AdaFlashConfig", "AdaFlashDrafter", "AdaFlashDrafterOutput", "__version__", "register"]
