"""On-policy data: trajectories from the engine and from generate, the replay buffer's trigger, staleness and
capacity."""

import threading

import pytest
import torch
from transformers import GenerationConfig

from adaflash_hf.online.buffer import EngineRecorder, ReplayBuffer, Trajectory, record_generate
from adaflash_hf.serving import AdaFlashEngine, SamplingParams


def trajectory(version=0, domain="math"):
    return Trajectory(
        prompt=[5, 6, 7],
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
    engine = AdaFlashEngine(target, drafter, mode="adaflash")
    recorder = EngineRecorder(buffer)
    engine.round_recorder = recorder
    prompts = [torch.arange(4, 4 + n) for n in (5, 9, 3)]
    ids = [engine.add_request(p, SamplingParams(max_new_tokens=12)) for p in prompts]
    for request_id, domain in zip(ids, ("chat", "code", "math")):
        recorder.domains[request_id] = domain
    while engine.has_unfinished():
        engine.step()
    batch = buffer.take(current_version=7, timeout=0)
    assert sorted(t.domain for t in batch) == ["chat", "code", "math"]
    for t in batch:
        request = engine.requests[ids[("chat", "code", "math").index(t.domain)]]
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
    config = GenerationConfig(max_new_tokens=20, do_sample=False)
    first = record_generate(target, drafter, buffer, prompt, domain="code", generation_config=config)
    drafter.weights_version = 1  # what a hot reload between calls does
    second = record_generate(target, drafter, buffer, prompt, domain="code", generation_config=config)
    assert torch.equal(first, second)
    batch = buffer.take(current_version=1, timeout=0)
    assert [t.drafter_version for t in batch] == [0, 1]
    assert batch[0].committed == first[0, 8:].tolist() and batch[0].anchors[0] == 8
    assert getattr(drafter, "round_recorder", None) is None
