"""The generate hook meets a user's mistakes with a correct result or one clear error before any forward:
``speculation_type="dflash"`` runs transformers' native fixed-length path and refuses AdaFlash knobs, prompt lookup
with an AdaFlash assistant points to the hybrid draft source, a knob without an assistant is refused and a misspelt
one named, knobs left on a reused generation config do not break plain calls, booleans are not numbers, and hidden
states come back with an AdaFlash assistant as without one."""

import pytest
import torch

import adaflash_hf
from tests.conftest import SHORT_PROMPT as PROMPT


def greedy(target, tokens=8, **kwargs):
    return target.generate(PROMPT, max_new_tokens=tokens, do_sample=False, **kwargs)


def test_speculation_type_dflash_runs_the_native_fixed_length_path(
    target_factory, drafter_factory, monkeypatch
):
    target = target_factory("qwen3")
    drafter = drafter_factory(target)
    built = []
    original = adaflash_hf.AdaFlashCandidateGenerator.__init__
    monkeypatch.setattr(
        adaflash_hf.AdaFlashCandidateGenerator,
        "__init__",
        lambda self, *a, **k: (built.append(1), original(self, *a, **k))[1],
    )
    out = greedy(target, 12, assistant_model=drafter, speculation_type="dflash")
    assert torch.equal(out, greedy(target, 12))
    assert (
        not built and drafter.last_stats is None
    )  # transformers' DFlashTokenCandidateGenerator ran, not ours


def test_adaflash_knobs_with_speculation_type_dflash_are_refused(watched):
    target, drafter, calls = watched
    with pytest.raises(
        ValueError, match=r"^adaflash_length_mode: AdaFlash knobs expected .*speculation_type='dflash'"
    ):
        greedy(target, assistant_model=drafter, speculation_type="dflash", adaflash_length_mode="fixed")
    assert not calls


def test_prompt_lookup_with_an_adaflash_assistant_points_to_hybrid(watched):
    target, drafter, calls = watched
    with pytest.raises(
        ValueError, match=r"^prompt_lookup_num_tokens: expected None .*adaflash_draft_source='hybrid'"
    ):
        greedy(target, assistant_model=drafter, prompt_lookup_num_tokens=3)
    assert not calls


def test_an_adaflash_knob_without_an_assistant_is_refused_and_a_typo_named(watched):
    target, _, calls = watched
    with pytest.raises(ValueError, match=r"adaflash_lenght_mode.*did you mean 'adaflash_length_mode'"):
        greedy(target, adaflash_lenght_mode="fixed")
    with pytest.raises(
        ValueError, match=r"^adaflash_length_mode: AdaFlash knobs expected .*got assistant_model=None"
    ):
        greedy(target, adaflash_length_mode="fixed")
    assert not calls


def test_knobs_stored_on_a_reused_config_do_not_break_plain_calls(target_factory):
    target = target_factory("qwen3")
    config = target.generation_config
    config.adaflash_gamma = 1.3
    try:
        assert torch.equal(greedy(target), target.generate(PROMPT, max_new_tokens=8, do_sample=False))
    finally:
        del config.adaflash_gamma


@pytest.mark.parametrize("knob", ["adaflash_gamma", "adaflash_min_len"])
def test_booleans_are_not_numbers_for_knobs(watched, knob):
    target, drafter, calls = watched
    with pytest.raises(ValueError, match=rf"^generation_config\.{knob}: expected .*got True"):
        greedy(target, assistant_model=drafter, **{knob: True})
    assert not calls


def test_hidden_states_are_returned_with_an_adaflash_assistant(target_factory, drafter_factory):
    target = target_factory("qwen3")
    drafter = drafter_factory(target)
    kwargs = dict(output_hidden_states=True, return_dict_in_generate=True)
    plain = greedy(target, **kwargs)
    out = greedy(target, assistant_model=drafter, **kwargs)
    assert torch.equal(out.sequences, plain.sequences)
    layers = target.config.num_hidden_layers + 1
    assert all(len(step) == layers and all(h is not None for h in step) for step in out.hidden_states)
    assert sum(step[-1].shape[1] for step in out.hidden_states) == sum(
        step[-1].shape[1] for step in plain.hidden_states
    )
