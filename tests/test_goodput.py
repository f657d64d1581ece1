"""Cost-aware drafting (``length_mode="goodput"``): the choice with injected timings and acceptance estimates (no
wall-clock), the cost and acceptance models, the settings object, and lossless generate/engine runs whose rounds
include k = 0 and skipped drafter forwards."""

import pytest
import torch
from transformers import GenerationConfig

from adaflash_hf.acceptance import AcceptanceModel, LookupModel, ShadowLabels
from adaflash_hf.cost_model import CostModel, calibrate_target, use_cost_model
from adaflash_hf.drafting import DraftingSettings, SkipGate, draft_surplus, plan_lengths, plan_round
from adaflash_hf.lookup import LookupProposal
from adaflash_hf.policy import COLD_DRAFTS, GoodputPolicy, Round, Slot, Step
from adaflash_hf.serving import AdaFlashEngine, SamplingParams
from tests.conftest import finished_requests

BLOCK = 16


def linear_cost(per_token: float, base: float = 1.0):
    return lambda n: base + per_token * (n - 1)


def chain(rate: float, length: int = BLOCK - 1) -> list[float]:
    return [rate**j for j in range(1, length + 1)]


# ------------------------------------------------------------------------------------------------ the choice
def test_no_draft_when_even_one_draft_cannot_pay():
    # One draft accepted with p = 0.3 commits 1.3 tokens for 1.5x the time of a plain step.
    lengths, goodput, _ = plan_lengths(
        [chain(0.3)], base_tokens=1, base_committed=1.0, drafter_seconds=0.0, target_seconds=linear_cost(0.5)
    )
    assert lengths == [0] and goodput == pytest.approx(1.0)


def test_the_drafter_cost_alone_can_make_drafting_lose_to_plain():
    kwargs = dict(base_tokens=1, base_committed=1.0, target_seconds=linear_cost(0.02))
    plain = 1.0 / kwargs["target_seconds"](1)
    lengths, goodput, _ = plan_lengths([chain(0.2)], drafter_seconds=0.0, **kwargs)
    assert lengths == [2] and goodput > plain  # 1.24 tokens for 1.04 steps
    _, goodput, _ = plan_lengths([chain(0.2)], drafter_seconds=0.3, **kwargs)
    assert goodput < plain  # the same drafts no longer pay for a drafter forward


def test_the_whole_block_when_verification_is_free_and_acceptance_high():
    lengths, goodput, expected = plan_lengths(
        [chain(0.95)], base_tokens=1, base_committed=1.0, drafter_seconds=0.1, target_seconds=lambda n: 1.0
    )
    assert lengths == [BLOCK - 1]
    assert expected == pytest.approx(sum(chain(0.95))) and goodput == pytest.approx((1 + expected) / 1.1)


def test_the_choice_follows_the_measured_curve_jumps_included():
    # fp32 on a 2-core CPU: flat to 3 tokens, then a jump (design.md §9).
    curve = {1: 1.0, 2: 1.07, 3: 1.13, 4: 1.53, 5: 1.55, 8: 1.84, 16: 1.97}
    cost = CostModel.profile(curve)
    gains = [0.6, 0.3, 0.15, 0.08]
    lengths, _, _ = plan_lengths(
        [gains], base_tokens=1, base_committed=1.0, drafter_seconds=0.0, target_seconds=cost.target_curve()
    )
    assert lengths == [2]  # 3 tokens stay before the jump; a 3rd draft (0.15) cannot pay 0.40 more


def test_drafts_go_to_the_requests_whose_drafts_pay_and_stay_inside_the_token_budget():
    gains = [chain(0.9), chain(0.05), chain(0.6)]
    kwargs = dict(
        base_tokens=3, base_committed=3.0, drafter_seconds=0.0, target_seconds=linear_cost(0.05, 3.0)
    )
    lengths, _, _ = plan_lengths(gains, **kwargs)
    assert lengths[1] == 0 and lengths[0] > lengths[2] > 0
    # Water filling under a budget: the most likely drafts first, never more than the budget.
    budgeted, _, _ = plan_lengths(gains, budget=5, **kwargs)
    assert sum(budgeted) <= 5 and budgeted[1] == 0
    assert budgeted == [4, 0, 1]  # 0.9^1..0.9^4 = 0.9..0.66 beat 0.6 only after 0.9; 0.6^2 = 0.36 < 0.9^4


def test_gains_are_made_non_increasing_so_drafts_are_prefixes():
    lengths, _, _ = plan_lengths(
        [[0.1, 0.9, 0.9]],
        base_tokens=1,
        base_committed=1.0,
        drafter_seconds=0.0,
        target_seconds=lambda n: 1.0,
    )
    assert lengths == [3]  # every gain clipped to 0.1 still pays when verification is free


def test_each_request_gets_the_option_with_the_higher_goodput():
    block, lookup = chain(0.5), chain(0.9, 6)
    plan = plan_round(
        [[block, lookup], [block], [lookup]],
        base_tokens=3,
        base_committed=3.0,
        drafter_seconds=0.0,
        target_seconds=linear_cost(0.01, 3.0),
    )
    assert plan.sources == [1, 0, 0] and plan.lengths[0] == 6


def test_the_skip_gate_backs_off_while_the_average_surplus_is_below_the_drafters_cost():
    gate = SkipGate(max_skip=4, smoothing=0.5)
    assert gate.should_draft() and gate.probing  # the first drafted round is a probe
    pattern = []
    for surplus in (0.0, 0.0, 0.0, 0.0, 0.0, 3.0, 0.0):  # the drafter costs 0.5 tokens a round
        gate.record(surplus, cost=0.5)
        assert not gate.probing
        skipped = 0
        while not gate.should_draft():
            skipped += 1
        pattern.append(skipped)
        assert gate.probing == (skipped > 0)  # the round after skips is a probe
    # The optimistic start (0.5) halves per poor round: 0.25 skips 1, then 2, 4, 4 (max_skip), 4; one rich block
    # (3.0) lifts the average over the cost, and one poor round after it does not close the gate at once.
    assert pattern == [1, 2, 4, 4, 4, 0, 0]


def test_a_gate_that_backed_off_at_a_load_opens_again_once_the_load_has_halved():
    gate = SkipGate(max_skip=16, smoothing=0.5)
    assert gate.should_draft()
    for _ in range(4):  # judged beside 16 requests: losing, the skips double
        gate.record(0.0, cost=0.5, load=16)
        while not gate.should_draft():
            pass
    gate.record(0.0, cost=0.5, load=16)
    assert gate.backoff == 16 and gate.skip_left == 16 and gate.closed_at == 16
    gate.reopen(9)  # more than half the load: the skips stand
    assert gate.skip_left == 16 and not gate.should_draft()
    gate.reopen(
        8
    )  # half the load: drafting is worth something else now; probe at once, the average forgotten
    assert gate.skip_left == 0 and gate.backoff == 0 and gate.average_surplus is None
    assert gate.should_draft() and gate.probing
    gate.record(0.0, cost=0.5, load=8)
    assert gate.skip_left == 1 and gate.closed_at == 8  # judged again at its new load
    gate.reopen(8)
    assert gate.skip_left == 1  # not half of 8


def test_the_surplus_is_the_best_k_net_of_its_verify_time():
    gains = [0.8, 0.4, 0.1]
    verify = lambda k: 0.1 * k  # noqa: E731  seconds beyond the plain step; the plain step commits 2 tokens/s
    assert draft_surplus(gains, verify, rate=2.0) == pytest.approx(0.8 + 0.4 - 2.0 * 0.2)
    assert draft_surplus(gains, lambda k: 1.0, rate=2.0) == 0.0  # no k pays


# --------------------------------------------------------------------------------------------- the models
def test_the_cost_curve_interpolates_keeps_measured_drops_and_extrapolates_the_last_slope():
    cost = CostModel.profile({1: 1.0, 3: 1.2, 4: 1.1, 8: 2.0})
    curve = cost.target_curve()
    assert curve(2) == pytest.approx(1.1) and curve(4) == pytest.approx(
        1.1
    )  # 4 measured cheaper than 3: kept
    assert curve(12) == pytest.approx(2.0 + 4 * (2.0 - 1.1) / 4)
    assert cost.relative_curve() == {1: 1.0, 3: 1.2, 4: 1.1, 8: 2.0}


def test_a_cheaper_larger_verify_is_chosen_over_a_dearer_smaller_one():
    # Measured on a 2-core CPU without AMX: 2-3 rows take a slow fp32 path, 4-8 a fast GEMM.
    cost = CostModel.profile({1: 1.0, 2: 1.55, 3: 2.0, 4: 1.25, 8: 1.3})
    lengths, _, _ = plan_lengths(
        [[0.7, 0.35, 0.15]],
        base_tokens=1,
        base_committed=1.0,
        drafter_seconds=0.0,
        target_seconds=cost.target_curve(),
    )
    assert lengths == [3]  # 4 tokens for 1.25 beat 2 tokens for 1.55


def test_a_timing_spike_does_not_move_the_median_and_observations_learn():
    cost = CostModel()
    for seconds in (0.03, 0.031, 0.029, 0.9, 0.03):
        cost.observe_target(1, seconds)
    assert cost.target_seconds(1) == pytest.approx(0.03)
    assert cost.target_seconds(2) == pytest.approx(0.03)  # unmeasured: optimistic, so it gets measured
    for seconds in (0.05,) * 5:
        cost.observe_target(2, seconds)
    assert cost.target_seconds(2) == pytest.approx(0.05)


def test_a_load_gets_its_own_curve_once_it_has_two_sizes():
    cost = CostModel()
    cost.observe_target(4, 1.0, running=4)
    assert cost.target_seconds(4, running=4) == pytest.approx(1.0)  # the pooled table still answers
    cost.observe_target(1, 0.5, running=1)
    cost.observe_target(8, 3.0, running=4)
    assert cost.target_seconds(6, running=4) == pytest.approx(2.0)  # the 4-running table: 1.0 at 4, 3.0 at 8
    assert cost.target_seconds(1, running=1) == pytest.approx(0.5)


def _engine_steps(cost: CostModel, seconds, sizes, running: int = 1, prefill: int = 0) -> None:
    for n in sizes:
        cost.observe_step(n, prefill, running, seconds(n))


def test_the_engine_step_fit_prices_the_jump_from_a_one_token_step():
    # Measured on a 2-core CPU without AMX: a 1-token step runs matrix-vector kernels, 2+ tokens cost ~1.6x.
    def measured(n):
        return 0.03 if n == 1 else 0.045 + 0.001 * n

    cost = CostModel()
    _engine_steps(cost, measured, [1] * 20 + [4, 16, 64, 2, 3, 8])
    curve = cost.step_curve(running=1)
    assert curve(1) == pytest.approx(0.03, rel=0.02)
    assert curve(2) / curve(1) == pytest.approx(measured(2) / 0.03, rel=0.05)  # a line alone said ~1.03x
    assert curve(16) == pytest.approx(measured(16), rel=0.02)
    # One draft at acceptance 0.3 cannot pay for that jump: the plan verifies none.
    plan = plan_round(
        [[[0.3, 0.1]]], base_tokens=1, base_committed=1.0, drafter_seconds=0.0, target_seconds=curve
    )
    assert plan.lengths == [0]


def test_the_engine_step_fit_has_no_jump_where_steps_never_have_one_token():
    def measured(n):
        return 0.05 + 0.002 * n

    cost = CostModel()
    _engine_steps(cost, measured, [4, 5, 6, 8, 12, 4, 4, 5, 9, 16] * 2, running=4)
    curve = cost.step_curve(running=4)
    for n in (4, 6, 16):
        assert curve(n) == pytest.approx(measured(n), rel=0.02)


def test_the_engine_step_fit_of_a_tiled_target_prices_the_tile_one_draft_opens():
    # A prepared target's linears run in 16-row tiles: 16 requests' anchors fill one, a 17th row costs a second
    def measured(n):
        return 0.02 + 0.0002 * n + 0.025 * -(-n // 16)

    sizes = [16, 17, 18, 20, 24, 32, 33, 40, 48, 16, 16, 19, 22, 28, 36, 16]
    cost = CostModel()
    cost.tile_rows = 16
    _engine_steps(cost, measured, sizes, running=16)
    curve = cost.step_curve(running=16)
    assert curve(17) - curve(16) == pytest.approx(measured(17) - measured(16), rel=0.05)
    assert curve(32) == pytest.approx(measured(32), rel=0.02)
    # a line through the same steps spreads the jump over every row and prices the 17th row at a fraction of it
    line = CostModel()
    _engine_steps(line, measured, sizes, running=16)
    assert line.step_curve(running=16)(17) - line.step_curve(running=16)(16) < 0.5 * (
        measured(17) - measured(16)
    )


def test_the_row_tile_of_a_prepared_target_is_its_linears_tile(target_factory):
    from adaflash_hf import prepare_target
    from adaflash_hf.prepared.linear import _ROUTES, row_tile

    target = prepare_target(target_factory("llama"), dtype="bf16", rows=4)
    rows = {_ROUTES[m][2].rows for m in target.modules() if m in _ROUTES}  # every linear's tile (one here)
    assert len(rows) == 1 and row_tile(target) == rows.pop()
    assert row_tile(target_factory("llama")) == 0


def test_calibration_times_every_size_and_marks_the_model(target_factory):
    target = target_factory("llama")
    cost = CostModel()
    calibrate_target(target, cost, sizes=(1, 2, 4, 8), context=16, repeats=2, budget_s=0.0)
    assert cost.calibrated and sorted(cost.target[0]) == [1, 2, 4, 8]
    # one pass: a 1-token forward beside each size
    assert len(cost.target[0][1]) == 4 and len(cost.target[0][8]) == 1


def test_a_profile_learns_nothing():
    cost = CostModel.profile({1: 1.0, 2: 1.5}, drafter_seconds=0.1)
    cost.observe_target(2, 99.0)
    cost.observe_drafter(1, 99.0)
    assert cost.target_seconds(2) == 1.5 and cost.drafter_seconds(1) == 0.1


def test_the_acceptance_model_follows_realised_acceptance():
    model = AcceptanceModel()
    assert model.probability(0.9, 0.5, 1) == pytest.approx(
        0.9
    )  # the drafter's confidence at its word at first
    for _ in range(300):  # an overconfident drafter: its first draft is always rejected
        model.update([0.9, 0.9], head=0.5, verified=2, accepted=0)
    assert model.probability(0.9, 0.5, 1) < 0.2
    gains = model.gains([0.9, 0.9, 0.9], head=0.5)
    assert gains[0] > gains[1] > gains[2] > 0


def test_greedy_text_labels_every_proposal_verified_or_not():
    acceptance, lookups = AcceptanceModel(learning_rate=0.5), LookupModel()
    shadows = ShadowLabels(acceptance, lookups)
    shadows.add_block(3, [7, 8, 9], [0.5, 0.5, 0.5], head=0.5)  # drafts for positions 3, 4, 5
    shadows.add_lookup(3, LookupProposal(tokens=[7, 1], match_length=2, support=1.0))
    shadows.resolve([0, 0, 0, 7])  # position 3 agrees with both; nothing decided yet
    assert len(shadows.pending) == 2 and acceptance.updates == 0
    shadows.resolve([0, 0, 0, 7, 8])  # the lookup's 1 was wrong: 1 accepted of 2
    assert len(shadows.pending) == 1
    assert lookups.counts[2][:3] == [[1, 1], [0, 1], [0, 0]]  # token 1 accepted; token 2, once tried, was not
    shadows.resolve([0, 0, 0, 7, 8, 2])  # the block's 9 was wrong: drafts 1, 2 accepted, 3 rejected
    assert acceptance.updates == 3 and not shadows.pending
    assert acceptance.probability(0.5, 0.5, 1) > 0.5 > acceptance.probability(0.5, 0.5, 3)


def test_lookup_continuations_are_valued_as_bursts_by_match_length():
    model = LookupModel(strength=1.0)
    long_match = LookupProposal(tokens=list(range(12)), match_length=6, support=1.0)
    short_match = LookupProposal(tokens=list(range(12)), match_length=1, support=1.0)
    for _ in range(50):  # repeated text: wrong at once, or right all the way
        model.observe(6, 12, 12)
        model.observe(6, 12, 0)
        model.observe(1, 12, 0)
    rates = model.rates(long_match)
    assert rates[0] == pytest.approx(0.5, abs=0.02) and min(rates[1:]) > 0.98
    assert sum(model.gains(long_match)) > 5  # a single per-token rate (12/13) would also say ~5.5 but only
    assert model.gains(short_match)[0] < 0.05  # one-token matches here never hold


def test_lookup_continuations_that_stop_early_or_run_long_are_valued_at_what_they_deliver():
    # Half the continuations are wrong at their second token, half right for all twelve: 6.5 accepted tokens
    # expected from a fresh one. One rate pooled over tokens 2..12 (11 accepted of 12 tried) would expect
    # 1 + 11/12 + (11/12)^2 + ... + (11/12)^11 = 7.8; a rate per position says what the continuations deliver.
    model = LookupModel(strength=1.0)
    proposal = LookupProposal(tokens=list(range(12)), match_length=4, support=1.0)
    for _ in range(200):
        model.observe(4, 12, 1)
        model.observe(4, 12, 12)
    assert sum(model.gains(proposal)) == pytest.approx(6.5, abs=0.1)
    rates = model.rates(proposal)
    assert (
        rates[1] == pytest.approx(0.5, abs=0.01) and min(rates[2:]) > 0.99
    )  # past the second token, all held


def test_a_requests_lookup_model_starts_from_its_parent_and_teaches_it():
    shared = LookupModel(strength=2.0)
    proposal = LookupProposal(tokens=[1, 2, 3], match_length=3, support=0.5)
    for _ in range(40):
        shared.observe(3, 3, 3)
    request = LookupModel(parent=shared)
    assert request.rates(proposal) == pytest.approx(shared.rates(proposal))  # no data of its own yet
    request.observe(3, 3, 0)
    assert shared.counts[3][0][1] == 41 and request.counts[3][0][1] == 1
    assert request.rates(proposal)[0] < shared.rates(proposal)[0]
    assert request.rates(proposal)[1:] == pytest.approx(shared.rates(proposal)[1:])  # token 2 was never tried


def test_the_acceptance_model_learns_the_heads_signal():
    model = AcceptanceModel()
    for _ in range(400):  # confidence says nothing; the head's â does
        model.update([0.5], head=0.9, verified=1, accepted=1)
        model.update([0.5], head=0.1, verified=1, accepted=0)
    assert model.probability(0.5, 0.9, 1) > 0.8 > 0.2 > model.probability(0.5, 0.1, 1)


# ----------------------------------------------------------------------------------------------- settings
@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            {"length_mode": "fast"},
            r"^length_mode: expected one of \('auto', 'adaptive', 'fixed', 'goodput'\), got 'fast'",
        ),
        ({"gamma": True}, r"^gamma: expected a number > 0, got True"),
        ({"min_len": True}, r"^min_len: expected an int >= 0, got True"),
        ({"max_skip": 0}, r"^max_skip: expected an int >= 1, got 0"),
        ({"calibrate": "yes"}, r"^calibrate: expected True or False, got 'yes'"),
        (
            {"lookup_history_tokens": 64, "draft_source": "diffusion"},
            r"^lookup_history_tokens: expected None, or an int >= 1 with draft_source 'hybrid' or 'auto' "
            r"\(draft_source is 'diffusion'\), got 64",
        ),
    ],
)
def test_bad_settings_name_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DraftingSettings(**kwargs)


def test_generate_knobs_are_the_settings_fields():
    config = GenerationConfig(adaflash_length_mode="goodput", adaflash_max_skip=4)
    settings = DraftingSettings.from_generation_config(config)
    assert (settings.length_mode, settings.max_skip, settings.gamma) == ("goodput", 4, None)
    with pytest.raises(
        ValueError, match=r"^generation_config\.adaflash_max_skip: expected an int >= 1, got -1"
    ):
        DraftingSettings.from_generation_config(GenerationConfig(adaflash_max_skip=-1))


def test_bad_goodput_settings_fail_before_any_forward(target_factory, drafter_factory):
    target = target_factory("qwen3")
    drafter = drafter_factory(target)
    calls = []
    for model in (target, drafter):
        model.register_forward_pre_hook(lambda *_: calls.append(1))
    with pytest.raises(ValueError, match=r"^generation_config\.adaflash_calibrate: expected True or False"):
        target.generate(torch.tensor([[1, 2, 3]]), assistant_model=drafter, adaflash_calibrate="no")
    with pytest.raises(
        ValueError, match=r"^length_mode: expected 'fixed', 'auto' or unset with mode='dflash'"
    ):
        AdaFlashEngine(target, drafter, mode="dflash", length_mode="goodput")
    with pytest.raises(ValueError, match=r"^drafting: expected a DraftingSettings or its fields .*got both"):
        AdaFlashEngine(target, drafter, drafting=DraftingSettings(), gamma=1.0)
    assert not calls


# ------------------------------------------------------------------------------------------ lossless runs
def greedy(target, prompt, tokens, **kwargs):
    """Greedy ``generate``; with an assistant, its blocks alone (these tests are about the drafter's goodput)."""
    if "assistant_model" in kwargs:
        kwargs.setdefault("adaflash_draft_source", "diffusion")
    return target.generate(prompt, max_new_tokens=tokens, do_sample=False, **kwargs)


@pytest.fixture
def fresh_target(target_factory):
    return target_factory("llama", seed=3)


def test_goodput_generate_equals_greedy_across_k0_rounds_and_skipped_forwards(fresh_target, oracle_factory):
    target = fresh_target
    prompt = torch.randint(0, 500, (1, 9), generator=torch.Generator().manual_seed(0))
    reference = greedy(target, prompt, 60)
    drafter = oracle_factory(target, reference, seed=2)
    # Verification costs 10% a token and the drafter 5% of a step: a block pays only where it is accepted.
    use_cost_model(target, "generate", CostModel.profile({1: 1.0, 16: 2.5}, drafter_seconds=0.05))
    out = greedy(target, prompt, 60, assistant_model=drafter, adaflash_length_mode="goodput")
    assert torch.equal(out, reference)
    stats = drafter.last_stats
    assert stats.zero_length_rounds > 0 and stats.skipped_drafter_forwards > 0
    assert sum(stats.verify_lengths) > 0 and sum(stats.accepted_lengths) > 0
    assert (
        "k0_rounds=" in stats.summary() and stats.to_dict()["zero_length_rounds"] == stats.zero_length_rounds
    )


def test_goodput_drafts_nothing_where_drafts_cannot_pay(fresh_target, drafter_factory):
    target = fresh_target
    drafter = drafter_factory(target)
    use_cost_model(target, "generate", CostModel.profile({1: 1.0, 2: 3.0}, drafter_seconds=0.5))
    prompt = torch.randint(0, 500, (1, 7), generator=torch.Generator().manual_seed(1))
    out = greedy(
        target, prompt, 40, assistant_model=drafter, adaflash_length_mode="goodput", adaflash_max_skip=8
    )
    assert torch.equal(out, greedy(target, prompt, 40))
    stats = drafter.last_stats
    probes = stats.drafting_rounds - stats.skipped_drafter_forwards
    assert sum(stats.verify_lengths) == 0 and probes > 0  # greedy probes learn from the committed text alone
    assert (
        probes <= 4 + stats.drafting_rounds // 9
    )  # backs off (1, 2, 4, 8) to a probe every max_skip + 1 = 9


def records_by_context(records):
    return {r.context_length: r.drafted_tokens for r in records if r.source == "diffusion"}


def test_the_block_after_skipped_forwards_equals_the_block_without_skipping(fresh_target, drafter_factory):
    target = fresh_target
    drafter = drafter_factory(target)
    prompt = torch.randint(0, 500, (1, 11), generator=torch.Generator().manual_seed(2))
    plain_records, skip_records = [], []
    drafter.round_recorder = plain_records.append
    greedy(target, prompt, 40, assistant_model=drafter, adaflash_length_mode="fixed")
    use_cost_model(target, "generate", CostModel.profile({1: 1.0, 2: 3.0}, drafter_seconds=0.5))
    drafter.round_recorder = skip_records.append
    greedy(target, prompt, 40, assistant_model=drafter, adaflash_length_mode="goodput", adaflash_max_skip=4)
    drafter.round_recorder = None
    unskipped, after_skips = records_by_context(plain_records), records_by_context(skip_records)
    probes = sorted(after_skips)
    assert len(probes) >= 3 and max(b - a for a, b in zip(probes, probes[1:])) > 1  # gaps: skipped forwards
    for context_length in probes:
        assert after_skips[context_length] == unskipped[context_length], context_length


def test_goodput_engine_equals_greedy_and_reports_k0_and_skips(fresh_target, drafter_factory):
    target = fresh_target
    drafter = drafter_factory(target)
    use_cost_model(target, "engine", CostModel.profile({1: 1.0, 4: 1.1, 64: 3.0}, drafter_seconds=0.05))
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 500, (n,), generator=g) for n in (5, 12, 3, 8)]
    expected = [greedy(target, p[None], 16)[0, len(p) :].tolist() for p in prompts]
    engine = AdaFlashEngine(target, drafter, length_mode="goodput", draft_source="diffusion")
    assert engine.generate(prompts, SamplingParams(max_new_tokens=16)) == expected
    assert sum(s.zero_length_verifies for s in engine.stats) > 0
    assert sum(s.skipped_drafter for s in engine.stats) > 0
    # Hybrid: a random target's greedy text loops, so lookup continuations take over; still lossless.
    hybrid = AdaFlashEngine(target, drafter, length_mode="goodput", draft_source="hybrid")
    assert hybrid.generate(prompts, SamplingParams(max_new_tokens=16)) == expected
    assert sum(s.lookup_verifies for s in hybrid.stats) > 0


def test_the_engines_block_after_skipped_forwards_equals_the_block_without_skipping(
    fresh_target, drafter_factory
):
    target = fresh_target
    drafter = drafter_factory(target)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 500, (n,), generator=g) for n in (6, 10, 4)]
    use_cost_model(target, "engine", CostModel.profile({1: 1.0, 2: 3.0, 8: 9.0}, drafter_seconds=0.5))
    runs = {}
    for length_mode in ("fixed", "goodput"):
        engine = AdaFlashEngine(
            target,
            drafter,
            drafting=DraftingSettings(length_mode=length_mode, max_skip=4, draft_source="diffusion"),
        )
        engine.record_full_drafts = True
        records = []
        engine.round_recorder = lambda request, record, records=records: records.append(
            (request.prompt, record)
        )
        engine.generate(prompts, SamplingParams(max_new_tokens=24))
        runs[length_mode] = {
            (tuple(p), r.context_length): r.drafted_tokens
            for p, r in records
            if len(r.drafted_tokens) == BLOCK - 1
        }
    probes = runs["goodput"]
    assert len(probes) >= 6
    for key, drafted in probes.items():
        assert drafted == runs["fixed"][key], key


def _gated_engine(target, drafter_factory) -> AdaFlashEngine:
    """A goodput engine whose cost model prices a plain 4-request step at 0.1 s (a profile: it learns nothing)."""
    use_cost_model(target, "engine", CostModel.profile({1: 0.1, 4: 0.1, 16: 0.2}, drafter_seconds=0.01))
    return AdaFlashEngine(
        target, drafter_factory(target), drafting=DraftingSettings(length_mode="goodput", max_skip=4)
    )


def judge(policy, drafted, committed, running, seconds, target, verified=0):
    """One decode step of ``running`` requests (no prefill), judged whole by the goodput policy."""
    policy.judge_step(drafted, committed, running, Step(running), seconds, target, verified)


def test_the_batch_skips_the_drafter_while_whole_drafted_steps_lose_to_plain(fresh_target, drafter_factory):
    # Wall time the plan does not price (a drafter's fixed cost, bookkeeping) shows in whole steps: judged here with
    # injected step timings against a profiled plain step of 0.1 s (+ 0.01 s measured outside the target).
    engine = _gated_engine(fresh_target, drafter_factory)
    policy = engine.policies["goodput"]
    judge(policy, False, 4, 4, seconds=0.11, target=0.1)
    # Drafted steps committing 6 tokens in 0.11 s: ahead of plain's 4; the batch keeps drafting.
    for _ in range(3):
        judge(policy, True, 6, 4, seconds=0.11, target=0.1)
    assert policy.batch_gate.skip_left == 0 and policy.batch_gate.should_draft()
    # 6 tokens in 0.22 s lose to plain's 8 in that time: the average turns negative and the batch backs off.
    for _ in range(3):
        judge(policy, True, 6, 4, seconds=0.22, target=0.1)
    assert policy.batch_gate.skip_left > 0
    skipped = policy.batch_gate.skip_left
    # served beside 3 requests (more than half the 4 it was judged beside: the skips stand)
    prompts = [torch.randint(0, 500, (n,), generator=torch.Generator().manual_seed(n)) for n in (5, 9, 13)]
    for prompt in prompts:
        engine.add_request(prompt, SamplingParams(max_new_tokens=8))
    engine.step()  # prefill
    engine.step()
    assert engine.stats[-1].skipped_drafter == engine.stats[-1].verifies == 3
    assert policy.batch_gate.skip_left == skipped - 1


def test_a_batch_gate_closed_beside_4_requests_opens_again_beside_2(fresh_target, drafter_factory):
    engine = _gated_engine(fresh_target, drafter_factory)
    policy = engine.policies["goodput"]
    judge(policy, False, 4, 4, seconds=0.11, target=0.1)
    for _ in range(6):  # beside 4 requests drafted steps lose: the batch backs off
        judge(policy, True, 6, 4, seconds=0.22, target=0.1)
    assert policy.batch_gate.skip_left > 0 and policy.batch_gate.closed_at == 4
    for n in (5, 9):
        engine.add_request(
            torch.randint(0, 500, (n,), generator=torch.Generator().manual_seed(n)),
            SamplingParams(max_new_tokens=8),
        )
    engine.step()  # prefill
    engine.step()
    assert (
        engine.stats[-1].skipped_drafter == 0 and engine.stats[-1].verifies == 2
    )  # the drafter ran for both
    assert policy.batch_gate.skip_left == 0


def test_the_batch_gate_judges_against_measured_plain_steps_once_it_has_them(fresh_target, drafter_factory):
    # The profile prices a plain step at 0.1 s, but measured plain steps take 0.3 s: a drafted step committing 6
    # tokens in 0.4 s loses to the profile (8 tokens) and wins against the measured steps (5.3 tokens).
    engine = _gated_engine(fresh_target, drafter_factory)
    policy = engine.policies["goodput"]
    for _ in range(3):
        judge(policy, True, 6, 4, seconds=0.4, target=0.1)
    assert policy.batch_gate.skip_left > 0  # judged by the profile: losing
    policy.batch_gate = SkipGate(max_skip=4)
    for _ in range(3):
        # Lookup-only steps (no drafter, 8 lookup drafts verified) are no plain steps: not measured as such.
        judge(policy, False, 7, 4, seconds=0.9, target=0.8, verified=8)
    assert not engine.cost.plain_steps
    for _ in range(3):
        judge(policy, False, 4, 4, seconds=0.3, target=0.1)
    for _ in range(3):
        judge(policy, True, 6, 4, seconds=0.4, target=0.1)
    assert policy.batch_gate.skip_left == 0 and policy.batch_gate.average_surplus > 0


def _row_priced_engine_policy() -> GoodputPolicy:
    """An engine's goodput policy whose step fit prices every row 1 ms beyond a 16-request decode step's 30 ms, verify
    and prefill rows alike (a CPU forward made compute-bound by a prefill)."""
    cost = CostModel()
    for verify, prefill in [(16, 0), (32, 0), (48, 0), (16, 100), (16, 200), (16, 300)] * 3:
        cost.observe_step(verify, prefill, 16, 0.030 + 0.001 * (verify + prefill - 16))
    assert cost.has_step_fit()
    settings = DraftingSettings(length_mode="goodput", calibrate=False)
    return GoodputPolicy(settings, BLOCK, cost, AcceptanceModel(), kind="engine")


def test_drafts_beside_a_prefill_must_beat_what_decode_steps_commit_in_their_seconds():
    policy = _row_priced_engine_policy()
    base = {"base_tokens": 16, "base_committed": 16.0, "drafter_seconds": 0.0}
    prefill_curve = policy.cost.step_curve(16, 136)
    # Half-likely drafts: 0.5 tokens a ms. Against the prefill step's own 16 tokens in 166 ms they look worth taking.
    even = [[[0.5, 0.25, 0.125]]] * 16
    assert sum(plan_round(even, target_seconds=prefill_curve, **base).lengths) > 0
    # The prefill is paid either way; the drafts' seconds beside it could decode 16 tokens per 30 ms instead.
    curve = policy._beside_prefill(prefill_curve, Step(16, prefill_tokens=136), 16)
    assert curve(16) == pytest.approx(0.030) and curve(20) == pytest.approx(0.034)
    assert sum(plan_round(even, target_seconds=curve, **base).lengths) == 0
    likely = [[[0.95, 0.9, 0.85]]] * 16  # drafts that beat decode steps are still taken beside a prefill
    assert sum(plan_round(likely, target_seconds=curve, **base).lengths) > 0
    decode_curve = policy.cost.step_curve(16)  # a step without prefill is planned on its own curve
    assert policy._beside_prefill(decode_curve, Step(16), 16) is decode_curve


def test_a_drafted_prefill_step_is_judged_by_what_decode_steps_commit_in_its_extra_seconds():
    policy = _row_priced_engine_policy()
    prefill_step = Step(16, prefill_tokens=136)
    # plain: this step in 166 ms; drafted: 8 more tokens in 20 ms more, which decode steps fill with 10.7 tokens
    policy.judge_step(True, 24, 16, prefill_step, seconds=0.186, target_seconds=0.186, verified=8)
    gate = (
        policy.batch_gate
    )  # its average starts at max(surplus, 0) and moves by `smoothing` toward the surplus
    assert gate.average_surplus == pytest.approx(gate.smoothing * (8 - 0.020 * 16 / 0.030))  # -2.7 tokens
    # (judged by the prefill step's own rate, 16 tokens per 166 ms, the same step would gain 6.1 tokens)
    # in a decode step it is what plain decoding commits in the step's seconds: 24 tokens in 40 ms against 21.3
    policy.batch_gate = SkipGate(max_skip=4)
    policy.judge_step(True, 24, 16, Step(16), seconds=0.040, target_seconds=0.040, verified=8)
    assert policy.batch_gate.average_surplus == pytest.approx(24 - 16 * 0.040 / 0.030)


def test_a_request_out_of_slack_caps_what_the_batchs_drafts_may_add_to_its_step():
    # 16 requests on a step that costs 1 ms a verify row beyond 30 ms; 15 have drafts worth taking, one has none.
    curve = _row_priced_engine_policy().cost.step_curve(16)
    likely = [[[0.95, 0.9, 0.85]]] * 15 + [[]]
    base = {"base_tokens": 16, "base_committed": 16.0, "drafter_seconds": 0.0, "target_seconds": curve}
    free = plan_round(likely, **base)
    assert sum(free.lengths) == 45
    assert plan_round(likely, slack=[float("inf")] * 16, **base).lengths == free.lengths
    # the last request may lose 2.5 ms more: 2 rows, not 45 (its own tokens are no more than a plain step's)
    capped = plan_round(likely, slack=[float("inf")] * 15 + [0.0025], **base)
    assert sum(capped.lengths) == 2 and capped.lengths[-1] == 0
    assert sum(plan_round(likely, slack=[1.0] * 15 + [-0.001], **base).lengths) == 0
    # a request's own accepted drafts each save it a plain step: its drafts widen its room
    own = plan_round([[[0.95, 0.9, 0.85]]] * 16, slack=[0.0] * 16, **base)
    assert sum(own.lengths) == 48


def _engine_slots(policy: GoodputPolicy, count: int) -> list[Slot]:
    return [Slot(policy.new_state(LookupModel(), greedy=True), BLOCK - 1, None, 10) for _ in range(count)]


def test_a_requests_slack_gains_the_tolerance_on_plain_steps_and_pays_what_the_batchs_drafts_cost_it():
    policy = _row_priced_engine_policy()
    slots = _engine_slots(policy, 2)
    round_ = Round(tuple(slots), Step(16), (True, True), curve=policy.cost.step_curve(16))
    plain = policy.cost.plain_step_seconds(16)
    assert plain == pytest.approx(0.030)
    tolerance = policy.settings.max_slowdown
    assert tolerance == 0.03  # the default
    policy.settle(
        round_, [1, 1], Step(16), seconds=plain
    )  # a plain step: one plain step of slack to start, plus δ
    assert [s.state.slack for s in slots] == pytest.approx([plain * (1 + tolerance)] * 2)
    # a drafted step of 45 ms: the first request got its one token (15 ms lost), the second 3 (a plain step's 90)
    policy.settle(round_, [1, 3], Step(16), seconds=0.045)
    lost = plain * (1 + tolerance) - 0.045
    gained = 3 * plain * (1 + tolerance) - 0.045
    assert slots[0].state.slack == pytest.approx(plain * (1 + tolerance) + lost)
    assert slots[1].state.slack == pytest.approx(plain * (1 + tolerance) + gained)
    before = [s.state.slack for s in slots]
    policy.settle(
        round_, [1, 1], Step(16, prefill_tokens=100), seconds=0.3
    )  # steps with prefill do not count
    assert [s.state.slack for s in slots] == before


def test_without_a_slowdown_bound_no_request_keeps_slack():
    cost = _row_priced_engine_policy().cost
    settings = DraftingSettings(length_mode="goodput", calibrate=False, max_slowdown=None)
    policy = GoodputPolicy(settings, BLOCK, cost, AcceptanceModel(), kind="engine")
    slots = _engine_slots(policy, 2)
    policy.settle(
        Round(tuple(slots), Step(16), (True, True), curve=cost.step_curve(16)), [1, 1], Step(16), 0.5
    )
    assert [s.state.slack for s in slots] == [None, None]
    for bad in (-0.1, 1.5, "3%", True):
        with pytest.raises(ValueError, match=r"^max_slowdown: expected None or a number in \[0, 1\], got"):
            DraftingSettings(max_slowdown=bad)
    with pytest.raises(
        ValueError, match=r"^generation_config\.adaflash_max_slowdown: expected None or a number"
    ):
        DraftingSettings.from_generation_config(GenerationConfig(adaflash_max_slowdown=2))


def test_the_drafter_sits_out_a_step_its_forward_would_take_a_request_past_its_slack():
    policy = _row_priced_engine_policy()
    policy.cost.observe_drafter(16, 0.010)
    slots = _engine_slots(policy, 16)
    assert all(policy.start(slots, Step(16)).drafts)  # no slack known yet: every request drafts
    for slot in slots:
        slot.state.slack = 0.020
    assert all(policy.start(slots, Step(16)).drafts)
    slots[3].state.slack = 0.005  # 5 ms left to lose, a 10 ms drafter forward
    assert not any(policy.start(slots, Step(16)).drafts)
    slots[3].state.last_gains = [0.9, 0.8]  # unless its own last block would save it what the forward costs
    assert all(policy.start(slots, Step(16)).drafts)


def test_an_engine_drafts_at_most_a_tile_a_step_until_its_step_fit_exists():
    settings = DraftingSettings(length_mode="goodput", calibrate=False)
    cold = GoodputPolicy(settings, BLOCK, CostModel(), AcceptanceModel(), kind="engine")
    assert not cold.cost.has_step_fit()
    assert cold._cold_budget(None) == COLD_DRAFTS
    assert cold._cold_budget(5) == 5
    cold.cost.tile_rows = 4
    assert cold._cold_budget(None) == 4
    assert _row_priced_engine_policy()._cold_budget(None) is None  # the fit answers: no cap
    profiled = GoodputPolicy(
        settings, BLOCK, CostModel.profile({1: 0.1, 16: 0.2}), AcceptanceModel(), kind="engine"
    )
    assert profiled._cold_budget(None) is None  # a profile is the user's word on the costs
    generate = GoodputPolicy(settings, BLOCK, CostModel(fit_steps=False), AcceptanceModel(), kind="generate")
    assert generate._cold_budget(None) is None  # generate plans on measured per-size medians


def test_a_running_count_without_plain_steps_is_judged_by_the_nearest_measured_count(
    fresh_target, drafter_factory
):
    # Plain steps measured at 4 running requests take 0.3 s (0.3 s inside the target: no overhead), the profile says
    # 0.1 s and prices 3 and 4 requests alike. At 3 requests a drafted step committing 5 tokens in 0.4 s loses to the
    # profile (12 tokens in that time) and wins against the measured count's step scaled to 3 requests (4 tokens).
    engine = _gated_engine(fresh_target, drafter_factory)
    policy, cost = engine.policies["goodput"], engine.cost
    for _ in range(3):
        judge(policy, False, 4, 4, seconds=0.3, target=0.3)
    assert cost.plain_step_seconds(3) == pytest.approx(0.3) and cost.plain_step_seconds(4) == 0.3
    for _ in range(3):
        judge(policy, True, 5, 3, seconds=0.4, target=0.1)
    assert policy.batch_gate.skip_left == 0 and policy.batch_gate.average_surplus > 0
    cost.plain_steps.clear()
    assert cost.plain_step_seconds(3) == pytest.approx(
        0.1
    )  # the profile's step, no overhead measured outside it
    for _ in range(3):
        judge(policy, True, 5, 3, seconds=0.4, target=0.1)
    assert policy.batch_gate.skip_left > 0  # the profile's word: losing


def test_the_default_auto_mode_is_goodput_under_greedy_and_adaptive_under_sampling(
    fresh_target, drafter_factory
):
    # On a profile where no draft pays, goodput verifies nothing; the adaptive rule drafts whatever the profile says.
    target = fresh_target
    drafter = drafter_factory(target)
    use_cost_model(target, "generate", CostModel.profile({1: 1.0, 2: 3.0}, drafter_seconds=0.5))
    prompt = torch.randint(0, 500, (1, 7), generator=torch.Generator().manual_seed(2))
    assert DraftingSettings().length_mode == "auto"
    assert torch.equal(greedy(target, prompt, 24, assistant_model=drafter), greedy(target, prompt, 24))
    assert drafter.last_stats.drafting_rounds > 0 and sum(drafter.last_stats.verify_lengths) == 0
    sampled = {}
    for knobs in ({}, {"adaflash_length_mode": "adaptive"}):
        torch.manual_seed(5)
        out = target.generate(prompt, max_new_tokens=24, do_sample=True, assistant_model=drafter, **knobs)
        sampled[bool(knobs)] = out, drafter.last_stats.verify_lengths
    assert torch.equal(sampled[False][0], sampled[True][0]) and sampled[False][1] == sampled[True][1]
    assert sum(sampled[False][1]) > 0


def test_the_engine_in_auto_mode_drafts_by_goodput_only_in_steps_where_no_request_samples(
    fresh_target, drafter_factory
):
    target = fresh_target
    use_cost_model(target, "engine", CostModel.profile({1: 1.0, 2: 3.0, 8: 9.0}, drafter_seconds=0.5))
    engine = AdaFlashEngine(target, drafter_factory(target), draft_source="diffusion")
    assert engine.settings.length_mode == "auto"
    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(0, 500, (n,), generator=g) for n in (6, 9)]
    expected = engine.generate(prompts, SamplingParams(max_new_tokens=12))
    assert sum(s.draft_tokens for s in engine.stats) == 0  # greedy only: goodput, and no draft pays here
    before = engine.step_count
    greedy_id = engine.add_request(prompts[0], SamplingParams(max_new_tokens=12))
    engine.add_request(prompts[1], SamplingParams(max_new_tokens=12, temperature=1.0, seed=3))
    finished = finished_requests(engine.stream())
    steps = list(engine.stats)[before - engine.step_count :]
    assert sum(s.draft_tokens for s in steps) > 0  # a sampling request: the adaptive rule
    assert finished[greedy_id].output == expected[0]


@pytest.mark.parametrize(
    ("target_seconds", "drafter_seconds", "match"),
    [
        (
            {},
            0.0,
            r"^target_seconds: expected a dict of tokens -> seconds including 1 \(the plain step\), got \[\]",
        ),
        ({4: 1.0, 8: 1.2}, 0.0, r"^target_seconds: expected .* including 1 .*got \[4, 8\]"),
        ({1: 1.0, "16": 1.5}, 0.0, r"^target_seconds: expected int token counts >= 1 as keys, got '16'"),
        ({1: 1.0, 0: 1.0}, 0.0, r"^target_seconds: expected int token counts >= 1 as keys, got 0"),
        ({1: -1.0, 4: 1.0}, 0.0, r"^target_seconds\[1\]: expected finite seconds > 0, got -1.0"),
        ({1: 1.0, 4: float("nan")}, 0.0, r"^target_seconds\[4\]: expected finite seconds > 0, got nan"),
        (
            {1: 1.0, 16: 0.5},
            0.0,
            r"^target_seconds\[16\]: expected >= 0.8 x target_seconds\[1\] = 0.8 .*got 0.5",
        ),
        ({1: 1.0, 4: 1.1}, -0.1, r"^drafter_seconds: expected finite seconds >= 0, got -0.1"),
    ],
)
def test_a_profile_that_prices_no_plain_step_or_no_real_forward_is_refused(
    target_seconds, drafter_seconds, match
):
    with pytest.raises(ValueError, match=match):
        CostModel.profile(target_seconds, drafter_seconds=drafter_seconds)


def test_a_flat_verify_curve_makes_goodput_verify_longer_drafts(target_factory, oracle_factory):
    # bf16 on a CPU with bf16 dot products: a 16-token verify costs about a 1-token step; fp32 on AVX2: 2-3x.
    flat = {1: 1.0, 2: 1.05, 4: 1.06, 8: 1.04, 16: 1.4}
    steep = {1: 1.0, 2: 1.7, 4: 1.5, 8: 1.8, 16: 2.2}
    lengths = {}
    for name, curve in (("flat", flat), ("steep", steep)):
        target = target_factory("llama", seed=3)
        prompt = torch.randint(0, 500, (1, 10), generator=torch.Generator().manual_seed(7))
        reference = greedy(target, prompt, 48)
        drafter = oracle_factory(target, reference, seed=2)
        use_cost_model(target, "generate", CostModel.profile(curve, drafter_seconds=0.2))
        knobs = {"adaflash_length_mode": "goodput", "adaflash_draft_source": "diffusion"}
        assert torch.equal(greedy(target, prompt, 48, assistant_model=drafter, **knobs), reference)
        verified = [n for n in drafter.last_stats.verify_lengths if n]
        lengths[name] = sum(verified) / len(verified)
    assert lengths["flat"] > lengths["steep"] + 1
