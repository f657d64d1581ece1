"""Continuing a conversation with a cache from an earlier call: an AdaFlash ``generate`` equals plain decoding of the
whole text, whichever call filled the cache."""

import copy

import pytest
import torch
from transformers import DynamicCache

TURN = 8


@pytest.fixture
def conversation(target_factory, drafter_factory):
    """A target, a drafter, a first turn's prompt and the second turn's prompt that continues its output."""
    target = target_factory("qwen3", seed=1)
    drafter = drafter_factory(target)
    g = torch.Generator().manual_seed(1)
    first = torch.randint(0, 500, (1, 10), generator=g)
    reply = target.generate(first, max_new_tokens=TURN, do_sample=False)
    second = torch.cat([reply, torch.randint(0, 500, (1, 5), generator=g)], dim=1)
    return target, drafter, first, second


def _filled_cache(target, prompt, **kwargs) -> DynamicCache:
    cache = DynamicCache()
    target.generate(prompt, max_new_tokens=TURN, do_sample=False, cache=cache, **kwargs)
    return cache


@pytest.mark.parametrize("length_mode", ["fixed", "goodput"])
@pytest.mark.parametrize("draft_source", ["diffusion", "hybrid"])
def test_a_cache_from_a_plain_call_continues_exactly(conversation, length_mode, draft_source):
    target, drafter, first, second = conversation
    cache = _filled_cache(target, first)
    expected = target.generate(second, max_new_tokens=12, do_sample=False)
    out = target.generate(
        second,
        max_new_tokens=12,
        do_sample=False,
        cache=copy.deepcopy(cache),
        assistant_model=drafter,
        adaflash_length_mode=length_mode,
        adaflash_draft_source=draft_source,
    )
    assert torch.equal(out, expected)


def test_a_cache_from_an_adaflash_call_continues_exactly_as_past_key_values_too(conversation):
    target, drafter, first, second = conversation
    cache = _filled_cache(target, first, assistant_model=drafter)
    expected = target.generate(second, max_new_tokens=12, do_sample=False)
    out = target.generate(
        second, max_new_tokens=12, do_sample=False, past_key_values=cache, assistant_model=drafter
    )
    assert torch.equal(out, expected)
    assert cache.get_seq_length() == out.shape[1] - 1  # the cache holds the whole text but the newest token


def test_a_cache_holding_the_whole_prompt_is_refused_before_any_forward(conversation):
    target, drafter, first, _ = conversation
    cache = _filled_cache(target, first)
    calls = []
    target.register_forward_pre_hook(lambda *_: calls.append(1))
    prompt = first[:, :5]
    with pytest.raises(
        ValueError, match=r"^cache: expected fewer cached positions than the prompt's 5 tokens"
    ):
        target.generate(prompt, max_new_tokens=4, do_sample=False, cache=cache, assistant_model=drafter)
    assert calls == []
