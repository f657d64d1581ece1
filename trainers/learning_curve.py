"""Held-out acceptance of a drafter during training, and the learning curve (JSON + PNG) that records it.

The corpus responses are the target's own greedy outputs, so greedy verification of a block drafted at anchor ``a``
accepts exactly the longest prefix of its drafts that equals the corpus tokens ``a+1, a+2, ...``. Teacher-forced over
the cached target features, that gives the acceptance real ``generate`` would see at every position of held-out
sequences, for the cost of one drafter forward per sequence instead of a generate call per prompt:

- ``first_position``: fraction of blocks whose first draft is accepted;
- ``tau_fixed``: 1 + mean accepted length of the full block (fixed-length DFlash's τ);
- ``acceptance_per_position``: P(accepted >= j) for j = 1..block_size-1.

    curve = LearningCurve(out_dir)        # <out_dir>/learning_curve.{json,png}
    curve.add(blocks_seen, heldout_acceptance(drafter, target, records, features))
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from adaflash_hf.atomic import read_json
from adaflash_hf.draft_vocab import draft_tokens
from adaflash_hf.modeling.length_head_adaflash import length_head_error, realised_acceptance
from adaflash_hf.stats import tau_of
from adaflash_hf.trainers.dflash_recipe import accepted_drafts


@torch.no_grad()
def heldout_acceptance(
    drafter,
    target,
    records: list[dict],
    features: list[torch.Tensor],
    max_anchors: int = 256,
) -> dict[str, dict]:
    """Per domain (and ``"all"``): first-position acceptance, τ of the full block, acceptance per position, blocks, and
    the length head's mean |â - a*| (``head_mae``) and mean â.

    ``records``: corpus records (``input_ids``, ``prompt_length``, ``domain``) of held-out prompts; ``features``: their
    context features [len - 1, n_layers * H] (``corpus_format.load_features``). Anchors are the response positions whose whole
    block lies inside the sequence (evenly thinned to ``max_anchors``), as at inference, where the first anchor is the
    first response token.
    """
    was_training = drafter.training
    drafter.eval()
    block = drafter.config.block_size
    accepted_by_domain: dict[str, list[torch.Tensor]] = defaultdict(list)
    predicted_by_domain: dict[str, list[torch.Tensor]] = defaultdict(list)
    for record, feature in zip(records, features):
        blocks = record_blocks(drafter, target, record, feature, max_anchors)
        if blocks is not None:
            accepted_by_domain[record["domain"]].append(blocks.accepted)
            predicted_by_domain[record["domain"]].append(blocks.predicted)
    drafter.train(was_training)
    results = {
        domain: _summary(torch.cat(values), torch.cat(predicted_by_domain[domain]), block)
        for domain, values in sorted(accepted_by_domain.items())
    }
    if accepted_by_domain:
        results["all"] = _summary(
            torch.cat([v for values in accepted_by_domain.values() for v in values]),
            torch.cat([v for values in predicted_by_domain.values() for v in values]),
            block,
        )
    return results


@dataclass
class RecordBlocks:
    """The blocks of one sequence: per anchor, drafts accepted greedily, the length head's â and its input."""

    anchors: torch.Tensor  # [n]
    accepted: torch.Tensor  # [n] accepted drafts of the block (0..k-1), teacher-forced against the sequence
    predicted: torch.Tensor  # [n] the length head's â
    states: torch.Tensor  # [n, k, H] the block's final drafter states (the length head's input, detached)


@torch.no_grad()
def record_blocks(
    drafter, target, record: dict, feature: torch.Tensor, max_anchors: int = 256
) -> RecordBlocks | None:
    """Draft a block at the response anchors of ``record`` (those whose whole block lies inside the sequence, evenly
    thinned to ``max_anchors``) in one drafter forward and compare each block with the sequence's next tokens. On a
    target's greedy output that is exactly what greedy verification would accept. None when no anchor fits."""
    block = drafter.config.block_size
    embedding = target.get_input_embeddings().weight
    lm_head = target.get_output_embeddings()
    dtype = next(drafter.parameters()).dtype
    ids = torch.tensor(record["input_ids"])
    first, last = record["prompt_length"], len(ids) - block  # anchor a needs tokens a+1 .. a+block-1
    if last < first:
        return None
    anchors = torch.arange(first, last + 1)
    if anchors.numel() > max_anchors:
        anchors = anchors[torch.linspace(0, anchors.numel() - 1, max_anchors).round().long()]
    offsets = torch.arange(block)
    noise_ids = torch.full((anchors.numel(), block), drafter.config.mask_token_id)
    noise_ids[:, 0] = ids[anchors]
    positions = torch.cat([torch.arange(feature.shape[0]), (anchors[:, None] + offsets).flatten()])
    out = drafter(
        noise_embeds=F.embedding(noise_ids.flatten()[None], embedding).to(dtype),
        context_hidden_states=feature[None].to(dtype),
        position_ids=positions[None],
        block_anchors=anchors[None],
    )
    states = out.last_hidden_state.view(anchors.numel(), block, -1)
    drafts = draft_tokens(states[:, 1:].to(lm_head.weight.dtype), lm_head, drafter.draft_token_ids)
    labels = ids[anchors[:, None] + offsets[1:]]
    # Row 0 of each block (the anchor) is never a draft: accepted_drafts skips it.
    correct = F.pad(drafts.cpu() == labels, (1, 0))  # [n, k]
    return RecordBlocks(
        anchors=anchors,
        accepted=accepted_drafts(correct.reshape(1, -1), block)[0],
        predicted=out.acceptance_prob.detach().float().reshape(-1).cpu(),
        states=states.detach(),
    )


def _summary(accepted: torch.Tensor, predicted: torch.Tensor, block: int) -> dict:
    """``head_mae``: the length head's mean |â - a*| against the exact realised fraction a* = accepted / (k-1)."""
    per_position = [float((accepted >= j).float().mean()) for j in range(1, block)]
    return {
        "blocks": int(accepted.numel()),
        "first_position": per_position[0],
        "tau_fixed": tau_of(
            int(accepted.sum()) + accepted.numel(), accepted.numel()
        ),  # every block verified in full
        "acceptance_per_position": per_position,
        "head_mae": float(length_head_error(predicted, realised_acceptance(accepted, block)).mean()),
        "head_mean_predicted": float(predicted.mean()),
    }


class LearningCurve:
    """Points ``{"blocks_seen", "step", "metrics": heldout_acceptance(...)}`` kept in ``<out_dir>/<name>.json`` and
    drawn to ``<name>.png`` from that same JSON (held-out τ and first-position acceptance per domain, log x).

    A curve file already there is another run's, or this run's before a resume. ``claim`` decides which before
    training starts: only the run that wrote it (``meta["run"]``), resumed, may go on with it, and a point it adds
    replaces the points past its restart; a curve is never cut back by a run it does not belong to."""

    def __init__(self, out_dir: str | Path, name: str = "learning_curve", meta: dict | None = None):
        self.json_path = Path(out_dir) / f"{name}.json"
        self.png_path = Path(out_dir) / f"{name}.png"
        self.data = {"meta": meta or {}, "points": []}
        if self.json_path.is_file():
            self.data = read_json(self.json_path)
        self.claimed = False

    def claim(self, run: str | Path, resumed: bool) -> None:
        """Make this curve ``run``'s (its output folder); a curve holding points of any other run, or of this run
        when it starts afresh, is refused with an error naming the folder."""
        points, owner = self.data["points"], self.data.get("meta", {}).get("run")
        if points and not (resumed and owner is not None and Path(owner).resolve() == Path(run).resolve()):
            wrote = f"run {owner}" if owner else "a run that did not record its folder"
            raise ValueError(
                f"learning_curve_dir: expected a folder without another run's curve, got {self.json_path} with "
                f"{len(points)} points of {wrote}; choose another learning_curve_dir (default: output_dir), or "
                "resume that run (--resume_from_checkpoint)"
            )
        self.data.setdefault("meta", {})["run"] = str(run)
        self.claimed = True

    def add(self, blocks_seen: int, metrics: dict, step: int | None = None) -> None:
        later = [p for p in self.data["points"] if p["blocks_seen"] >= blocks_seen]
        if later and not self.claimed:
            raise ValueError(
                f"learning curve {self.json_path}: a point at {blocks_seen} blocks would drop {len(later)} later "
                "points of a run that did not claim this curve (LearningCurve.claim)"
            )
        self.data["points"] = [p for p in self.data["points"] if p["blocks_seen"] < blocks_seen]
        self.data["points"].append({"blocks_seen": int(blocks_seen), "step": step, "metrics": metrics})
        self.json_path.parent.mkdir(parents=True, exist_ok=True)
        self.json_path.write_text(json.dumps(self.data, indent=1))
        plot_learning_curve(self.json_path, self.png_path)


def plot_learning_curve(json_path: str | Path, png_path: str | Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = read_json(json_path)
    points = [p for p in data["points"] if p["blocks_seen"] > 0]
    domains = sorted({d for p in points for d in p["metrics"] if d != "all"})
    panels = [
        ("tau_fixed", "held-out τ (full block, greedy)"),
        ("first_position", "held-out first-position acceptance"),
    ]
    if any(
        "head_mae" in m for p in points for m in p["metrics"].values()
    ):  # curves from before it was recorded
        panels.append(("head_mae", "length head mean |â - a*| (held out)"))
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4))
    for domain in domains:
        for axis, (key, _) in zip(axes, panels):
            shown = [p for p in points if key in p["metrics"].get(domain, {})]
            axis.plot(
                [p["blocks_seen"] for p in shown],
                [p["metrics"][domain][key] for p in shown],
                "o-",
                label=domain,
            )
    stages = data.get("meta", {}).get(
        "stages", {}
    )  # later runs appended to this curve, each from its own offset
    for axis, (_, title) in zip(axes, panels):
        for stage, info in stages.items():
            axis.axvline(info["offset_blocks"], color="grey", linestyle=":", linewidth=1)
            axis.annotate(
                stage,
                (info["offset_blocks"], 0.98),
                xycoords=("data", "axes fraction"),
                rotation=90,
                fontsize=7,
                color="grey",
                ha="right",
                va="top",
            )
        axis.set_xscale("log")
        axis.set_xlabel("training blocks seen")
        axis.set_title(title)
        axis.grid(alpha=0.3)
        axis.legend()
    fig.suptitle(data.get("meta", {}).get("title", "drafter learning curve"))
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
