"""On-policy data: trajectories recorded by the serving side, and the replay buffer the OPD trainer drains.

A ``Trajectory`` is one served request: the prompt, the committed tokens, and per drafting round the anchor position,
k̂ and the accepted count, tagged with the drafter version that drafted it. Nothing from the target is stored: the
trainer recomputes the target's distributions with its own frozen copy, so serving does no extra target work.

Two recorders feed the buffer without touching the hot path beyond a per-round append:

- ``TrajectoryRecorder`` is ``drafter.round_recorder`` for ``target.generate(..., assistant_model=drafter)``
  (``record_generate`` wraps one call);
- ``EngineRecorder`` is ``AdaFlashEngine.round_recorder``; a request's trajectory is pushed when it finishes.

``ReplayBuffer.take`` hands the trainer ``train_threshold`` fresh samples (128 in the paper) once that many are in;
samples whose version lags the trainer's by more than ``max_staleness`` are dropped and counted, and so are the
oldest samples past ``capacity`` when serving outruns training. With a replay mix (``replay_fraction`` f,
``replay_domains``) ``round(f · train_threshold)`` samples of each buffer are instead drawn at random from the most
recent served samples of the replay domains (the other domains than the one the traffic shifts to), which keeps the
drafter rehearsing them; only served trajectories ever enter the buffer, so nothing else can be replayed.
``TrajectoryDataset`` is one such batch as the map-style dataset a trainer trains on.
"""

from __future__ import annotations

import random
import threading
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import torch
from torch.utils.data import Dataset

from adaflash_hf.stats import RoundRecord, tau_of


@dataclass
class Trajectory:
    """One served request. ``anchors[r]`` is the position of round r's anchor in ``prompt + committed``; the round
    verified ``draft_lengths[r]`` drafts and accepted ``accepted[r]`` of them. ``drafter_version`` is the oldest
    version that drafted a round (staleness is judged conservatively)."""

    prompt: list[int]
    committed: list[int]
    anchors: list[int]
    draft_lengths: list[int]
    accepted: list[int]
    drafter_version: int
    domain: str = ""

    def __post_init__(self):
        rounds = len(self.anchors)
        if not (len(self.draft_lengths) == len(self.accepted) == rounds):
            raise ValueError(
                f"trajectory rounds: expected equal lengths of anchors/draft_lengths/accepted, got "
                f"{rounds}/{len(self.draft_lengths)}/{len(self.accepted)}"
            )
        last = len(self.prompt) + len(self.committed) - 1
        bad = [a for a in self.anchors if not len(self.prompt) - 1 <= a < last]
        if bad:
            raise ValueError(
                f"trajectory anchors: expected positions in {len(self.prompt) - 1}..{last - 1} (an anchor needs a "
                f"committed token after it), got {bad[:8]}"
            )

    @property
    def input_ids(self) -> list[int]:
        return self.prompt + self.committed

    @property
    def tau(self) -> float:
        """Committed tokens per drafting round (accepted + 1), 0 without rounds."""
        return tau_of(sum(self.accepted) + len(self.accepted), len(self.accepted))

    def to_dict(self) -> dict:
        return asdict(self)


def _trajectory(prompt, committed, rounds: list[RoundRecord], domain: str) -> Trajectory | None:
    """A trajectory from the rounds of one request; None when no round can be learnt from."""
    end = len(prompt) + len(committed) - 1
    # A round cut by EOS/length may leave nothing after it; a lookup round (hybrid drafting) has no drafter block.
    kept = [r for r in rounds if r.context_length < end and r.source == "diffusion"]
    if not kept:
        return None
    return Trajectory(
        prompt=list(prompt),
        committed=list(committed),
        anchors=[r.context_length for r in kept],
        draft_lengths=[r.draft_length for r in kept],
        accepted=[r.accepted for r in kept],
        drafter_version=min(r.drafter_version for r in kept),
        domain=domain,
    )


class TrajectoryDataset(Dataset):
    """A buffer's trajectories as a map-style dataset (items are ``Trajectory`` objects)."""

    def __init__(self, trajectories: list[Trajectory]):
        self.trajectories = list(trajectories)

    def __len__(self) -> int:
        return len(self.trajectories)

    def __getitem__(self, index: int) -> Trajectory:
        return self.trajectories[index]


def check_buffer_settings(
    train_threshold: int,
    max_staleness: int,
    replay_fraction: float = 0.0,
    replay_domains: Sequence[str] = (),
) -> None:
    """Raise ``ValueError`` naming the field for a ``train_threshold`` below 1, a negative ``max_staleness``, or a
    replay mix that replays nothing, leaves no fresh sample or has no domain to replay."""
    if train_threshold < 1:
        raise ValueError(f"train_threshold: expected >= 1, got {train_threshold}")
    if max_staleness < 0:
        raise ValueError(f"max_staleness: expected >= 0, got {max_staleness}")
    if not 0.0 <= replay_fraction < 1.0:
        raise ValueError(
            f"replay_fraction: expected a value in [0, 1) (the rest of each buffer is fresh traffic), got "
            f"{replay_fraction}"
        )
    replayed = round(replay_fraction * train_threshold)
    if replay_fraction > 0 and not 0 < replayed < train_threshold:
        raise ValueError(
            f"replay_fraction: expected round(replay_fraction * train_threshold) in 1..{train_threshold - 1} "
            f"(replayed samples per buffer, the rest fresh), got {replayed} from {replay_fraction} * {train_threshold}"
        )
    if replay_fraction > 0 and not replay_domains:
        raise ValueError(
            f"replay_domains: expected the domains to replay (the traffic's other domains than the new one) with "
            f"replay_fraction={replay_fraction}, got {list(replay_domains)}"
        )


def check_replay_domains(
    replay_fraction: float, replay_domains: Sequence[str], traffic_domains: Sequence[str]
) -> None:
    """Raise ``ValueError`` naming ``replay_domains`` when a replay mix could never draw what it should: a replay
    domain the traffic never serves, or every traffic domain replayed (no new domain)."""
    if replay_fraction == 0:
        return
    if not set(replay_domains) <= set(traffic_domains):
        raise ValueError(
            f"replay_domains: expected domains of the traffic {list(traffic_domains)} (only served samples are "
            f"replayed), got {list(replay_domains)}"
        )
    if set(traffic_domains) <= set(replay_domains):
        raise ValueError(
            f"replay_domains: expected the other domains than the new one, leaving at least one traffic domain of "
            f"{list(traffic_domains)} unreplayed, got {list(replay_domains)}"
        )


class ReplayBuffer:
    """Thread-safe FIFO of trajectories. See the module docstring for the trigger, staleness, capacity and replay
    rules."""

    def __init__(
        self,
        train_threshold: int = 128,
        max_staleness: int = 4,
        capacity: int | None = None,
        replay_fraction: float = 0.0,
        replay_domains: Sequence[str] = (),
    ):
        check_buffer_settings(train_threshold, max_staleness, replay_fraction, replay_domains)
        capacity = 4 * train_threshold if capacity is None else capacity
        if capacity < train_threshold:
            raise ValueError(f"capacity: expected >= train_threshold={train_threshold}, got {capacity}")
        self.train_threshold = train_threshold
        self.max_staleness = max_staleness
        self.capacity = capacity
        # A buffer is ``fresh_per_buffer`` samples of the FIFO and ``replayed_per_buffer`` drawn from ``_recent``: per
        # replay domain its last ``train_threshold`` served samples, never dropped as stale (rehearsal is off-policy
        # by design).
        self.replayed_per_buffer = round(replay_fraction * train_threshold)
        self.fresh_per_buffer = train_threshold - self.replayed_per_buffer
        self._recent = {domain: deque(maxlen=train_threshold) for domain in replay_domains}
        self._rng = random.Random(0)
        self._items: deque[Trajectory] = deque()
        self._ready = threading.Condition()
        self.counts: Counter[str] = Counter()
        self.listeners: list[Callable[[Trajectory], None]] = []

    def __len__(self) -> int:
        with self._ready:
            return len(self._items)

    def add(self, trajectory: Trajectory) -> None:
        with self._ready:
            self._items.append(trajectory)
            self.counts["added"] += 1
            if trajectory.domain in self._recent:
                self._recent[trajectory.domain].append(trajectory)
            while len(self._items) > self.capacity:
                self._items.popleft()
                self.counts["dropped_overflow"] += 1
            self._ready.notify_all()
        for listener in self.listeners:
            listener(trajectory)

    def _drop_stale(self, current_version: int) -> None:
        fresh = deque(t for t in self._items if current_version - t.drafter_version <= self.max_staleness)
        self.counts["dropped_stale"] += len(self._items) - len(fresh)
        self._items = fresh

    def take(
        self, current_version: int, timeout: float | None = None, stop: threading.Event | None = None
    ) -> list[Trajectory] | None:
        """Block until ``fresh_per_buffer`` fresh samples are in, and return (remove) the oldest of them, followed
        by the buffer's replayed samples (``_replayed``).

        Returns None on ``timeout`` or when ``stop`` is set first. ``current_version`` is the trainer's version.
        """
        waited = 0.0
        with self._ready:
            while True:
                self._drop_stale(current_version)
                if len(self._items) >= self.fresh_per_buffer:
                    batch = [self._items.popleft() for _ in range(self.fresh_per_buffer)]
                    self.counts["taken"] += len(batch)
                    return batch + self._replayed()
                if (stop is not None and stop.is_set()) or (timeout is not None and waited >= timeout):
                    return None
                # Short waits so a stop request is seen promptly even without a notify.
                self._ready.wait(0.1)
                waited += 0.1

    def _replayed(self) -> list[Trajectory]:
        """``replayed_per_buffer`` samples drawn without replacement from the recent served samples of the replay
        domains (this buffer's own included: before the traffic reaches the new domain they are all there is)."""
        if not self.replayed_per_buffer:
            return []
        recent = [t for samples in self._recent.values() for t in samples]
        if len(recent) < self.replayed_per_buffer:
            raise ValueError(
                f"replay_fraction: expected {self.replayed_per_buffer} served samples of replay_domains "
                f"{list(self._recent)} to replay in this buffer, got {len(recent)}: serve those domains in an earlier "
                f"phase of the traffic than the new domain, or lower replay_fraction"
            )
        self.counts["replayed"] += self.replayed_per_buffer
        return self._rng.sample(recent, self.replayed_per_buffer)

    def stats(self) -> dict[str, int]:
        with self._ready:
            return {"size": len(self._items), **{key: self.counts[key] for key in sorted(self.counts)}}


class TrajectoryRecorder:
    """``drafter.round_recorder`` for ``generate``: collects one call's rounds. Use ``record_generate``."""

    def __init__(self):
        self.rounds: list[RoundRecord] = []

    def __call__(self, record: RoundRecord) -> None:
        self.rounds.append(record)


def record_generate(
    target, drafter, buffer: ReplayBuffer, prompt_ids: torch.Tensor, domain: str = "", **generate_kwargs
) -> torch.Tensor:
    """``target.generate(prompt_ids, assistant_model=drafter, ...)`` that also pushes the call's trajectory."""
    recorder = TrajectoryRecorder()
    previous = getattr(drafter, "round_recorder", None)
    drafter.round_recorder = recorder
    try:
        output = target.generate(prompt_ids, assistant_model=drafter, **generate_kwargs)
    finally:
        drafter.round_recorder = previous
    prompt = prompt_ids[0].tolist()
    trajectory = _trajectory(prompt, output[0, len(prompt) :].tolist(), recorder.rounds, domain)
    if trajectory is not None:
        buffer.add(trajectory)
    return output


@dataclass
class EngineRecorder:
    """``AdaFlashEngine.round_recorder``: per-request rounds, pushed to ``buffer`` when the request finishes.

    Set ``domains[request_id]`` when adding a request to tag its trajectory.
    """

    buffer: ReplayBuffer
    domains: dict[str, str] = field(default_factory=dict)
    rounds: dict[str, list[RoundRecord]] = field(default_factory=dict)

    def __call__(self, request, record: RoundRecord) -> None:
        self.rounds.setdefault(request.request_id, []).append(record)
        if request.finish_reason is None:
            return
        rounds = self.rounds.pop(request.request_id)
        trajectory = _trajectory(
            request.prompt, request.output, rounds, self.domains.pop(request.request_id, "")
        )
        if trajectory is not None:
            self.buffer.add(trajectory)
