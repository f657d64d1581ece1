"""Per-call statistics and per-round records of AdaFlash speculative decoding, as plain data."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from adaflash_hf.modeling.length_head_adaflash import realised_acceptance


def tau_of(committed: int, rounds: int) -> float:
    """τ, the one definition: committed tokens per drafting round (one target forward each; a round commits its
    accepted drafts + 1 bonus token, fewer when cut at EOS / length); 0 without rounds."""
    return committed / rounds if rounds else 0.0


@dataclass
class RoundRecord:
    """One drafting round, as handed to a round recorder (the online-learning hook).

    ``context_length`` is the number of committed tokens before the anchor (the anchor sits at that position);
    ``drafted_tokens`` are all ``block_size - 1`` proposals of the block, of which the first ``draft_length`` were
    verified and the first ``accepted`` of those accepted.
    """

    context_length: int
    anchor_token: int
    drafted_tokens: list[int]
    draft_length: int
    predicted_acceptance: float
    accepted: int
    drafter_version: int
    source: str = "diffusion"  # "lookup": the drafts came from the lookup proposer, not the drafter's block


@dataclass
class AdaFlashStats:
    """What one ``generate`` call did. ``tau`` counts committed tokens per target forward in drafting rounds.

    Per round: ``sources`` says where the drafts came from (``"diffusion"``: the drafter's block; ``"lookup"``: the
    lookup proposer, hybrid drafting; ``"plain"``: none, a goodput round that skipped the drafter) and ``predicted_acceptance`` is that source's expected accepted fraction of a
    block (the length head's â; the lookup estimate / (block_size - 1))."""

    block_size: int
    drafting_rounds: int = 0
    target_forwards: int = 0
    committed_tokens: int = 0
    accepted_histogram: list[int] = field(default_factory=list)
    position_attempts: list[int] = field(default_factory=list)
    position_accepts: list[int] = field(default_factory=list)
    verify_lengths: list[int] = field(default_factory=list)
    accepted_lengths: list[int] = field(default_factory=list)
    predicted_acceptance: list[float] = field(default_factory=list)
    sources: list[str] = field(default_factory=list)  # per round: "diffusion" or "lookup"
    drafter_seconds: float = 0.0
    verify_seconds: float = 0.0
    nonfinite_blocks: int = 0  # drafter blocks with a NaN/inf state: those rounds verified no drafts
    skipped_drafter_forwards: int = (
        0  # rounds that ran no drafter forward (goodput's skips, lookup-only rounds)
    )

    def __post_init__(self):
        slots = self.block_size - 1
        self.accepted_histogram = self.accepted_histogram or [0] * (slots + 1)
        self.position_attempts = self.position_attempts or [0] * slots
        self.position_accepts = self.position_accepts or [0] * slots

    def add_round(
        self, draft_length: int, accepted: int, predicted: float, source: str = "diffusion"
    ) -> None:
        self.drafting_rounds += 1
        self.committed_tokens += accepted + 1
        self.accepted_histogram[accepted] += 1
        for position in range(draft_length):
            self.position_attempts[position] += 1
            self.position_accepts[position] += int(position < accepted)
        self.verify_lengths.append(draft_length)
        self.accepted_lengths.append(accepted)
        self.predicted_acceptance.append(predicted)
        self.sources.append(source)

    @property
    def tau(self) -> float:
        """Committed tokens per target forward over drafting rounds (accepted + 1 bonus); 0 before any round."""
        return tau_of(self.committed_tokens, self.drafting_rounds)

    @property
    def realised_acceptance(self) -> list[float]:
        """Accepted fraction of each round's block (a* = accepted / (block_size - 1)), the length head's target."""
        return [realised_acceptance(accepted, self.block_size) for accepted in self.accepted_lengths]

    @property
    def mean_verify_length(self) -> float:
        return sum(self.verify_lengths) / len(self.verify_lengths) if self.verify_lengths else 0.0

    @property
    def zero_length_rounds(self) -> int:
        """Rounds that verified no drafts (k = 0: plain decoding steps)."""
        return self.verify_lengths.count(0)

    @property
    def acceptance_per_position(self) -> list[float | None]:
        """P(position j accepted | position j verified), j = 1..block_size-1; None where never verified."""
        return [acc / att if att else None for acc, att in zip(self.position_accepts, self.position_attempts)]

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafts / verified drafts."""
        verified = sum(self.verify_lengths)
        return sum(self.position_accepts) / verified if verified else 0.0

    @property
    def source_share(self) -> dict[str, float]:
        """Share of drafting rounds won by each source."""
        return {s: self.sources.count(s) / len(self.sources) for s in sorted(set(self.sources))}

    @property
    def source_acceptance(self) -> dict[str, float]:
        """Accepted / verified drafts of each source's rounds."""
        out = {}
        for source in sorted(set(self.sources)):
            rounds = [i for i, s in enumerate(self.sources) if s == source]
            verified = sum(self.verify_lengths[i] for i in rounds)
            out[source] = sum(self.accepted_lengths[i] for i in rounds) / verified if verified else 0.0
        return out

    def to_dict(self) -> dict:
        out = asdict(self)
        out.update(
            tau=self.tau,
            mean_verify_length=self.mean_verify_length,
            zero_length_rounds=self.zero_length_rounds,
            acceptance_rate=self.acceptance_rate,
            realised_acceptance=self.realised_acceptance,
            acceptance_per_position=self.acceptance_per_position,
            source_share=self.source_share,
            source_acceptance=self.source_acceptance,
        )
        return out

    def summary(self) -> str:
        mean_pred = sum(self.predicted_acceptance) / max(len(self.predicted_acceptance), 1)
        mean_real = sum(self.realised_acceptance) / max(len(self.realised_acceptance), 1)
        return (
            f"tau={self.tau:.2f} rounds={self.drafting_rounds} target_forwards={self.target_forwards} "
            f"mean_verify_len={self.mean_verify_length:.2f} acceptance_rate={self.acceptance_rate:.2f} "
            f"predicted/realised acceptance={mean_pred:.2f}/{mean_real:.2f} "
            f"drafter/verify s={self.drafter_seconds:.3f}/{self.verify_seconds:.3f}"
            + f" k0_rounds={self.zero_length_rounds} skipped_drafter_forwards={self.skipped_drafter_forwards}"
            + (f" nonfinite_blocks={self.nonfinite_blocks}" if self.nonfinite_blocks else "")
        )


@dataclass
class StepStats:
    step: int
    running: int  # requests in the target forward (prefills + verifies)
    waiting: int  # still queued after admission
    admitted: int
    kv_reserved: int  # target KV positions reserved by the requests in this step
    prefill_tokens: int
    draft_tokens: int  # Σ k̂_i over verifying requests
    verify_tokens: int  # Σ (k̂_i + 1)
    accepted: int  # accepted drafts
    committed: int  # tokens committed by verifies (accepted + 1 each, cut at EOS / length)
    verifies: int
    gamma: float
    ema_running: float
    drafter_fallbacks: int  # requests whose drafter block was non-finite: k̂ = 0
    drafter_seconds: float
    target_seconds: float
    seconds: float
    lookup_verifies: int = 0  # verifying requests whose drafts came from lookup (hybrid)
    lookup_accepted: int = 0  # accepted lookup drafts
    skipped_drafter: int = (
        0  # verifying requests that ran no drafter forward this step (goodput, lookup-only)
    )
    zero_length_verifies: int = 0  # verifying requests with k = 0 (plain decoding for them)

    @property
    def tau(self) -> float:
        """Committed tokens per verifying request in this step (accepted + 1)."""
        return tau_of(self.committed, self.verifies)

    @property
    def mean_verify_length(self) -> float:
        return self.draft_tokens / self.verifies if self.verifies else 0.0
