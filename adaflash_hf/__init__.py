"""adaflash-hf: AdaFlash adaptive-length block-diffusion drafters for Hugging Face transformers and TRL.

``import adaflash_hf`` registers ``AdaFlashConfig``/``AdaFlashDrafter`` with the Auto classes and installs the
narrow ``generate(..., assistant_model=drafter)`` hook (``adaflash_hf.generation``; ``enable()``/``disable()``).
"""

__version__ = "0.1.0"

from transformers.utils import logging

from adaflash_hf.generation import AdaFlashCandidateGenerator, disable, enable, is_enabled
from adaflash_hf.modeling import AdaFlashConfig, AdaFlashDrafter, AdaFlashDrafterOutput
from adaflash_hf.registration import register
from adaflash_hf.serving import AdaFlashEngine, SamplingParams
from adaflash_hf.stats import AdaFlashStats, RoundRecord

register()
try:
    enable()
except (
    RuntimeError
) as error:  # an untested transformers: keep the package importable, say why generate won't adapt
    logging.get_logger(__name__).warning(f"{error}. Call adaflash_hf.enable() after fixing this.")

__all__ = [
    "AdaFlashCandidateGenerator",
    "AdaFlashConfig",
    "AdaFlashDrafter",
    "AdaFlashDrafterOutput",
    "AdaFlashEngine",
    "AdaFlashStats",
    "RoundRecord",
    "SamplingParams",
    "__version__",
    "disable",
    "enable",
    "is_enabled",
    "register",
]
