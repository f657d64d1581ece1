"""Shared fixtures: tiny random targets (Qwen3, Llama) and drafters built for them. Everything runs offline."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Goodput's calibration is saved per machine outside tests only: a test measures its own (tests/test_cost_model.py
# turns saving on in a temporary folder).
os.environ["ADAFLASH_CACHE"] = ""

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


@pytest.fixture(scope="session")
def target_factory():
    """``target_factory(kind="qwen3"|"llama", seed=0, dtype=torch.float32, **config_overrides)``."""
    return make_target


@pytest.fixture(scope="session")
def drafter_factory():
    """``drafter_factory(target, seed=1, **AdaFlashConfig_overrides)``: a random drafter built for ``target``."""
    return make_drafter


class OracleDrafter(AdaFlashDrafter):
    """A real drafter whose block rows are overwritten so the target's lm_head proposes the reference tokens for
    exactly ``j`` rows, then a wrong token: it exercises partial acceptance and cache rollback deterministically."""

    def arm(self, reference, lm_weight, seed: int = 0, max_right: int | None = None, sharpness: float = 4.0):
        self.reference = reference[0]
        self.sharpness = sharpness
        self.lm_weight = lm_weight
        self.rng = torch.Generator().manual_seed(seed)
        self.max_right = self.config.block_size - 1 if max_right is None else max_right
        self.rights: list[int] = []
        return self

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        block = self.config.block_size
        anchor_position = int(kwargs["position_ids"][0, -block])
        right = int(torch.randint(0, self.max_right + 1, (1,), generator=self.rng))
        self.rights.append(right)
        states = out.last_hidden_state.clone()
        vocab = self.lm_weight.shape[0]
        for row in range(1, block):
            position = anchor_position + row
            if position >= self.reference.shape[0]:
                token = 0
            elif row <= right:
                token = int(self.reference[position])
            else:
                token = (int(self.reference[position]) + 1) % vocab
            states[0, row] = self.lm_weight[token] * self.sharpness
        out.last_hidden_state = states
        return out


def make_oracle(target, reference, seed=0, max_right=None, sharpness=4.0, **config):
    base = make_drafter(target, **config)
    oracle = OracleDrafter(base.config).to(next(target.parameters()).dtype).eval()
    oracle.load_state_dict(base.state_dict())
    weight = target.get_output_embeddings().weight.detach()
    logits = weight @ weight.T
    assert torch.equal(logits.argmax(-1), torch.arange(weight.shape[0])), (
        "oracle encoding needs argmax(W W^T) = id"
    )
    return oracle.arm(reference, weight, seed=seed, max_right=max_right, sharpness=sharpness)


@pytest.fixture(scope="session")
def oracle_factory():
    """``oracle_factory(target, reference, seed=0, max_right=None)``: an OracleDrafter right for a random
    0..max_right rows of each block, then wrong, against the ``reference`` sequence."""
    return make_oracle


def make_word_tokenizer(vocab_size: int = TINY_VOCAB):
    """A tokenizer for the tiny targets whose token i is the word ``w{i}`` (0-3 are the special tokens <pad>,
    <eos>, <user>, <assistant>), with a chat template: text is words joined by spaces."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    special = ["<pad>", "<eos>", "<user>", "<assistant>"]
    vocab = {w: i for i, w in enumerate(special)} | {f"w{i}": i for i in range(len(special), vocab_size)}
    backend = Tokenizer(WordLevel(vocab, unk_token="<pad>"))
    backend.pre_tokenizer = WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>")
    tokenizer.add_special_tokens({"additional_special_tokens": special[2:]})
    tokenizer.chat_template = "{% for m in messages %}<user> {{ m['content'] }} {% endfor %}<assistant>"
    return tokenizer


@pytest.fixture(scope="session")
def word_tokenizer():
    """``make_word_tokenizer()``: a word-level tokenizer with a chat template for the tiny targets."""
    return make_word_tokenizer()
