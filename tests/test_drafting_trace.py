"""The drafting decisions of ``generate`` and the engine, round by round, pinned on injected timings.

Every scenario runs on a virtual clock: ``time.perf_counter`` advances only inside target and drafter forwards, by a
fixed cost per forward (tokens in it, requests in it), so every timing the drafting logic reads (its cost model, the
engine's whole-step judgement) is the same on any machine and in any order of the code. The recorded traces
(``tests/data/drafting_traces.json``: per round the draft length, the source and the accepted count; the outputs)
pin the decisions; a change to the policy that moves any of them fails here. Regenerate deliberately with
``ADAFLASH_WRITE_TRACES=1 .venv/bin/pytest tests/test_drafting_trace.py`` and review the diff.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch

from adaflash_hf.cost_model import CostModel, use_cost_model
from adaflash_hf.drafting import DraftingSettings
from adaflash_hf.serving import AdaFlashEngine, SamplingParams
from tests.conftest import finished_requests

TRACES = Path(__file__).parent / "data" / "drafting_traces.json"

# Virtual seconds of one forward: a target forward of n tokens, a drafter forward over r requests.
STEEP = {1: 0.010, 2: 0.017, 4: 0.015, 8: 0.018, 16: 0.022, 64: 0.06}  # an AVX2-like fp32 curve
FLAT = {1: 0.010, 2: 0.0105, 4: 0.0106, 8: 0.0104, 16: 0.014, 64: 0.05}  # a bf16-dot-product curve
DRAFTER = 0.002


def _interpolated(table: dict[int, float], n: int) -> float:
    sizes = sorted(table)
    if n <= sizes[0]:
        return table[sizes[0]]
    for a, b in zip(sizes, sizes[1:]):
        if n <= b:
            return table[a] + (table[b] - table[a]) * (n - a) / (b - a)
    a, b = sizes[-2], sizes[-1]
    return table[b] + (table[b] - table[a]) / (b - a) * (n - b)


class VirtualClock:
    """``time.perf_counter`` replaced by a clock that forwards move: a target forward by its tokens' cost, a drafter
    forward by its requests' cost; everything else takes no time."""

    def __init__(self, curve: dict[int, float], monkeypatch):
        self.now = 1000.0
        self.curve = curve
        monkeypatch.setattr(time, "perf_counter", self)

    def __call__(self) -> float:
        return self.now

    def attach(self, target, drafter) -> None:
        def on_target(module, args, kwargs):
            ids = kwargs.get("input_ids", args[0] if args else None)
            tokens = ids.shape[1] if ids is not None else kwargs["inputs_embeds"].shape[1]
            self.now += _interpolated(self.curve, tokens)

        def on_drafter(module, args, kwargs):
            self.now += DRAFTER * (1 + 0.25 * (kwargs["noise_embeds"].shape[0] - 1))

        target.register_forward_pre_hook(on_target, with_kwargs=True)
        if drafter is not None:
            drafter.register_forward_pre_hook(on_drafter, with_kwargs=True)


def _generate_scenario(factories, curve, knobs: dict, sample: bool = False):
    target = factories.target("llama", seed=3)
    prompt = torch.randint(0, 500, (1, 10), generator=torch.Generator().manual_seed(7))
    reference = target.generate(prompt, max_new_tokens=48, do_sample=False)
    drafter = factories.oracle(target, reference, seed=2)
    use_cost_model(target, "generate", CostModel.profile(curve, drafter_seconds=DRAFTER))
    VirtualClock(curve, factories.monkeypatch).attach(target, drafter)
    torch.manual_seed(11)
    out = target.generate(prompt, max_new_tokens=48, do_sample=sample, assistant_model=drafter, **knobs)
    stats = drafter.last_stats
    if not sample:
        assert torch.equal(out, reference)
    return {
        "output": out[0, prompt.shape[1] :].tolist(),
        "lengths": list(stats.verify_lengths),
        "accepted": list(stats.accepted_lengths),
        "sources": list(stats.sources),
        "skipped": stats.skipped_drafter_forwards,
    }


def _engine_scenario(factories, curve, settings: DraftingSettings | None, temperatures=(0, 0, 0, 0)):
    target = factories.target("llama", seed=3)
    drafter = factories.drafter(target)
    plain = settings is None
    use_cost_model(target, "engine", CostModel.profile(curve, drafter_seconds=DRAFTER))
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 500, (n,), generator=g) for n in (5, 12, 3, 8)]
    engine = AdaFlashEngine(target) if plain else AdaFlashEngine(target, drafter, drafting=settings)
    rounds: dict[str, list] = {}
    engine.round_recorder = lambda request, record: rounds.setdefault(request.request_id, []).append(
        [record.draft_length, record.source, record.accepted]
    )
    VirtualClock(curve, factories.monkeypatch).attach(target, None if plain else drafter)
    ids = [
        engine.add_request(p, SamplingParams(max_new_tokens=24, temperature=t, seed=i))
        for i, (p, t) in enumerate(zip(prompts, temperatures))
    ]
    finished = finished_requests(engine.stream())
    return {
        "outputs": [finished[i].output for i in ids],
        "rounds": [rounds.get(i, []) for i in ids],
        "steps": [[s.draft_tokens, s.skipped_drafter, s.lookup_verifies] for s in engine.stats],
    }


GENERATE = {
    "generate/goodput/steep": (
        STEEP,
        {"adaflash_draft_source": "diffusion", "adaflash_length_mode": "goodput"},
        False,
    ),
    "generate/goodput/flat": (
        FLAT,
        {"adaflash_draft_source": "diffusion", "adaflash_length_mode": "goodput"},
        False,
    ),
    "generate/hybrid_goodput/steep": (
        STEEP,
        {"adaflash_length_mode": "goodput", "adaflash_draft_source": "hybrid"},
        False,
    ),
    "generate/hybrid_goodput/flat": (
        FLAT,
        {"adaflash_length_mode": "goodput", "adaflash_draft_source": "hybrid"},
        False,
    ),
    "generate/adaptive": (
        STEEP,
        {"adaflash_draft_source": "diffusion", "adaflash_length_mode": "adaptive"},
        False,
    ),
    "generate/fixed": (STEEP, {"adaflash_draft_source": "diffusion", "adaflash_length_mode": "fixed"}, False),
    "generate/hybrid_adaptive": (
        STEEP,
        {"adaflash_length_mode": "adaptive", "adaflash_draft_source": "hybrid"},
        False,
    ),
    "generate/goodput/max_skip_2": (
        STEEP,
        {"adaflash_draft_source": "diffusion", "adaflash_length_mode": "goodput", "adaflash_max_skip": 2},
        False,
    ),
    "generate/goodput/sampling": (
        FLAT,
        {"adaflash_draft_source": "diffusion", "adaflash_length_mode": "goodput"},
        True,
    ),
    "generate/auto/sampling": (FLAT, {"adaflash_draft_source": "diffusion"}, True),
}
GREEDY = (0, 0, 0, 0)
ENGINE = {
    "engine/goodput/steep": (
        STEEP,
        DraftingSettings(draft_source="diffusion", length_mode="goodput"),
        GREEDY,
    ),
    "engine/goodput/flat": (FLAT, DraftingSettings(draft_source="diffusion", length_mode="goodput"), GREEDY),
    "engine/hybrid_goodput/flat": (
        FLAT,
        DraftingSettings(length_mode="goodput", draft_source="hybrid"),
        GREEDY,
    ),
    "engine/hybrid_goodput/steep": (
        STEEP,
        DraftingSettings(length_mode="goodput", draft_source="hybrid"),
        GREEDY,
    ),
    "engine/adaptive": (STEEP, DraftingSettings(draft_source="diffusion", length_mode="adaptive"), GREEDY),
    "engine/fixed": (STEEP, DraftingSettings(draft_source="diffusion", length_mode="fixed"), GREEDY),
    "engine/hybrid_adaptive": (
        STEEP,
        DraftingSettings(length_mode="adaptive", draft_source="hybrid"),
        GREEDY,
    ),
    "engine/auto/mixed_sampling": (FLAT, DraftingSettings(draft_source="diffusion"), (0, 1.0, 0, 0.7)),
    "engine/plain": (STEEP, None, GREEDY),
}


class Factories:
    def __init__(self, target, drafter, oracle, monkeypatch):
        self.target, self.drafter, self.oracle, self.monkeypatch = target, drafter, oracle, monkeypatch


@pytest.mark.parametrize("name", sorted(GENERATE) + sorted(ENGINE))
def test_drafting_decisions_round_by_round_equal_the_recorded_trace(
    name, target_factory, drafter_factory, oracle_factory, monkeypatch
):
    factories = Factories(target_factory, drafter_factory, oracle_factory, monkeypatch)
    if name in GENERATE:
        trace = _generate_scenario(factories, *GENERATE[name])
    else:
        trace = _engine_scenario(factories, *ENGINE[name])
    recorded = json.loads(TRACES.read_text()) if TRACES.exists() else {}
    if os.environ.get("ADAFLASH_WRITE_TRACES") == "1":
        recorded[name] = trace
        TRACES.parent.mkdir(exist_ok=True)
        TRACES.write_text(json.dumps(recorded, indent=1, sort_keys=True) + "\n")
    assert name in recorded, (
        f"{name}: no recorded trace (regenerate: ADAFLASH_WRITE_TRACES=1 pytest {__file__})"
    )
    assert trace == recorded[name]
