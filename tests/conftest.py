"""Shared fixtures: tiny random targets (Qwen3, Llama) and drafters built for them. Everything runs offline."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM  # noqa: E402

import adaflash_hf  # noqa: E402,F401
from adaflash_hf import AdaFlashConfig, AdaFlashDrafter  # noqa: E402

torch.set_num_threads(1)

TINY_VOCAB = 512


def tiny_qwen3_config(**overrides) -> Qwen3Config:
    values = dict(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        eos_token_id=None,
        pad_token_id=None,
    )
    values.update(overrides)
    return Qwen3Config(**values)


def tiny_llama_config(**overrides) -> LlamaConfig:
    values = dict(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        eos_token_id=None,
        pad_token_id=None,
    )
    values.update(overrides)
    return LlamaConfig(**values)


def make_target(kind: str = "qwen3", seed: int = 0, dtype=torch.float32, **overrides):
    torch.manual_seed(seed)
    config = tiny_qwen3_config(**overrides) if kind == "qwen3" else tiny_llama_config(**overrides)
    model_cls = Qwen3ForCausalLM if kind == "qwen3" else LlamaForCausalLM
    return model_cls(config).to(dtype).eval()


def make_drafter(target, seed: int = 1, **overrides) -> AdaFlashDrafter:
    torch.manual_seed(seed)
    values = dict(num_hidden_layers=2, mask_token_id=TINY_VOCAB - 1)
    values.update(overrides)
    config = AdaFlashConfig.for_target(target.config, **values)
    dtype = next(target.parameters()).dtype
    return AdaFlashDrafter(config).to(dtype).eval()


@pytest.fixture
def qwen3_target():
    return make_target("qwen3")


@pytest.fixture
def llama_target():
    return make_target("llama")


@pytest.fixture(params=["qwen3", "llama"])
def any_target(request):
    return make_target(request.param)


@pytest.fixture
def target_factory():
    """``target_factory(kind="qwen3"|"llama", seed=0, dtype=torch.float32, **config_overrides)``."""
    return make_target


@pytest.fixture
def drafter_factory():
    """``drafter_factory(target, seed=1, **AdaFlashConfig_overrides)``: a random drafter built for ``target``."""
    return make_drafter
