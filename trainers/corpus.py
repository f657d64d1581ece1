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
  reaches), with the layer ids in the file's metadata; with ``topk`` > 0 also the target's distribution over each
  response token, ``topk_ids`` [len(response), topk] int32 and ``topk_logprobs`` fp16 (log-softmax over the whole
  vocabulary; row r predicts response token r, so under greedy ``topk_ids[r, 0] == response[r]``): the soft targets
  of the drafter's KL arm, from the same forwards.
- ``<out_dir>/corpus_settings.json``: the settings that shaped the corpus (target, dtype, max_new_tokens, layer ids,
  topk). A resumed run with other settings is refused (``--rebuild`` starts those domains afresh), so a corpus never
  mixes, say, 16- and 32-token answers. Features missing from ``features_dir`` (a fresh checkout: they are not
  committed) are rebuilt from the committed token ids by one teacher-forced forward per batch, far cheaper than
  regenerating.
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

from adaflash_hf.assets import DEFAULT_TARGET, load_target, load_target_config
from adaflash_hf.atomic import atomic_write
from adaflash_hf.data import load_domain, prompt_ids
from adaflash_hf.launch import CONFIG_HELP, parse_args_with_config

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


def drop_prompt_twins(records: list[dict], prompts: Iterable[Iterable[int]]) -> tuple[list[dict], int]:
    """``records`` without those whose prompt (``input_ids[:prompt_length]``) is one of ``prompts`` (token ids), and
    how many were dropped: a training sequence whose prompt is also a held-out prompt (ShareGPT repeats some first turns
    under different conversation ids) would inflate every held-out figure."""
    excluded = {tuple(ids) for ids in prompts}
    kept = [r for r in records if tuple(r["input_ids"][: r["prompt_length"]]) not in excluded]
    return kept, len(records) - len(kept)


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


SETTINGS_FILE = "corpus_settings.json"
# Settings that change the token ids (a mismatch is refused) and those that change only the features (rebuilt).
TOKEN_SETTINGS = ("target", "dtype", "max_new_tokens")
FEATURE_SETTINGS = ("layer_ids", "topk")


def check_settings(out_dir: str | Path, settings: dict, rebuild: bool = False) -> list[str]:
    """Compare ``settings`` with those recorded in ``out_dir`` and record them; returns the changed feature settings.

    A corpus written before settings were recorded adopts ``settings`` (with a warning). A different target, dtype or
    ``max_new_tokens`` is an error naming the setting, unless ``rebuild`` (then the caller starts afresh)."""
    path = Path(out_dir) / SETTINGS_FILE
    recorded = json.loads(path.read_text()) if path.is_file() else None
    if recorded is None and any(Path(out_dir).glob("*.jsonl.gz")):
        logger.warning(
            f"{out_dir}: no {SETTINGS_FILE} (a corpus from before settings were kept); recording {settings}"
        )
    changed_features: list[str] = []
    if recorded is not None and not rebuild:
        for name in TOKEN_SETTINGS:
            if recorded.get(name) != settings[name]:
                raise ValueError(
                    f"corpus {out_dir}: expected {name}={recorded.get(name)!r} (the setting its responses were "
                    f"generated with, {path}), got {settings[name]!r}; pass --rebuild to regenerate those domains, or "
                    f"use another --out-dir"
                )
        changed_features = [n for n in FEATURE_SETTINGS if recorded.get(n) != settings[n]]
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(settings, indent=1) + "\n")
    return changed_features


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
    sequences, generated tokens, seconds, generated tokens/s, rebuilt features.
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
        existing = [r for path in files for r in _read_jsonl_gz(path)]
        rebuilt = rebuild_features(
            target, existing, features_dir, layer_ids, topk, time_budget_s=time_budget_s
        )
    batches = _batches(_rows_to_regenerate(tokenizer, rows, out_dir, max_prompt_tokens), batch_size)

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
    }
    logger.info(f"corpus: {stats}")
    return stats


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


def save_features(
    features_dir: str | Path,
    record: dict,
    features: torch.Tensor,
    layer_ids: list[int],
    distribution: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Write one record's feature file (``features``, and ``topk_ids`` / ``topk_logprobs`` when given), atomically:
    a run killed mid-write leaves no half file that a later run would take as complete."""
    path = feature_file(features_dir, record)
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {"features": features}
    if distribution is not None:
        tensors["topk_ids"], tensors["topk_logprobs"] = distribution
    metadata = {"layer_ids": ",".join(map(str, layer_ids))}
    # Not fsynced: a lost file is rebuilt from the committed token ids (rebuild_features), so a power loss costs little.
    atomic_write(path, lambda tmp: save_file(tensors, str(tmp), metadata=metadata), durable=False)


def load_soft_targets(features_dir: str | Path, record: dict) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The target's top-k distribution over each response token, ``(topk_ids [R, k] long, topk_logprobs [R, k]
    float)``, or None when the record's feature file has none."""
    path = feature_file(features_dir, record)
    if not path.is_file():
        return None
    from safetensors import safe_open

    with safe_open(path, framework="pt") as handle:
        if "topk_ids" not in handle.keys():
            return None
        return handle.get_tensor("topk_ids").long(), handle.get_tensor("topk_logprobs").float()


def _features_complete(features_dir: str | Path, record: dict, layer_ids: list[int], topk: int) -> bool:
    path = feature_file(features_dir, record)
    if not path.is_file():
        return False
    from safetensors import safe_open

    try:
        with safe_open(path, framework="pt") as handle:
            stored = [int(i) for i in handle.metadata()["layer_ids"].split(",")]
            has_topk = "topk_ids" in handle.keys() and handle.get_slice("topk_ids").get_shape()[-1] >= topk
    except Exception:  # an unreadable file is rebuilt, not trusted
        return False
    return all(i in stored for i in layer_ids) and (topk == 0 or has_topk)


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
    todo = [r for r in records if not _features_complete(features_dir, r, layer_ids, topk)]
    if not todo:
        return 0
    todo.sort(key=lambda r: len(r["input_ids"]))
    started = time.perf_counter()
    device = next(target.parameters()).device
    hooks, captured = _tap(target, layer_ids)
    written = 0
    try:
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
            # The decoder alone, then the lm_head on the response rows only: prompt rows need no distribution.
            hidden = target.get_decoder()(
                input_ids=input_ids.to(device), attention_mask=attention.to(device)
            ).last_hidden_state
            for i, r in enumerate(batch):
                n, prompt = len(r["input_ids"]), r["prompt_length"]
                feature = _stack(captured, layer_ids, i)[: n - 1]
                logits = target.get_output_embeddings()(hidden[i, prompt - 1 : n - 1]) if topk else None
                distribution = _top_k(logits, topk) if topk else None
                save_features(features_dir, r, feature.contiguous(), layer_ids, distribution)
                written += 1
    finally:
        for hook in hooks:
            hook.remove()
    return written


def _top_k(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids int32, log-probs fp16)`` of the ``k`` likeliest tokens per row of ``logits`` [n, V]."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    values, ids = logprobs.topk(min(k, logprobs.shape[-1]), dim=-1)
    return ids.to(torch.int32).contiguous(), values.clamp(min=-60.0).to(torch.float16).contiguous()


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
        ids = prompt_ids(tokenizer, row, max_prompt_tokens, too_long="skip")
        if ids is not None:
            todo.setdefault(domain, []).append((row, ids[0].tolist()))
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
    hooks, captured = _tap(target, layer_ids)
    try:
        width = max(len(p) for p in prompts)
        input_ids, attention = _left_padded(prompts, width, pad, device)
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
        distributions: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in prompts]
        alive = list(range(len(prompts)))  # original row index of every row still in the batch
        next_pos = position_ids[:, -1]
        for _ in range(max_new_tokens):
            tokens = out.logits[:, -1].argmax(-1)
            top = _top_k(out.logits[:, -1], topk) if topk else None
            still = []
            for slot, row in enumerate(alive):
                token = int(tokens[slot])
                responses[row].append(token)
                if top is not None:
                    distributions[row].append((top[0][slot], top[1][slot]))
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
    return responses, features, [_stacked_distribution(rows) for rows in distributions]


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
    """One response's per-token top-k ``(ids, log-probs)`` stacked to ``[R, k]`` each, or None without any."""
    return (torch.stack([i for i, _ in rows]), torch.stack([v for _, v in rows])) if rows else None


def _tap(target, layer_ids: list[int]) -> tuple[list, dict[int, torch.Tensor]]:
    """Forward hooks that keep the newest output of each tapped decoder layer in ``captured`` (remove them after)."""
    layers = target.get_decoder().layers
    captured: dict[int, torch.Tensor] = {}
    hooks = [
        layers[i].register_forward_hook(lambda _m, _a, out, i=i: captured.__setitem__(i, _first(out)))
        for i in layer_ids
    ]
    return hooks, captured


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
        if path is not None and Path(path).exists() and not Path(path).is_dir():
            raise ValueError(
                f"--{name.replace('_', '-')}: expected a folder (or a new path), got the file {path}"
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
    layers = load_target_config(args.target).get_text_config().num_hidden_layers
    if max(args.layer_ids) >= layers:
        raise ValueError(
            f"--layer-ids: expected decoder layers of {args.target} in 0..{layers - 1}, got {args.layer_ids}"
        )
    target, tokenizer = load_target(args.target, dtype=getattr(torch, args.dtype))
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
