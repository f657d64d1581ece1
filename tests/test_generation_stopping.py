"""Where an AdaFlash ``generate`` stops: exactly where plain decoding stops, for stop strings, custom stopping
criteria, EOS lists and min_new_tokens, although a round commits several tokens at once."""

import pytest
import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from adaflash_hf import AdaFlashDrafter
from adaflash_hf.assets import chat_prompt_ids, load_target

MODES = [
    ("fixed", "diffusion"),
    ("adaptive", "diffusion"),
    ("goodput", "diffusion"),
    ("fixed", "hybrid"),
    ("goodput", "hybrid"),
]


class StopAfterToken(StoppingCriteria):
    """Stops once the sequence ends with ``token``, as a user's criterion that looks at the newest token would."""

    def __init__(self, token: int):
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == self.token


@pytest.fixture
def case(target_factory, oracle_factory):
    """A target, its 40-token greedy continuation of a prompt, and an oracle drafter that gets long runs right (so
    a stop inside a round's accepted chunk happens)."""
    target = target_factory("llama", seed=3)
    prompt = torch.randint(0, 500, (1, 10), generator=torch.Generator().manual_seed(7))
    reference = target.generate(prompt, max_new_tokens=40, do_sample=False)
    drafter = oracle_factory(target, reference, seed=2)
    return target, prompt, reference, drafter


def _first_change(tokens: list[int]) -> int:
    """The index of the first token that differs from the one before it (a stop the oracle drafts through)."""
    return next(i for i in range(1, len(tokens)) if tokens[i] != tokens[i - 1])


@pytest.mark.parametrize(("length_mode", "draft_source"), MODES)
def test_a_custom_stopping_criterion_ends_the_output_where_plain_decoding_does(
    case, length_mode, draft_source
):
    target, prompt, reference, drafter = case
    new = reference[0, prompt.shape[1] :].tolist()
    stop = new[_first_change(new)]
    criteria = StoppingCriteriaList([StopAfterToken(stop)])
    plain = target.generate(prompt, max_new_tokens=40, do_sample=False, stopping_criteria=criteria)
    assert plain.shape[1] < reference.shape[1]
    fast = target.generate(
        prompt,
        max_new_tokens=40,
        do_sample=False,
        stopping_criteria=criteria,
        assistant_model=drafter,
        adaflash_length_mode=length_mode,
        adaflash_draft_source=draft_source,
    )
    assert torch.equal(fast, plain)


def test_a_sampled_output_never_runs_past_a_stop(case):
    target, prompt, reference, drafter = case
    new = reference[0, prompt.shape[1] :].tolist()
    stop = new[_first_change(new)]
    for seed in range(4):
        torch.manual_seed(seed)
        out = target.generate(
            prompt,
            max_new_tokens=40,
            do_sample=True,
            top_k=1,
            stopping_criteria=StoppingCriteriaList([StopAfterToken(stop)]),
            assistant_model=drafter,
        )[0, prompt.shape[1] :].tolist()
        assert stop not in out[:-1]


@pytest.mark.parametrize(("length_mode", "draft_source"), MODES)
def test_an_eos_list_ends_the_output_at_the_first_of_them(case, length_mode, draft_source):
    target, prompt, reference, drafter = case
    new = reference[0, prompt.shape[1] :].tolist()
    eos = [new[_first_change(new)], new[-1]]
    plain = target.generate(prompt, max_new_tokens=40, do_sample=False, eos_token_id=eos, pad_token_id=0)
    fast = target.generate(
        prompt,
        max_new_tokens=40,
        do_sample=False,
        eos_token_id=eos,
        pad_token_id=0,
        assistant_model=drafter,
        adaflash_length_mode=length_mode,
        adaflash_draft_source=draft_source,
    )
    assert torch.equal(fast, plain) and plain.shape[1] < reference.shape[1]


def test_min_new_tokens_holds_off_an_early_eos_as_plain_decoding_does(case):
    target, prompt, reference, drafter = case
    new = reference[0, prompt.shape[1] :].tolist()
    eos = new[0]
    kwargs = dict(max_new_tokens=40, do_sample=False, eos_token_id=eos, pad_token_id=0, min_new_tokens=6)
    plain = target.generate(prompt, **kwargs)
    assert plain.shape[1] - prompt.shape[1] >= 6
    assert torch.equal(target.generate(prompt, assistant_model=drafter, **kwargs), plain)


def test_max_time_stops_at_a_round_boundary_on_a_prefix_of_the_greedy_output(case):
    target, prompt, reference, drafter = case
    out = target.generate(prompt, max_new_tokens=40, do_sample=False, max_time=0.0, assistant_model=drafter)
    assert prompt.shape[1] < out.shape[1] < reference.shape[1]
    assert torch.equal(out, reference[:, : out.shape[1]])


@pytest.mark.integration
@pytest.mark.parametrize("draft_source", ["diffusion", "hybrid"])
def test_stop_strings_end_the_real_targets_output_where_plain_decoding_does(draft_source):
    target, tokenizer = load_target()
    drafter = AdaFlashDrafter.from_pretrained("examples/drafters/smollm2-135m-adaflash", dtype=torch.float32)
    ids = chat_prompt_ids(tokenizer, "Write a Python function that reverses a string.")
    kwargs = dict(max_new_tokens=32, do_sample=False, stop_strings=["\n\n", "return"], tokenizer=tokenizer)
    plain = target.generate(ids, **kwargs)
    assert plain.shape[1] - ids.shape[1] < 32
    fast = target.generate(ids, assistant_model=drafter, adaflash_draft_source=draft_source, **kwargs)
    assert torch.equal(fast, plain)
