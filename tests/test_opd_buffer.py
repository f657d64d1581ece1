"""On-policy data: trajectories from the engine and from generate, the replay buffer's trigger, staleness, capacity
and replay mix."""

import threading

import pytest
import torch
from transformers import GenerationConfig

from adaflash_hf.online.buffer import EngineRecorder, ReplayBuffer, Trajectory, record_generate
from adaflash_hf.serving import AdaFlashEngine, SamplingParams
from tests.conftest import finished_requests


def trajectory(version=0, domain="math", prompt=(5, 6, 7)):
    return Trajectory(
        prompt=list(prompt),
        committed=[8, 9, 10, 11],
        anchors=[3, 5],
        draft_lengths=[4, 2],
        accepted=[1, 0],
        drafter_version=version,
        domain=domain,
    )


def test_buffer_triggers_at_the_threshold_with_the_oldest_samples():
    buffer = ReplayBuffer(train_threshold=3)
    for i in range(2):
        buffer.add(trajectory(domain=str(i)))
    assert buffer.take(current_version=0, timeout=0) is None
    buffer.add(trajectory(domain="2"))
    buffer.add(trajectory(domain="3"))
    batch = buffer.take(current_version=0, timeout=0)
    assert [t.domain for t in batch] == ["0", "1", "2"] and len(buffer) == 1
    assert buffer.stats()["taken"] == 3


def test_take_blocks_until_serving_fills_the_buffer():
    buffer = ReplayBuffer(train_threshold=2)
    feeder = threading.Timer(0.2, lambda: [buffer.add(trajectory()) for _ in range(2)])
    feeder.start()
    assert len(buffer.take(current_version=0, timeout=5)) == 2
    feeder.join()


def test_stale_samples_are_dropped_and_counted():
    buffer = ReplayBuffer(train_threshold=2, max_staleness=1)
    for version in (0, 1, 2, 3, 3):
        buffer.add(trajectory(version=version))
    batch = buffer.take(current_version=3, timeout=0)
    assert [t.drafter_version for t in batch] == [2, 3]
    assert buffer.stats()["dropped_stale"] == 2 and len(buffer) == 1


def test_capacity_drops_the_oldest_when_serving_outruns_training():
    buffer = ReplayBuffer(train_threshold=2, capacity=3)
    for i in range(5):
        buffer.add(trajectory(domain=str(i)))
    assert [t.domain for t in buffer.take(0, timeout=0)] == ["2", "3"]
    assert buffer.stats()["dropped_overflow"] == 2


def test_stop_event_ends_a_waiting_take():
    stop = threading.Event()
    stop.set()
    assert ReplayBuffer(train_threshold=2).take(0, stop=stop) is None


def served(buffer, domain, n):
    """Add ``n`` served trajectories of ``domain``, each with a prompt of its own; returns them."""
    samples = [trajectory(domain=domain, prompt=(5, buffer.counts["added"] + i, 7)) for i in range(n)]
    for sample in samples:
        buffer.add(sample)
    return samples


def test_a_replay_mix_fills_its_fraction_of_each_buffer_with_recent_samples_of_the_replay_domains():
    buffer = ReplayBuffer(train_threshold=10, replay_fraction=0.3, replay_domains=["chat", "math"])
    assert (buffer.fresh_per_buffer, buffer.replayed_per_buffer) == (7, 3)
    old = served(buffer, "chat", 7) + served(buffer, "math", 7)
    assert len(buffer.take(0, timeout=0)) == len(buffer.take(0, timeout=0)) == 10
    new = served(buffer, "code", 6)
    assert buffer.take(0, timeout=0) is None  # a round waits for its 7 fresh samples
    new += served(buffer, "code", 1)
    batch = buffer.take(0, timeout=0)
    fresh, replayed = batch[:7], batch[7:]
    assert [id(t) for t in fresh] == [id(t) for t in new]
    assert len(replayed) == 3 and len({id(t) for t in replayed}) == 3
    assert all(
        any(t is o for o in old) for t in replayed
    )  # served samples of the replay domains, nothing else
    assert buffer.stats()["replayed"] == 9 and buffer.stats()["taken"] == 21


def test_replay_draws_only_from_the_last_threshold_served_samples_of_each_replay_domain():
    buffer = ReplayBuffer(train_threshold=4, replay_fraction=0.5, replay_domains=["chat"])
    older = served(buffer, "chat", 4)
    recent = served(buffer, "chat", 4)
    for _ in range(4):  # the 8 chat samples, 2 fresh per buffer
        buffer.take(0, timeout=0)
    served(buffer, "code", 2)
    replayed = buffer.take(0, timeout=0)[2:]
    assert all(any(t is r for r in recent) for t in replayed) and not any(
        t is o for t in replayed for o in older
    )


def test_a_replay_mix_with_nothing_served_of_its_domains_fails_at_the_first_buffer():
    buffer = ReplayBuffer(train_threshold=4, replay_fraction=0.5, replay_domains=["chat", "math"])
    served(buffer, "code", 2)
    with pytest.raises(
        ValueError,
        match=r"replay_fraction: expected 2 served samples of replay_domains \['chat', 'math'\] .* got 0",
    ):
        buffer.take(0, timeout=0)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(replay_fraction=-0.1), r"replay_fraction: expected a value in \[0, 1\) .* got -0.1"),
        (dict(replay_fraction=1.0), r"replay_fraction: expected a value in \[0, 1\) .* got 1.0"),
        (
            dict(replay_fraction=0.01),
            r"replay_fraction: expected round\(.*\) in 1..31 .* got 0 from 0.01 \* 32",
        ),
        (
            dict(replay_fraction=0.99),
            r"replay_fraction: expected round\(.*\) in 1..31 .* got 32 from 0.99 \* 32",
        ),
        (dict(replay_fraction=0.25), r"replay_domains: expected the domains to replay .* got \[\]"),
    ],
)
def test_bad_replay_settings_name_the_field_the_expected_and_the_actual_value(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ReplayBuffer(train_threshold=32, **kwargs)


@pytest.mark.parametrize(
    "field,kwargs",
    [
        ("anchors", dict(anchors=[3], draft_lengths=[1, 2], accepted=[0, 0])),
        ("anchors", dict(anchors=[6], draft_lengths=[1], accepted=[0])),  # no committed token after it
        ("anchors", dict(anchors=[1], draft_lengths=[1], accepted=[0])),  # inside the prompt
    ],
)
def test_malformed_trajectories_are_refused(field, kwargs):
    with pytest.raises(ValueError, match=field):
        Trajectory(prompt=[5, 6, 7], committed=[8, 9, 10, 11], drafter_version=0, **kwargs)


def test_engine_records_each_finished_request_with_its_rounds(target_factory, drafter_factory):
    target = target_factory("llama")
    drafter = drafter_factory(target)
    drafter.weights_version = 7
    buffer = ReplayBuffer(train_threshold=3)
    engine = AdaFlashEngine(target, drafter, draft_source="diffusion")  # every round a block
    recorder = EngineRecorder(buffer)
    engine.round_recorder = recorder
    prompts = [torch.arange(4, 4 + n) for n in (5, 9, 3)]
    ids = [engine.add_request(p, SamplingParams(max_new_tokens=12)) for p in prompts]
    for request_id, domain in zip(ids, ("chat", "code", "math")):
        recorder.domains[request_id] = domain
    finished = finished_requests(engine.stream())
    batch = buffer.take(current_version=7, timeout=0)
    assert sorted(t.domain for t in batch) == ["chat", "code", "math"]
    for t in batch:
        request = finished[ids[("chat", "code", "math").index(t.domain)]]
        assert t.prompt == request.prompt and t.committed == request.output
        assert t.drafter_version == 7
        # Rounds tile the output: each commits accepted + 1 tokens after its anchor.
        assert t.anchors[0] == len(t.prompt)
        for a, nxt, accepted in zip(t.anchors, t.anchors[1:], t.accepted):
            assert nxt - a == accepted + 1
        assert all(0 <= acc <= k for acc, k in zip(t.accepted, t.draft_lengths))
        assert sum(t.draft_lengths) == request.drafted and sum(t.accepted) == request.accepted
    assert not recorder.rounds and not recorder.domains  # nothing kept for finished requests


def test_generate_records_its_trajectory_with_the_drafter_version(target_factory, drafter_factory):
    target = target_factory("llama")
    drafter = drafter_factory(target)
    buffer = ReplayBuffer(train_threshold=2)
    prompt = torch.arange(4, 12)[None]
    config = GenerationConfig(max_new_tokens=20, do_sample=False, adaflash_draft_source="diffusion")
    first = record_generate(target, drafter, buffer, prompt, domain="code", generation_config=config)
    drafter.weights_version = 1  # what a hot reload between calls does
    second = record_generate(target, drafter, buffer, prompt, domain="code", generation_config=config)
    assert torch.equal(first, second)
    batch = buffer.take(current_version=1, timeout=0)
    assert [t.drafter_version for t in batch] == [0, 1]
    assert batch[0].committed == first[0, 8:].tolist() and batch[0].anchors[0] == 8
    assert getattr(drafter, "round_recorder", None) is None
