"""Evaluate a drafter on held-out prompts its traffic never served: the prompts, and what serving them measures.

``eval_prompts`` takes, per domain, held-out prompts from the end of the shuffle whose start an online run's traffic
serves (``online.loop.TrafficSource.from_domains``), and refuses any with the text or the token ids of a served one.
``evaluate_drafter`` serves them greedily on an engine and reads every round's whole draft back: τ, τ_full (what the
full draft would have committed), per-position acceptance and the length head's mean |â - a*|, per domain, with
per-prompt counts for intervals (``tau_interval``, ``bootstrap``: paired over the prompts). ``read_metrics`` reads a
run's per-round metrics back. ``adaflash bench opd`` uses them on each round's checkpoint; a learner can use them on
its own drafter. Any drafter's recorded rounds (``generate``'s statistics, say) give its acceptance per position and
its length head's error (``acceptance_per_position``, ``length_head_figures``: ``adaflash bench generate``).
"""

from __future__ import annotations

import csv
import math
import random
import statistics
from collections import defaultdict
from pathlib import Path

import torch

from adaflash_hf.modeling.length_head_adaflash import length_head_error, realised_acceptance
from adaflash_hf.online.loop import TrafficSource
from adaflash_hf.serving import AdaFlashEngine, AdmissionConfig, SamplingParams
from adaflash_hf.stats import tau_of

DOMAINS = ("chat", "code", "math")  # always evaluated, with the traffic's own domains (a new one among them)
# Where a summary's ``per_prompt`` row holds each count.
ACCEPTED, VERIFIES, FULL_ROUNDS, FULL_ACCEPTED = range(4)
RESAMPLES = 2000


# ---------------------------------------------------------------------------------------------- prompts
def evaluation_domains(config: dict) -> tuple[str, ...]:
    """``DOMAINS`` and then the traffic's other domains (a new one: ``adaflash_hf.data.SHIFT_DOMAINS``)."""
    return DOMAINS + tuple(d for d in config["domains"] if d not in DOMAINS)


def served_counts(config: dict) -> dict[str, int]:
    """Per traffic domain, how many prompts of its held-out shuffle the traffic serves (the first ones)."""
    counts = config.get("phase_prompts") or [int(config["prompts_per_domain"])] * len(config["domains"])
    served: dict[str, int] = {}
    for domain, count in zip(config["domains"], counts):
        served[domain] = max(served.get(domain, 0), int(count))
    return served


def eval_prompts(
    tokenizer, config: dict, per_domain: int, domains: tuple[str, ...] | None = None
) -> dict[str, list[list[int]]]:
    """``per_domain`` held-out prompts per domain (default ``evaluation_domains``) from the end of the shuffle whose
    start is the traffic, as token ids (cut as the traffic cuts its prompts); refused if one has the text or the ids of
    a served prompt (``check_unserved``). ``config``: the traffic settings (``domains``, ``prompts_per_domain``,
    ``phase_prompts``, ``seed``, ``max_prompt_tokens``)."""
    from adaflash_hf.data import prompt_ids

    texts = eval_texts(config, per_domain, domains or evaluation_domains(config))
    cut = int(config["max_prompt_tokens"])
    prompts = {
        domain: [prompt_ids(tokenizer, text, cut, too_long="keep_last")[0].tolist() for text in chosen]
        for domain, chosen in texts.items()
    }
    check_unserved(texts, prompts, served_prompts(tokenizer, config))
    return prompts


def eval_texts(config: dict, per_domain: int, domains: tuple[str, ...]) -> dict[str, list[str]]:
    """The texts of ``eval_prompts``.

    The traffic (``TrafficSource.from_domains``) serves the first ``served_counts(config)[domain]`` rows of
    ``load_domain(domain, "heldout", seed=seed)``'s shuffle; these are the last ``per_domain`` distinct texts, skipping
    any text also served (the held-out sets hold a few duplicate texts). Raises if a traffic domain is too small for
    the two to be disjoint.
    """
    from adaflash_hf.data import load_domain

    seed, counts = int(config["seed"]), served_counts(config)
    texts = {}
    for domain in domains:
        served = counts.get(domain, 0)
        split = load_domain(domain, "heldout")
        if per_domain < 1 or per_domain > len(split):
            raise ValueError(
                f"--eval-prompts-per-domain: expected 1..{len(split)} for {domain}, got {per_domain}"
            )
        if served and served + per_domain > len(split):
            raise ValueError(
                f"--eval-prompts-per-domain: expected at most {len(split) - served} for traffic domain {domain} "
                f"({len(split)} held-out prompts, {served} served), got {per_domain}"
            )
        # The traffic's own call with every row: its first rows are exactly the ones served.
        shuffled = load_domain(domain, "heldout", n=len(split), seed=seed)["prompt"]
        served_texts = set(shuffled[:served])
        chosen: list[str] = []
        # From the end; a text that is also among the served ones (a duplicate) is skipped.
        for text in reversed(shuffled):
            if len(chosen) == per_domain:
                break
            if text not in served_texts and text not in chosen:
                chosen.append(text)
        if len(chosen) < per_domain:
            raise ValueError(
                f"--eval-prompts-per-domain: expected at most {len(chosen)} for {domain} (distinct texts not served), "
                f"got {per_domain}"
            )
        texts[domain] = chosen
    return texts


def served_prompts(tokenizer, config: dict) -> dict[str, list[tuple[str, list[int]]]]:
    """Per domain, ``(text, token ids)`` of every prompt the traffic of ``config`` serves: the rows and the
    ``TrafficSource.from_domains`` call of ``trainers/opd.py``."""
    from adaflash_hf.data import load_domain

    seed = int(config["seed"])
    traffic = TrafficSource.from_domains(
        tokenizer,
        config["domains"],
        int(config["prompts_per_domain"]),
        seed=seed,
        max_prompt_tokens=int(config["max_prompt_tokens"]),
        phase_prompts=config.get("phase_prompts"),
    )
    return {
        domain: list(zip(load_domain(domain, "heldout", n=len(prompts), seed=seed)["prompt"], prompts))
        for domain, prompts in traffic.phases
    }


def check_unserved(
    texts: dict[str, list[str]],
    prompts: dict[str, list[list[int]]],
    served: dict[str, list[tuple[str, list[int]]]],
) -> None:
    """Raise ``ValueError`` naming both prompts when an evaluation prompt (``texts`` and their ``prompts`` per domain)
    has the text or the token ids of a ``served`` one."""
    by_text = {text: (d, i) for d, rows in served.items() for i, (text, _) in enumerate(rows)}
    by_ids = {tuple(ids): (d, i) for d, rows in served.items() for i, (_, ids) in enumerate(rows)}
    for domain, chosen in texts.items():
        for j, (text, ids) in enumerate(zip(chosen, prompts[domain])):
            for same, hit in (("text", by_text.get(text)), ("token ids", by_ids.get(tuple(ids)))):
                if hit is not None:
                    raise ValueError(
                        f"evaluation prompts: expected none that the traffic serves, got evaluation prompt "
                        f"{domain}[{j}] with the {same} of served prompt {hit[0]}[{hit[1]}]: {text[:80]!r}"
                    )


# ---------------------------------------------------------------------------------------------- the drafter
def leading_matches(drafted: list[int], sequence: list[int], anchor: int) -> int:
    """How many of ``drafted`` (proposals for positions anchor+1, anchor+2, ...) equal ``sequence`` there, in a row."""
    count = 0
    for offset, token in enumerate(drafted, start=1):
        if anchor + offset >= len(sequence) or sequence[anchor + offset] != token:
            break
        count += 1
    return count


def evaluate_drafter(
    engine: AdaFlashEngine, prompts: dict[str, list[list[int]]], max_new_tokens: int
) -> tuple[dict[str, dict], dict[str, list[list[int]]]]:
    """Serve ``prompts`` greedily on ``engine``; per domain τ, τ_full, per-position acceptance, the length head's mean
    |â - a*| and per-prompt counts (``tau_interval``), and the outputs.

    τ_full, the per-position curve and the head's error use only rounds whose whole draft lies inside the final
    sequence (a* = the full draft's leading matches / (block_size - 1), the head's training target). Each round's
    accepted count must equal min(leading matches, verified length): the greedy verification rule, rechecked here.
    """
    block = engine.drafter.config.block_size
    rounds = defaultdict(list)
    previous = engine.round_recorder, engine.record_full_drafts
    engine.round_recorder = lambda request, record: rounds[request.request_id].append(record)
    engine.record_full_drafts = True  # every block row's proposal, verified or not
    params = SamplingParams(max_new_tokens=max_new_tokens)
    try:
        ids = {domain: [engine.add_request(p, params) for p in ps] for domain, ps in prompts.items()}
        finished = {output.request_id: output.request for output in engine.stream() if output.finished}
    finally:
        engine.round_recorder, engine.record_full_drafts = previous
    summary, outputs = {}, {}
    for domain, request_ids in ids.items():
        requests = [finished[r] for r in request_ids]
        outputs[domain] = [list(request.output) for request in requests]
        summary[domain] = _domain_summary([_request_counts(r, rounds[r.request_id], block) for r in requests])
    return summary, outputs


def evaluation_engine(
    target, drafter, prompts: dict[str, list[list[int]]], concurrency: int
) -> AdaFlashEngine:
    """The engine an evaluation of ``drafter`` on ``prompts`` serves on, ``concurrency`` requests at a time, with a
    token budget that never binds. The adaptive rule: τ and acceptance measure the drafter, not this machine's verify
    costs. The drafter's blocks every step: what online distillation learns from (a lookup round has no block)."""
    longest = max(len(p) for ps in prompts.values() for p in ps)
    budget = concurrency * drafter.config.block_size + longest
    admission = AdmissionConfig(max_running=concurrency, token_budget=budget)
    return AdaFlashEngine(
        target, drafter, admission=admission, length_mode="adaptive", draft_source="diffusion"
    )


def _request_counts(request, records, block: int) -> dict:
    """One request's rounds, counted (see ``evaluate_drafter``)."""
    sequence = list(request.prompt) + list(request.output)
    names = ("verifies", "accepted", "drafted", "full_rounds", "full_accepted", "head_rounds", "head_error")
    counts = dict.fromkeys(names, 0)
    counts["reached"] = [0] * (block - 1)
    for record in records:
        lead = leading_matches(record.drafted_tokens, sequence, record.context_length)
        if min(lead, record.draft_length) != record.accepted and (
            record.context_length + record.draft_length < len(sequence) - 1
        ):
            raise RuntimeError(
                f"request {request.request_id}: accepted {record.accepted} drafts, but {lead} leading proposals "
                f"match the output and {record.draft_length} were verified"
            )
        counts["verifies"] += 1
        counts["accepted"] += record.accepted
        counts["drafted"] += record.draft_length
        if record.context_length + block - 1 < len(sequence):
            counts["full_rounds"] += 1
            counts["full_accepted"] += lead
            if math.isfinite(record.predicted_acceptance):  # NaN: a lookup round, or no block verified
                counts["head_rounds"] += 1
                counts["head_error"] += abs(record.predicted_acceptance - realised_acceptance(lead, block))
            for j in range(lead):
                counts["reached"][j] += 1
    return counts


def _domain_summary(counts: list[dict]) -> dict:
    total = {k: sum(c[k] for c in counts) for k in counts[0] if k != "reached"}
    reached = [sum(column) for column in zip(*(c["reached"] for c in counts))]
    full, verifies = total["full_rounds"], total["verifies"]
    return {
        "tau": tau_of(total["accepted"] + verifies, verifies),
        "tau_full": 1.0 + total["full_accepted"] / full if full else 0.0,
        "acceptance_rate": total["accepted"] / total["drafted"] if total["drafted"] else 0.0,
        "mean_verify_length": total["drafted"] / verifies if verifies else 0.0,
        "per_position": [r / full if full else 0.0 for r in reached],
        "head_error": total["head_error"] / total["head_rounds"] if total["head_rounds"] else float("nan"),
        "verifies": verifies,
        "full_rounds": full,
        # per prompt, at ACCEPTED, VERIFIES, FULL_ROUNDS, FULL_ACCEPTED: the bootstrap intervals (tau_interval)
        "per_prompt": [[c["accepted"], c["verifies"], c["full_rounds"], c["full_accepted"]] for c in counts],
    }


# ---------------------------------------------------------------------------------------------- a drafter's rounds
def acceptance_per_position(verified: list[int], accepted: list[int]) -> list[float | None]:
    """P(draft j accepted | draft j verified) for j = 1..max verified; None where never verified."""
    width = max(verified, default=0)
    out = []
    for j in range(width):
        attempts = sum(k > j for k in verified)
        out.append(sum(a > j for a, k in zip(accepted, verified) if k > j) / attempts if attempts else None)
    return out


def length_head_figures(stats: list[dict]) -> dict:
    """Of ``stats`` (``AdaFlashStats.to_dict()``, one per call), the diffusion rounds' k̂ histogram
    (``k_hat_histogram[k]``: rounds that verified k drafts) and the length head's mean |â - a*|, where a* = accepted /
    (block_size - 1) is the realised fraction of the whole block. a* is known exactly only in rounds that rejected a
    verified draft (a round that accepted all k̂ would have accepted k̂ or more of the full block), so the error is
    over those rounds; ``head_censored`` is the share of the others.
    """
    block = stats[0]["block_size"]
    rounds = [
        (k, a, p)
        for s in stats
        for k, a, p, source in zip(
            s["verify_lengths"], s["accepted_lengths"], s["predicted_acceptance"], s["sources"]
        )
        if source == "diffusion"
    ]
    histogram = [0] * block
    for k, _, _ in rounds:
        histogram[k] += 1
    exact = [
        float(length_head_error(torch.tensor(p), realised_acceptance(torch.tensor(a), block)))
        for k, a, p in rounds
        if a < k
    ]
    return {
        "k_hat_histogram": histogram,
        "head_abs_error": statistics.fmean(exact) if exact else None,
        "head_censored": 1 - len(exact) / len(rounds) if rounds else None,
    }


# ---------------------------------------------------------------------------------------------- intervals
def pooled_tau(rows: list[list[float]]) -> float:
    """τ of per-prompt counts: committed tokens per verify, pooled over the prompts."""
    verifies = sum(r[VERIFIES] for r in rows)
    return tau_of(sum(r[ACCEPTED] for r in rows) + verifies, verifies)


def bootstrap(statistic, *paired: list, resamples: int = RESAMPLES, seed: int = 0) -> tuple[float, float]:
    """95% percentile interval of ``statistic(*resampled)`` over ``resamples`` resamples of the prompts with
    replacement, every list in ``paired`` resampled with the same prompt indices (they hold the same prompts in the
    same order)."""
    sizes = {len(p) for p in paired}
    if len(sizes) != 1 or 0 in sizes:
        raise ValueError(
            f"paired: expected non-empty per-prompt lists of one length, got lengths {sorted(sizes)}"
        )
    (n,) = sizes
    rng = random.Random(seed)
    values = []
    for _ in range(resamples):
        picks = [rng.randrange(n) for _ in range(n)]
        values.append(statistic(*[[p[i] for i in picks] for p in paired]))
    values.sort()
    return values[int(0.025 * (resamples - 1))], values[int(0.975 * (resamples - 1))]


def tau_interval(summary: dict) -> tuple[float, float]:
    return bootstrap(pooled_tau, summary["per_prompt"])


# ---------------------------------------------------------------------------------------------- a run's metrics
def read_metrics(run_dir: Path) -> list[dict]:
    """The rows of a run's ``metrics.csv`` (one per round, ``online.loop.MetricsLogger``), numbers as floats; none if
    the run wrote none."""
    path = run_dir / "metrics.csv"
    if not path.is_file():
        return []
    with open(path, newline="") as handle:
        return [{k: _number(v) for k, v in row.items()} for row in csv.DictReader(handle)]


def _number(value: str):
    try:
        return float(value)
    except (TypeError, ValueError):
        return value
