"""The drafting policy's seam: ``start`` hands back a frozen round, ``choose`` takes it and returns every length
(the adaptive rule's k̂ included) inside the step's budget, and a goodput policy calibrates once, at its first round.
The callers (``generate``, the engine) only run forwards around these calls."""

from __future__ import annotations

import dataclasses
import functools
from types import SimpleNamespace

import pytest

import adaflash_hf.policy
from adaflash_hf.acceptance import AcceptanceModel, LookupModel
from adaflash_hf.cost_model import CostModel
from adaflash_hf.drafting import CONFIDENCE_ROWS, DraftingSettings
from adaflash_hf.modeling import AdaFlashDrafter
from adaflash_hf.policy import (
    PLAIN,
    Block,
    GoodputPolicy,
    PlainPolicy,
    RulePolicy,
    Slot,
    Step,
    fit_budget,
)

BLOCK = 16
SETTINGS = DraftingSettings(draft_source="diffusion", gamma=1.0, min_len=1)
# The drafter's own rule (k̂ = clamp(floor(γ·â·(B-1)), min_len, B-1)), on a config alone.
LENGTH_RULE = functools.partial(
    AdaFlashDrafter.predict_draft_length,
    SimpleNamespace(config=SimpleNamespace(block_size=BLOCK, length_head_gamma=1.0, length_head_min_len=1)),
)
FLAT = {1: 0.010, 2: 0.0101, 4: 0.0102, 8: 0.0104, 16: 0.0108, 64: 0.02}


def rule_policy(fixed: bool = False) -> RulePolicy:
    return RulePolicy(SETTINGS, BLOCK, fixed=fixed, length_rule=LENGTH_RULE)


def goodput_policy(cost: CostModel | None = None, settings: DraftingSettings = SETTINGS, kind="generate"):
    cost = cost or CostModel.profile(FLAT, drafter_seconds=0.001)
    return GoodputPolicy(settings, BLOCK, cost, AcceptanceModel(), kind, target=object())


def slots(policy, count: int, room: int = BLOCK - 1) -> list[Slot]:
    return [Slot(policy.new_state(LookupModel(), greedy=False), room, None, 10) for _ in range(count)]


def confident_block(head: float = 0.9) -> Block:
    return Block(head, True, (0.99,) * (BLOCK - 1), (7,) * (BLOCK - 1))


def test_start_returns_a_frozen_round():
    policy = rule_policy()
    round_ = policy.start(slots(policy, 2), Step(running=2))
    with pytest.raises(dataclasses.FrozenInstanceError):
        round_.drafts = (False, False)


def test_choose_answers_for_the_round_it_is_given_whatever_started_since():
    policy = goodput_policy()
    first = policy.start(slots(policy, 1), Step(running=1))
    second = policy.start(slots(policy, 3), Step(running=3))
    assert len(policy.choose(first, [confident_block()])) == 1
    assert len(policy.choose(second, [confident_block()] * 3)) == 3


def test_the_adaptive_rule_takes_its_length_from_the_blocks_head():
    policy = rule_policy()
    round_ = policy.start(slots(policy, 2), Step(running=2))
    choices = policy.choose(round_, [Block(0.5, True), Block(0.9, True)])
    assert [c.length for c in choices] == [7, 13]  # floor(â · 15)


def test_the_adaptive_rule_uses_the_gamma_the_step_hands_it():
    policy = rule_policy()
    round_ = policy.start(slots(policy, 1), Step(running=1, gamma=0.5))
    assert policy.choose(round_, [Block(0.5, True)])[0].length == 3  # floor(0.5 · 0.5 · 15)


def test_the_fixed_rule_verifies_the_whole_block_within_the_room():
    policy = rule_policy(fixed=True)
    round_ = policy.start(slots(policy, 1, room=9), Step(running=1))
    assert policy.choose(round_, [Block(0.1, True)])[0].length == 9


def test_a_non_finite_block_verifies_no_drafts():
    policy = rule_policy()
    round_ = policy.start(slots(policy, 1), Step(running=1))
    choice = policy.choose(round_, [Block(0.0, False)])[0]
    assert (choice.source, choice.length, choice.drafter_ran) == ("diffusion", 0, True)


def test_rule_lengths_fit_the_steps_budget_longest_first():
    policy = rule_policy()
    round_ = policy.start(slots(policy, 3), Step(running=3, budget=3 + 11))
    choices = policy.choose(round_, [Block(0.9, True), Block(0.2, True), Block(0.9, True)])
    assert [c.length for c in choices] == [4, 3, 4]  # k̂ = 13, 3, 13


def test_goodput_lengths_fit_the_steps_budget():
    policy = goodput_policy()
    round_ = policy.start(slots(policy, 2), Step(running=2, budget=2 + 6))
    assert all(round_.drafts)
    choices = policy.choose(round_, [confident_block(), confident_block()])
    assert sum(c.length for c in choices) == 6


def test_a_step_with_prefills_leaves_its_drafts_what_the_prompts_do_not_take():
    policy = rule_policy(fixed=True)
    round_ = policy.start(slots(policy, 2), Step(running=3, prefill_tokens=20, budget=20 + 2 + 4))
    assert [c.length for c in policy.choose(round_, [Block(0.9, True)] * 2)] == [2, 2]


def test_fit_budget_trims_the_longest_drafts_first():
    assert fit_budget([15, 3, 8, 0], 96) == [15, 3, 8, 0]
    assert fit_budget([15, 3, 8, 0], 16) == [6, 3, 6, 0]
    assert fit_budget([15, 15], 0) == [0, 0]
    assert fit_budget([15, 15], None) == [15, 15]


def test_the_plain_policy_runs_no_drafter_and_verifies_nothing():
    policy = PlainPolicy(SETTINGS, BLOCK)
    round_ = policy.start(slots(policy, 2), Step(running=2))
    assert round_.drafts == (False, False)
    assert policy.choose(round_, [None, None]) == [PLAIN, PLAIN]


def test_goodput_reads_the_first_rows_then_the_rest_where_acceptance_reaches_past_them():
    policy = goodput_policy()
    assert policy.confidence_rows(15, (), 0.9) == CONFIDENCE_ROWS
    assert policy.confidence_rows(2, (), 0.9) == 2
    assert policy.confidence_rows(15, (0.99,) * CONFIDENCE_ROWS, 0.9) == 15
    assert policy.confidence_rows(15, (0.01,) * CONFIDENCE_ROWS, 0.9) == CONFIDENCE_ROWS


def test_the_rules_read_no_confidences():
    assert rule_policy().confidence_rows(15, (), 0.9) == 0


@pytest.fixture
def calibrations(monkeypatch):
    calls = []

    def calibrate_once(target, cost, kind, **calibration):
        calls.append((kind, calibration))
        cost.calibrated = True
        return "measured"

    monkeypatch.setattr(adaflash_hf.policy, "calibrate_once", calibrate_once)
    return calls


def test_goodput_calibrates_once_at_its_first_round(calibrations):
    policy = goodput_policy(CostModel())
    assert calibrations == []
    for _ in range(3):
        policy.start(slots(policy, 1), Step(running=1))
    assert len(calibrations) == 1


def test_an_engine_policy_calibrates_the_sizes_within_its_token_budget(calibrations):
    policy = goodput_policy(CostModel(fit_steps=True), kind="engine")
    policy.start(slots(policy, 1), Step(running=1, budget=32))
    ((kind, calibration),) = calibrations
    assert kind == "engine" and calibration["sizes"] == [1, 4, 16]


def test_goodput_with_calibration_off_measures_nothing_before_its_rounds(calibrations):
    policy = goodput_policy(CostModel(), settings=dataclasses.replace(SETTINGS, calibrate=False))
    policy.start(slots(policy, 1), Step(running=1))
    assert calibrations == []
