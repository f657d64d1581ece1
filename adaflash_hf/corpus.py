"""The drafter training corpus: prompts with the target's own greedy responses, and the target features seen on the way.

DFlash/SpecForge train on the target's own greedy responses. On a CPU the target's forward passes are the expensive
part (SmolLM2-135M: ~170 generated tokens/s at batch 64 on 2 cores, ~340 tokens/s of prefill), so the corpus builder
runs its own batched greedy loop and keeps, for every sequence, the hidden states of the tapped target layers that the
loop computes anyway: the drafter's context features then cost nothing extra at training time.

    adaflash corpus --out-dir examples/corpus/smollm2 --features-dir runs/features/smollm2 \
        --chat 6000 --code 3325 --math 4000 --time-budget 3600     # resumable: run again to continue

Outputs, per domain (appended as the loop goes, so an interrupted run resumes where it stopped):
- ``<out_dir>/<domain>.jsonl.gz``: one record ``{"id", "domain", "input_ids", "prompt_length"}`` per line (gzip
  members appended batch by batch; small enough to commit);
- ``<features_dir>/<domain>/<sha1(id)>.safetensors``: ``features`` [len(input_ids) - 1, n_layers, hidden] bf16 (the
  outputs of ``layer_ids``, i.e. ``hidden_states[id + 1]``, for every position but the last, which no anchor's context
  reaches), with the layer ids in the file's metadata.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import time
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm
from transformers import DynamicCache
from transformers.utils import logging

from adaflash_hf.assets import DEFAULT_TARGET, chat_prompt_ids, load_target
from adaflash_hf.cli import CONFIG_HELP, parse_args_with_config
from adaflash_hf.data import load_domain

logger = logging.get_logger(__name__)

# The union of DFlash's 3- and 5-layer choices for a 30-layer target (build_target_layer_ids): [1, 14, 27] and
# [1, 7, 14, 20, 27]; capturing all five lets one corpus feed either drafter shape.
SMOLLM2_CAPTURE_LAYERS = (1, 7, 14, 20, 27)


def corpus_file(out_dir: str | Path, domain: str) -> Path:
    return Path(out_dir) / f"{domain}.jsonl.gz"


def feature_file(features_dir: str | Path, record: dict) -> Path:
    digest = hashlib.sha1(record["id"].encode()).hexdigest()[:24]
    return Path(features_dir) / record["domain"] / f"{digest}.safetensors"


def read_corpus(out_dir: str | Path, domains: Iterable[str]) -> list[dict]:
    """Records of ``domains`` from ``out_dir``, in file order; a missing domain file is an error naming it."""
    records = []
    for domain in domains:
        path = corpus_file(out_dir, domain)
        if not path.is_file():
            raise FileNotFoundError(
                f"corpus file: expected {path} (build it with `adaflash corpus --out-dir {out_dir}`), found nothing"
            )
        records.extend(_read_jsonl_gz(path))
    return records


def _read_jsonl_gz(path: Path) -> list[dict]:
    records = []
    try:
        with gzip.open(path, "rt") as handle:
            for line in handle:
                if line.strip():
                    records.append(json.loads(line))
    except (EOFError, json.JSONDecodeError):
        # A run killed mid-write leaves a truncated last member: the complete records before it are kept.
        logger.warning(f"{path}: truncated after {len(records)} records (interrupted run); keeping those")
    return records


def _is_truncated(path: Path) -> bool:
    try:
        with gzip.open(path, "rb") as handle:
            while handle.read(1 << 20):
                pass
    except EOFError:
        return True
    return False


def load_features(features_dir: str | Path, record: dict, layer_ids: list[int]) -> torch.Tensor | None:
    """Context features ``cat(hidden_states[id + 1] for id in layer_ids)`` [len - 1, n * H] bf16, or None if absent."""
    path = feature_file(features_dir, record)
    if not path.is_file():
        return None
    from safetensors import safe_open

    with safe_open(path, framework="pt") as handle:
        stored = [int(i) for i in handle.metadata()["layer_ids"].split(",")]
    missing = [i for i in layer_ids if i not in stored]
    if missing:
        raise ValueError(
            f"features of {record['id']}: expected layers {layer_ids}, file {path} has only {stored}"
        )
    features = load_file(path)["features"]  # [L - 1, n_stored, H]
    return features[:, [stored.index(i) for i in layer_ids]].flatten(1)


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
) -> dict:
    """Regenerate greedy responses for ``rows`` (``id``, ``domain``, ``prompt``) and append them to the corpus.

    Rows already in the corpus are skipped (resume). Batches hold prompts of similar length, one domain each, taken
    from each domain in turn so a run stopped early (``time_budget_s``) still covers every domain. Returns throughput
    figures: sequences, generated tokens, seconds, generated tokens/s.
    """
    layer_ids = sorted(set(layer_ids))
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    batches = _batches(_rows_to_regenerate(tokenizer, rows, out_dir, max_prompt_tokens), batch_size)

    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    started, generated, sequences = time.perf_counter(), 0, 0
    for batch in tqdm(batches, desc="regenerating responses", unit="batch"):
        if time_budget_s is not None and time.perf_counter() - started > time_budget_s:
            logger.info(f"time budget of {time_budget_s:.0f} s spent; stopping (resume later)")
            break
        prompts = [ids for _, ids in batch]
        responses, features = greedy_with_features(target, prompts, layer_ids, max_new_tokens, eos, pad)
        domain = batch[0][0]["domain"]
        with gzip.open(corpus_file(out_dir, domain), "at") as handle:
            for (row, prompt_ids), response, feature in zip(batch, responses, features):
                record = {
                    "id": row["id"],
                    "domain": domain,
                    "input_ids": prompt_ids + response,
                    "prompt_length": len(prompt_ids),
                }
                if features_dir is not None:
                    path = feature_file(features_dir, record)
                    path.parent.mkdir(parents=True, exist_ok=True)
                    save_file(
                        {"features": feature}, path, metadata={"layer_ids": ",".join(map(str, layer_ids))}
                    )
                handle.write(json.dumps(record) + "\n")
                generated += len(response)
                sequences += 1
    seconds = time.perf_counter() - started
    stats = {
        "sequences": sequences,
        "generated_tokens": generated,
        "seconds": seconds,
        "tokens_per_s": generated / seconds if seconds else 0.0,
    }
    logger.info(f"corpus: {stats}")
    return stats


def _rows_to_regenerate(
    tokenizer, rows: Iterable[dict], out_dir: Path, max_prompt_tokens: int
) -> dict[str, list[tuple[dict, list[int]]]]:
    """Per domain, the ``(row, prompt ids)`` not yet in the corpus whose prompt fits; a corpus file cut mid-record is
    rewritten with its complete records first."""
    todo: dict[str, list[tuple[dict, list[int]]]] = {}
    done: dict[str, set[str]] = {}
    for row in rows:
        domain = row["domain"]
        if domain not in done:
            path = corpus_file(out_dir, domain)
            existing = _read_jsonl_gz(path) if path.is_file() else []
            if existing and _is_truncated(path):
                # Members appended after a broken one would be unreadable: rewrite the complete records first.
                with gzip.open(path, "wt") as handle:
                    handle.writelines(json.dumps(r) + "\n" for r in existing)
            done[domain] = {r["id"] for r in existing}
        if row["id"] in done[domain]:
            continue
        prompt_ids = chat_prompt_ids(tokenizer, row["prompt"])[0].tolist()
        if len(prompt_ids) <= max_prompt_tokens:
            todo.setdefault(domain, []).append((row, prompt_ids))
    return todo


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
    target, prompts: list[list[int]], layer_ids: list[int], max_new_tokens: int, eos: int | None, pad: int
) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Batched greedy decoding (left-padded) that also returns each sequence's tapped hidden states.

    Returns per prompt the response (up to and including EOS) and ``features`` [len(prompt + response) - 1,
    len(layer_ids), H] bf16. Finished rows leave the batch (their cache rows are dropped), so a batch costs what its
    longest response costs only for the rows still running.
    """
    device = next(target.parameters()).device
    layers = target.get_decoder().layers
    captured: dict[int, torch.Tensor] = {}
    hooks = [
        layers[i].register_forward_hook(lambda _m, _a, out, i=i: captured.__setitem__(i, _first(out)))
        for i in layer_ids
    ]
    try:
        width = max(len(p) for p in prompts)
        batch = len(prompts)
        input_ids = torch.full((batch, width), pad, dtype=torch.long)
        attention = torch.zeros((batch, width), dtype=torch.long)
        for i, ids in enumerate(prompts):
            input_ids[i, width - len(ids) :] = torch.tensor(ids)
            attention[i, width - len(ids) :] = 1
        input_ids, attention = input_ids.to(device), attention.to(device)
        position_ids = (attention.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache()
        out = target(
            input_ids=input_ids,
            attention_mask=attention,
            position_ids=position_ids,
            cache=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        # Per row: the list of [n, n_layers, H] feature pieces and the generated tokens.
        pieces = [[_stack(captured, layer_ids, i)[width - len(p) :]] for i, p in enumerate(prompts)]
        responses: list[list[int]] = [[] for _ in prompts]
        alive = list(range(batch))  # original row index of every row still in the batch
        next_pos = position_ids[:, -1]
        for _ in range(max_new_tokens):
            tokens = out.logits[:, -1].argmax(-1)
            still = []
            for slot, row in enumerate(alive):
                token = int(tokens[slot])
                responses[row].append(token)
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
            out = target(
                input_ids=tokens[:, None],
                attention_mask=attention,
                position_ids=next_pos[:, None],
                cache=cache,
                use_cache=True,
            )
            for slot, row in enumerate(alive):
                pieces[row].append(_stack(captured, layer_ids, slot))
    finally:
        for hook in hooks:
            hook.remove()
    features = []
    for row, prompt in enumerate(prompts):
        stacked = torch.cat(pieces[row], dim=0)
        # The feature of the last response token is never computed (it was not fed back), and never needed.
        assert stacked.shape[0] == len(prompt) + len(responses[row]) - 1, (stacked.shape, len(prompt))
        features.append(stacked.to(torch.bfloat16).contiguous())
    return responses, features


def _first(output):
    return output[0] if isinstance(output, tuple) else output


def _stack(captured: dict[int, torch.Tensor], layer_ids: list[int], row: int) -> torch.Tensor:
    # captured[i]: [B, n, H] output of layer i -> [n, n_layers, H] for one row (cloned so the batch can be freed)
    return torch.stack([captured[i][row] for i in layer_ids], dim=1).to(torch.bfloat16)


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="adaflash corpus",
        description="Regenerate the drafter training corpus (resumable), with target features.",
    )
    parser.add_argument(
        "--target", default=DEFAULT_TARGET, help="target causal LM (default: the offline SmolLM2)"
    )
    parser.add_argument(
        "--out-dir", default="examples/corpus/smollm2", help="token-id corpus (<domain>.jsonl.gz)"
    )
    parser.add_argument(
        "--features-dir", default=None, help="where to keep the tapped target features (none kept if omitted)"
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
        "--time-budget", type=float, default=None, help="stop after this many seconds (resume later)"
    )
    parser.add_argument("--config", metavar="FILE", help=CONFIG_HELP)
    return parser


def main(argv: list[str] | None = None) -> dict:
    parser = make_parser()
    args = parse_args_with_config(parser, argv)
    counts = {"chat": args.chat, "code": args.code, "math": args.math}
    for domain, count in counts.items():
        if count < 0:
            raise ValueError(f"--{domain}: expected a count >= 0, got {count}")
    # Every prompt source is loaded before the target: a missing package fails here, saying how to install it.
    rows = [
        row
        for domain, n in counts.items()
        if n
        for row in load_domain(domain, args.split, n=n, seed=args.seed)
    ]
    target, tokenizer = load_target(args.target)
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
    )


if __name__ == "__main__":
    logging.set_verbosity_info()
    print(json.dumps(main()))
