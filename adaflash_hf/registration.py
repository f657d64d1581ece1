"""Register the drafter with transformers' Auto classes (idempotent; runs on ``import adaflash_hf``)."""

from transformers import AutoConfig, AutoModel

from adaflash_hf.modeling import AdaFlashConfig, AdaFlashDrafter


def register() -> None:
    AutoConfig.register(AdaFlashConfig.model_type, AdaFlashConfig, exist_ok=True)
    AutoModel.register(AdaFlashConfig, AdaFlashDrafter, exist_ok=True)
