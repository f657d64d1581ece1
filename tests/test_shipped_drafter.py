"""The shipped SmolLM2 drafter: it loads strictly, fits SmolLM2, drafts usefully and stays lossless (integration)."""

import importlib.util
import re
from pathlib import Path

import pytest
import torch
from huggingface_hub import ModelCard
from transformers import GenerationConfig

from adaflash_hf import AdaFlashDrafter
from adaflash_hf.assets import chat_prompt_ids, load_target
from adaflash_hf.data import load_domain

REPO = Path(__file__).resolve().parents[1]
SHIPPED = REPO / "examples" / "drafters" / "smollm2-135m-adaflash"

pytestmark = pytest.mark.integration


def test_shipped_drafter_is_small_safetensors_with_a_model_card():
    files = {p.name: p.stat().st_size for p in SHIPPED.iterdir()}
    assert "model.safetensors" in files and not any(name.endswith(".bin") for name in files)
    assert sum(files.values()) < 25 * 2**20
    card = ModelCard.load(SHIPPED / "README.md")
    assert card.data.base_model == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert {"adaflash", "dflash", "speculative-decoding"} <= set(card.data.tags)
    assert "accelerate launch trainers/train_drafter.py" in card.text
    assert (REPO / "model_cards" / "smollm2-135m-adaflash.md").read_text() == (
        SHIPPED / "README.md"
    ).read_text()


def test_shipped_cards_usage_is_the_template_as_drafter_card_renders_it():
    from adaflash_hf.hub import drafter_card

    def usage(text: str) -> str:
        return text[text.index("## How to use") : text.index("## Drafter")]

    shipped = ModelCard.load(SHIPPED / "README.md")
    rendered = drafter_card(
        AdaFlashDrafter.from_pretrained(SHIPPED),
        "adaflash-hf/smollm2-135m-adaflash",
        base_model=shipped.data.base_model,
    )
    assert usage(rendered.text) == usage(shipped.text)


def test_shipped_drafter_fits_smollm2_and_generates_losslessly():
    target, tokenizer = load_target()
    drafter = AdaFlashDrafter.from_pretrained(SHIPPED, dtype=torch.float32).eval()
    drafter.check_target(target)
    prompt = chat_prompt_ids(tokenizer, load_domain("math", "heldout", n=1)[0]["prompt"])
    plain = target.generate(prompt, max_new_tokens=96, do_sample=False)
    config = GenerationConfig(max_new_tokens=96, do_sample=False, adaflash_length_mode="fixed")
    fast = target.generate(prompt, assistant_model=drafter, generation_config=config)
    assert torch.equal(plain, fast)
    # An untrained drafter gives exactly 1.0 here (greedy, deterministic); the shipped one accepts drafts.
    assert drafter.last_stats.tau > 1.05


@pytest.mark.parametrize("draft_source", ["diffusion", "hybrid"])
def test_shipped_drafter_samples_reproducibly_and_exactly_where_sampling_is_deterministic(draft_source):
    """Sampling: a fixed seed reproduces the output, and with top_k=1 (a one-hot target distribution, where lossless
    speculative sampling must equal plain decoding token for token) the output is plain greedy's."""
    target, tokenizer = load_target()
    drafter = AdaFlashDrafter.from_pretrained(SHIPPED)
    prompt = chat_prompt_ids(tokenizer, "Name three uses of a paperclip.")
    sampling = dict(max_new_tokens=24, do_sample=True, temperature=0.8, adaflash_draft_source=draft_source)

    def sample(seed, **extra):
        torch.manual_seed(seed)
        config = GenerationConfig(**{**sampling, **extra})
        return target.generate(prompt, assistant_model=drafter, generation_config=config)

    assert torch.equal(sample(7), sample(7))
    greedy = target.generate(prompt, max_new_tokens=24, do_sample=False)
    assert torch.equal(sample(3, top_k=1), greedy)


def test_demo_runs_and_checks_against_plain_greedy(capsys):
    spec = importlib.util.spec_from_file_location("demo", REPO / "examples" / "demo.py")
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    assert demo.main(["--prompts-per-domain", "1", "--max-new-tokens", "24", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    for mode in ("default", "diffusion"):  # side by side on every prompt, each checked against plain greedy
        assert out.count(f"--- {mode + ':':8} identical to plain greedy: True") == 3
    assert "All outputs identical to plain greedy: True" in out
    assert "default  tau" in out and "diffusion tau" in out and 'adaflash_draft_source="diffusion"' in out
    assert "On this CPU (measured in this run) a 2-token verify forward costs" in out
    # the target goes through prepare_target's choice for this CPU, and the demo says which
    assert re.search(
        r"target: prepare_target: (bf16|fp32|int4): .*plain greedy below is this target's own", out
    )


def test_shipped_remote_code_is_the_current_modeling_code():
    # save_pretrained copies modeling/ next to the weights for trust_remote_code users; a stale copy would load
    # different code than the package.
    remote_code = sorted((REPO / "modeling").glob("*_adaflash.py"))
    assert {"configuration_adaflash.py", "modeling_adaflash.py", "sidecar_adaflash.py"} <= {
        p.name for p in remote_code
    }
    for path in remote_code:
        assert (SHIPPED / path.name).read_text() == path.read_text(), path.name
