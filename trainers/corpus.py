"""The drafter training corpus builder (``adaflash corpus``): prompts with the target's own greedy responses, and the
target features seen on the way.

DFlash/SpecForge train on the target's own greedy responses. On a CPU the target's forward passes are the expensive
part (SmolLM2-135M: ~170 generated tokens/s at batch 64 on 2 cores, ~340 tokens/s of prefill), so the builder runs its
own batched greedy loop and keeps, for every sequence, the hidden states of the tapped target layers that the loop
computes anyway (``target_features.target_pass``): the drafter's context features then cost nothing extra at training
time.

    adaflash corpus --out-dir runs/corpus --features-dir runs/features \
        --chat 6000 --code 3325 --math 4000 --time-budget 3600     # resumable: run again to continue

It appends, per domain and as the loop goes (an interrupted run resumes where it stopped), the files
``corpus_format.py`` describes: the token ids (small enough to commit), the feature files, and the settings that
shaped the corpus. A resumed run with other settings is refused (``--rebuild`` starts those domains afresh), so a
corpus never mixes, say, 16- and 32-token answers. Features missing from ``features_dir`` (a fresh checkout: they are
not committed) are rebuilt from the committed token ids by one teacher-forced forward per batch, far cheaper than
regenerating.
"""

from __future__ import annotations

import argparse
import gzip
import json
import time
from collections.abc import Iterable
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache
from transformers.utils import logging

from adaflash_hf.assets import DEFAULT_TARGET, load_target, load_target_config
from adaflash_hf.atomic import blocking_file
from adaflash_hf.data import load_domain, prompt_ids
from adaflash_hf.launch import CONFIG_HELP, parse_args_with_config
from adaflash_hf.trainers.corpus_format import (
    check_settings,
    corpus_file,
    features_complete,
    is_truncated,
    read_jsonl_gz,
    save_features,
    stored_distribution,
)
from adaflash_hf.trainers.target_features import target_pass

logger = logging.get_logger(__name__)

# The union of DFlash's 3- and 5-layer choices for a 30-layer target (build_target_layer_ids): [1, 14, 27] and
# [1, 7, 14, 20, 27]; capturing all five lets one corpus feed either drafter shape.
SMOLLM2_CAPTURE_LAYERS = (1, 7, 14, 20, 27)


@torch.no_grad()
def build_corpus(
    target,
    tokenizer,
    rows: Iterable[dict],
    out_dir: str | Path,
    features_dir: str | Path | None = None,
    *,
    layer_ids: Iterable[int] = SMOLLM2_CAPTURE_LAYERS,
    max_new_tokens: int = 128,
    max_prompt_tokens: int = 256,
    batch_size: int = 64,
    time_budget_s: float | None = None,
    topk: int = 32,
    target_name: str | None = None,
    rebuild: bool = False,
) -> dict:
    """Regenerate greedy responses for ``rows`` (``id``, ``domain``, ``prompt``) and append them to the corpus.

    Rows already in the corpus are skipped (resume); their features, if missing from ``features_dir`` or recorded
    with other layers or top-k, are rebuilt first (``rebuild_features``). ``rebuild`` drops the corpus files of the
    rows' domains and starts afresh. Batches hold prompts of similar length, one domain each, taken from each domain
    in turn so a run stopped early (``time_budget_s``) still covers every domain. Returns throughput figures:
    sequences, generated tokens, seconds, generated tokens/s, rebuilt features, and the prompts dropped for being
    longer than ``max_prompt_tokens`` (also logged as a warning).
    """
    rows = list(rows)
    layer_ids = sorted(set(layer_ids))
    out_dir = Path(out_dir)
    settings = {
        "target": target_name or getattr(target, "name_or_path", None) or type(target).__name__,
        "dtype": str(next(target.parameters()).dtype).removeprefix("torch."),
        "max_new_tokens": max_new_tokens,
        "layer_ids": layer_ids,
        "topk": topk,
    }
    check_settings(out_dir, settings, rebuild)
    domains = sorted({row["domain"] for row in rows})
    if rebuild:
        for domain in domains:
            corpus_file(out_dir, domain).unlink(missing_ok=True)
    started = time.perf_counter()
    rebuilt = 0
    if features_dir is not None:
        files = [corpus_file(out_dir, d) for d in domains if corpus_file(out_dir, d).is_file()]
        existing = [r for path in files for r in read_jsonl_gz(path)]
        rebuilt = rebuild_features(
            target, existing, features_dir, layer_ids, topk, time_budget_s=time_budget_s
        )
    todo, dropped = _rows_to_regenerate(tokenizer, rows, out_dir, max_prompt_tokens)
    _warn_dropped(dropped, max_prompt_tokens)
    batches = _batches(todo, batch_size)

    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    generated, sequences = 0, 0
    for batch in tqdm(batches, desc="regenerating responses", unit="batch"):
        if time_budget_s is not None and time.perf_counter() - started > time_budget_s:
            logger.info(f"time budget of {time_budget_s:.0f} s spent; stopping (resume later)")
            break
        prompts = [ids for _, ids in batch]
        generated += _append_batch(
            out_dir,
            features_dir,
            batch,
            greedy_with_features(target, prompts, layer_ids, max_new_tokens, eos, pad, topk=topk),
            layer_ids,
        )
        sequences += len(batch)
    seconds = time.perf_counter() - started
    stats = {
        "sequences": sequences,
        "generated_tokens": generated,
        "seconds": seconds,
        "tokens_per_s": generated / seconds if seconds else 0.0,
        "rebuilt_features": rebuilt,
        "dropped_long_prompts": sum(dropped.values()),
    }
    logger.info(f"corpus: {stats}")
    return stats


def _warn_dropped(dropped: dict[str, int], max_prompt_tokens: int) -> None:
    """One warning for the prompts longer than ``max_prompt_tokens``, counted per domain (none: nothing to say)."""
    if dropped:
        per_domain = ", ".join(f"{domain}: {count}" for domain, count in sorted(dropped.items()))
        logger.warning(
            f"corpus: dropped {sum(dropped.values())} prompt(s) longer than --max-prompt-tokens "
            f"{max_prompt_tokens} tokens ({per_domain}); raise it to keep them"
        )


def _append_batch(
    out_dir: Path,
    features_dir: str | Path | None,
    batch: list[tuple[dict, list[int]]],
    generated: tuple[list[list[int]], list[torch.Tensor], list],
    layer_ids: list[int],
) -> int:
    """Append one batch's records (``generated``: what ``greedy_with_features`` returned for it) to its domain's corpus
    file, with their feature files; returns the generated tokens."""
    domain = batch[0][0]["domain"]
    tokens = 0
    with gzip.open(corpus_file(out_dir, domain), "at") as handle:
        for (row, prompt), response, feature, distribution in zip(batch, *generated):
            record = {
                "id": row["id"],
                "domain": domain,
                "input_ids": prompt + response,
                "prompt_length": len(prompt),
            }
            if features_dir is not None:
                save_features(features_dir, record, feature, layer_ids, distribution)
            handle.write(json.dumps(record) + "\n")
            tokens += len(response)
    return tokens


@torch.no_grad()
def rebuild_features(
    target,
    records: list[dict],
    features_dir: str | Path,
    layer_ids: list[int],
    topk: int = 32,
    batch_size: int = 8,
    time_budget_s: float | None = None,
) -> int:
    """Recompute, by teacher-forced forwards over the committed token ids, the feature files of ``records`` that are
    missing or lack ``layer_ids`` / top-k; returns how many were written. The tapped layers and the distributions
    equal those of the greedy loop up to batched-kernel numerics."""
    todo = [r for r in records if not features_complete(features_dir, r, layer_ids, topk)]
    if not todo:
        return 0
    todo.sort(key=lambda r: len(r["input_ids"]))
    started = time.perf_counter()
    device = next(target.parameters()).device
    written = 0
    for start in tqdm(range(0, len(todo), batch_size), desc="rebuilding features", unit="batch"):
        if time_budget_s is not None and time.perf_counter() - started > time_budget_s:
            break
        batch = todo[start : start + batch_size]
        width = max(len(r["input_ids"]) for r in batch)
        # Right padding: a causal position never sees the pad after it, so no position ids or mask tricks.
        input_ids = torch.zeros((len(batch), width), dtype=torch.long)
        attention = torch.zeros((len(batch), width), dtype=torch.long)
        for i, r in enumerate(batch):
            input_ids[i, : len(r["input_ids"])] = torch.tensor(r["input_ids"])
            attention[i, : len(r["input_ids"])] = 1
        # Logits only from the first response row of the batch on: prompt rows need no distribution.
        first = min(r["prompt_length"] for r in batch) - 1
        passed = target_pass(
            target,
            input_ids.to(device),
            layer_ids,
            attention_mask=attention.to(device),
            logits_to_keep=torch.arange(first, width - 1, device=device) if topk else 1,
            topk=topk,
        )
        for i, r in enumerate(batch):
            n, prompt = len(r["input_ids"]), r["prompt_length"]
            feature = passed.states[i, : n - 1].to(torch.bfloat16)
            rows = slice(prompt - 1 - first, n - 1 - first)  # the positions before each response token
            distribution = (
                stored_distribution(passed.topk_ids[i, rows], passed.topk_logprobs[i, rows]) if topk else None
            )
            save_features(features_dir, r, feature.contiguous(), layer_ids, distribution)
            written += 1
    return written


def _rows_to_regenerate(
    tokenizer, rows: Iterable[dict], out_dir: Path, max_prompt_tokens: int
) -> tuple[dict[str, list[tuple[dict, list[int]]]], dict[str, int]]:
    """Per domain, the ``(row, prompt ids)`` not yet in the corpus whose prompt fits, and per domain the count of
    rows dropped for a longer prompt; a corpus file cut mid-record is rewritten with its complete records first."""
    todo: dict[str, list[tuple[dict, list[int]]]] = {}
    dropped: dict[str, int] = {}
    done: dict[str, set[str]] = {}
    for row in rows:
        domain = row["domain"]
        if domain not in done:
            path = corpus_file(out_dir, domain)
            existing = read_jsonl_gz(path) if path.is_file() else []
            if existing and is_truncated(path):
                # Members appended after a broken one would be unreadable: rewrite the complete records first.
                with gzip.open(path, "wt") as handle:
                    handle.writelines(json.dumps(r) + "\n" for r in existing)
            done[domain] = {r["id"] for r in existing}
        if row["id"] in done[domain]:
            continue
        ids = prompt_ids(tokenizer, row, max_prompt_tokens, too_long="skip")
        if ids is not None:
            todo.setdefault(domain, []).append((row, ids[0].tolist()))
        else:
            dropped[domain] = dropped.get(domain, 0) + 1
    return todo, dropped


def _batches(
    todo: dict[str, list[tuple[dict, list[int]]]], batch_size: int
) -> list[list[tuple[dict, list[int]]]]:
    """Batches of one domain each, taken from the domains in turn."""
    chunks = []
    for items in todo.values():
        # Similar lengths per batch (less padding), but sorted only within windows of 8 batches in the given order:
        # a run stopped by its time budget then holds prompts of every length, not just the shortest ones.
        window = 8 * batch_size
        items = [
            x
            for i in range(0, len(items), window)
            for x in sorted(items[i : i + window], key=lambda x: len(x[1]))
        ]
        chunks.append([items[i : i + batch_size] for i in range(0, len(items), batch_size)])
    return [b for group in _round_robin(chunks) for b in group]


def _round_robin(chunks: list[list]) -> Iterable[list]:
    longest = max((len(c) for c in chunks), default=0)
    for i in range(longest):
        yield [c[i] for c in chunks if i < len(c)]


def greedy_with_features(
    target,
    prompts: list[list[int]],
    layer_ids: list[int],
    max_new_tokens: int,
    eos: int | None,
    pad: int,
    topk: int = 0,
) -> tuple[list[list[int]], list[torch.Tensor], list[tuple[torch.Tensor, torch.Tensor] | None]]:
    """Batched greedy decoding (left-padded) that also returns each sequence's tapped hidden states.

    Returns per prompt the response (up to and including EOS), ``features`` [len(prompt + response) - 1,
    len(layer_ids), H] bf16, and with ``topk`` > 0 the target's top-k distribution over each response token
    (``(ids [R, topk] int32, log-probs fp16)``, else None). Finished rows leave the batch (their cache rows are
    dropped), so a batch costs what its longest response costs only for the rows still running.
    """
    device = next(target.parameters()).device
    width = max(len(p) for p in prompts)
    input_ids, attention = _left_padded(prompts, width, pad, device)
    position_ids = (attention.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache()
    step = target_pass(
        target,
        input_ids,
        layer_ids,
        attention_mask=attention,
        position_ids=position_ids,
        cache=cache,
        topk=topk,
    )
    # Per row: the list of [n, n_layers, H] feature pieces (copies: the batch's tensors can go) and the tokens.
    pieces = [[_bf16(step.states[i, width - len(p) :])] for i, p in enumerate(prompts)]
    responses: list[list[int]] = [[] for _ in prompts]
    distributions: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in prompts]
    alive = list(range(len(prompts)))  # original row index of every row still in the batch
    next_pos = position_ids[:, -1]
    for _ in range(max_new_tokens):
        tokens = step.logits[:, -1].argmax(-1)
        still = []
        for slot, row in enumerate(alive):
            token = int(tokens[slot])
            responses[row].append(token)
            if topk:
                distributions[row].append((step.topk_ids[slot, -1], step.topk_logprobs[slot, -1]))
            if token != eos and len(responses[row]) < max_new_tokens:
                still.append(slot)
        if not still:
            break
        if len(still) < len(alive):
            keep = torch.tensor(still, device=device)
            cache.batch_select_indices(keep)
            tokens, attention, next_pos = tokens[keep], attention[keep], next_pos[keep]
            alive = [alive[s] for s in still]
        next_pos = next_pos + 1
        attention = torch.cat([attention, attention.new_ones(len(alive), 1)], dim=1)
        step = target_pass(
            target,
            tokens[:, None],
            layer_ids,
            attention_mask=attention,
            position_ids=next_pos[:, None],
            cache=cache,
            topk=topk,
        )
        for slot, row in enumerate(alive):
            pieces[row].append(_bf16(step.states[slot]))
    features = []
    for row, prompt in enumerate(prompts):
        stacked = torch.cat(pieces[row], dim=0)
        # The feature of the last response token is never computed (it was not fed back), and never needed.
        assert stacked.shape[0] == len(prompt) + len(responses[row]) - 1, (stacked.shape, len(prompt))
        features.append(stacked.to(torch.bfloat16).contiguous())
    return responses, features, [_stacked_distribution(rows) for rows in distributions]


def _bf16(states: torch.Tensor) -> torch.Tensor:
    return states.to(torch.bfloat16, copy=True)


def _left_padded(prompts: list[list[int]], width: int, pad: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask)`` [len(prompts), width] of ``prompts`` padded on the left with ``pad``."""
    input_ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    attention = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, ids in enumerate(prompts):
        input_ids[i, width - len(ids) :] = torch.tensor(ids)
        attention[i, width - len(ids) :] = 1
    return input_ids.to(device), attention.to(device)


def _stacked_distribution(
    rows: list[tuple[torch.Tensor, torch.Tensor]],
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """One response's per-token top-k ``(ids, log-probs)`` stacked to ``[R, k]`` each as a feature file keeps them,
    or None without any."""
    return (
        stored_distribution(torch.stack([i for i, _ in rows]), torch.stack([v for _, v in rows]))
        if rows
        else None
    )


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="adaflash corpus",
        description="Regenerate the drafter training corpus (resumable), with target features.",
    )
    parser.add_argument(
        "--target", default=DEFAULT_TARGET, help="target causal LM (default: the offline SmolLM2)"
    )
    parser.add_argument(
        "--out-dir",
        default="runs/corpus",
        help="token-id corpus (<domain>.jsonl.gz); the shipped drafter's is examples/corpus/smollm2",
    )
    parser.add_argument(
        "--features-dir",
        default=None,
        help="where to keep the tapped target features (none kept if omitted); missing ones are rebuilt",
    )
    for domain, default in (("chat", 6000), ("code", 3325), ("math", 4000)):
        parser.add_argument(
            f"--{domain}", type=int, default=default, help=f"{domain} train prompts (0 = none)"
        )
    parser.add_argument(
        "--split", default="train", choices=("train", "heldout"), help="which split's prompts"
    )
    parser.add_argument("--seed", type=int, default=0, help="shuffle seed of each domain's split")
    parser.add_argument("--layer-ids", type=int, nargs="+", default=list(SMOLLM2_CAPTURE_LAYERS))
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--max-prompt-tokens", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument(
        "--topk",
        type=int,
        default=32,
        help="record the target's top-k distribution per response token (0 = none)",
    )
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=("float32", "bfloat16"),
        help="the target's dtype while regenerating",
    )
    parser.add_argument(
        "--rebuild",
        action="store_true",
        help="drop the corpus files of the chosen domains and regenerate them",
    )
    parser.add_argument(
        "--time-budget", type=float, default=None, help="stop after this many seconds (resume later)"
    )
    parser.add_argument("--config", metavar="FILE", help=CONFIG_HELP)
    return parser


def _check_args(args) -> None:
    """Every check that needs no model, before the prompts or the target load."""
    for name in ("chat", "code", "math", "topk"):
        if getattr(args, name) < 0:
            raise ValueError(f"--{name}: expected a count >= 0, got {getattr(args, name)}")
    for name in ("max_new_tokens", "max_prompt_tokens", "batch_size"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}: expected an int >= 1, got {getattr(args, name)}")
    for name in ("out_dir", "features_dir"):
        path = getattr(args, name)
        blocker = blocking_file(path) if path is not None else None
        if blocker is not None and blocker == Path(path):
            raise ValueError(
                f"--{name.replace('_', '-')}: expected a folder (or a new path), got the file {path}"
            )
        if blocker is not None:
            raise ValueError(
                f"--{name.replace('_', '-')}: expected a folder (or a new path), got {path}, inside the file "
                f"{blocker}"
            )
    if any(i < 0 for i in args.layer_ids):
        raise ValueError(f"--layer-ids: expected layer indices >= 0, got {args.layer_ids}")


def main(argv: list[str] | None = None) -> dict:
    parser = make_parser()
    args = parse_args_with_config(parser, argv)
    _check_args(args)
    counts = {"chat": args.chat, "code": args.code, "math": args.math}
    # Every prompt source is loaded before the target: a missing package fails here, saying how to install it.
    rows = [
        row
        for domain, n in counts.items()
        if n
        for row in load_domain(domain, args.split, n=n, seed=args.seed)
    ]
    layers = load_target_config(args.target, option="--target").get_text_config().num_hidden_layers
    if max(args.layer_ids) >= layers:
        raise ValueError(
            f"--layer-ids: expected decoder layers of {args.target} in 0..{layers - 1}, got {args.layer_ids}"
        )
    target, tokenizer = load_target(args.target, dtype=getattr(torch, args.dtype), option="--target")
    return build_corpus(
        target,
        tokenizer,
        rows,
        args.out_dir,
        args.features_dir,
        layer_ids=args.layer_ids,
        max_new_tokens=args.max_new_tokens,
        max_prompt_tokens=args.max_prompt_tokens,
        batch_size=args.batch_size,
        time_budget_s=args.time_budget,
        topk=args.topk,
        target_name=args.target,
        rebuild=args.rebuild,
    )


if __name__ == "__main__":
    logging.set_verbosity_info()
    print(json.dumps(main()))
