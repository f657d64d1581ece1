"""Publish drafters to the Hugging Face Hub with a model card, in one commit.

``push_drafter(drafter_or_path, "org/name")`` (CLI: ``adaflash publish PATH org/name``) does all local work first:
loads and checks the drafter, renders ``README.md`` from ``adaflash_hf/templates/model_card.md`` (metadata: the target
as ``base_model``, tags, datasets, license; body: usage, the τ/speed-up table of a bench JSON, the training command)
and stages ``save_pretrained``'s files (safetensors, config, the remote-code ``modeling/*_adaflash.py``).
Only then does it touch the Hub: ``create_repo`` (private or not), ``create_branch`` for a ``revision``, and ONE
``create_commit`` holding every file. A failure before the commit uploads nothing; a failed commit changes nothing,
so a revision never holds half a drafter.

``drafter.push_to_hub(repo_id)`` (inherited from transformers) also uploads weights, config and remote code, but with
transformers' generic card; use ``push_drafter`` for the AdaFlash card.

Downloading needs nothing from this module: ``AdaFlashDrafter.from_pretrained("org/name", revision=...)`` goes through
the Hub cache and honours ``HF_HUB_OFFLINE``; without adaflash-hf, ``AutoModel.from_pretrained("org/name",
trust_remote_code=True)`` uses the uploaded remote code.
"""

from __future__ import annotations

import importlib
import json
import os
import tempfile
from importlib import resources
from pathlib import Path
from typing import Any

from huggingface_hub import CommitOperationAdd, HfApi, ModelCard, ModelCardData
from huggingface_hub.utils import HFValidationError, validate_repo_id
from safetensors import safe_open
from transformers import PreTrainedConfig
from transformers.utils import logging

import adaflash_hf.modeling
from adaflash_hf.interop import check_target_fingerprint, load_drafter, load_target_config
from adaflash_hf.modeling import AdaFlashConfig, AdaFlashDrafter
from adaflash_hf.version import __version__

logger = logging.get_logger(__name__)

DEFAULT_TAGS = ("adaflash", "dflash", "speculative-decoding", "draft-model")
# The remote code: every file of modeling/ but its __init__ (modeling_adaflash.py imports the others with a single dot,
# so save_pretrained copies them all).
REMOTE_CODE_FILES = tuple(
    sorted(p.name for p in Path(adaflash_hf.modeling.__file__).parent.glob("*_adaflash.py"))
)
REQUIRED_FILES = ("config.json", *REMOTE_CODE_FILES, "README.md")
# bench JSON keys shown first, in this order, with these headers; other scalar keys follow as they come
_KNOWN_COLUMNS = {
    "method": "method",
    "mode": "mode",
    "dataset": "dataset",
    "domain": "domain",
    "concurrency": "concurrency",
    "tau": "τ",
    "acceptance_length": "τ",
    "speedup": "speed-up",
    "speedup_vs_plain": "speed-up",
    "tokens_per_s": "tok/s",
    "tok_per_s": "tok/s",
    "mean_verify_length": "mean verify length",
    "lossless": "lossless",
}
# `adaflash bench generate` / `bench serve` write {"settings": {...}, "summary": [rows]}: their rows carry many
# diagnostics, so a card shows these columns of them, and the settings' scalars but local paths as its setup line.
_SUMMARY_COLUMNS = (
    *("method", "mode", "domain", "concurrency", "tau", "speedup", "speedup_vs_plain"),
    *("tokens_per_s", "mean_verify_length", "lossless"),
)
_LOCAL_SETTINGS = ("drafter", "output_dir")


# ------------------------------------------------------------------------------------------------ bench results
def load_bench_results(bench: str | os.PathLike | dict | list) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Rows and setup scalars from a bench JSON: a list of rows, ``{"results"|"rows": [...], **setup}``, an adaflash
    bench JSON ``{"settings": {...}, "summary": [...]}``, or ``{name: {metric: value}}``."""
    if isinstance(bench, (str, os.PathLike)):
        path = Path(bench)
        if not path.is_file():
            raise FileNotFoundError(f"bench_json: expected an existing JSON file, got {str(path)!r}")
        try:
            bench = json.loads(path.read_text())
        except json.JSONDecodeError as error:
            raise ValueError(f"bench_json: expected valid JSON in {path}, got {error}") from error
    setup: dict[str, Any] = {}
    if isinstance(bench, dict):
        rows_key = next(
            (key for key in ("results", "rows", "summary") if isinstance(bench.get(key), list)), None
        )
        if rows_key is not None:
            rows = bench[rows_key]
            setup = {
                k: v for k, v in bench.items() if k != rows_key and isinstance(v, (str, int, float, bool))
            }
            if rows_key == "summary":  # an adaflash bench JSON
                rows = [
                    {k: row[k] for k in _SUMMARY_COLUMNS if k in row} if isinstance(row, dict) else row
                    for row in rows
                ]
                settings = bench.get("settings") if isinstance(bench.get("settings"), dict) else {}
                setup = {
                    k: v
                    for k, v in settings.items()
                    if k not in _LOCAL_SETTINGS and isinstance(v, (str, int, float, bool))
                }
        elif bench and all(isinstance(v, dict) for v in bench.values()):
            rows = [{"method": name, **metrics} for name, metrics in bench.items()]
        else:
            raise ValueError(
                "bench_json: expected a list of result rows, {'results': [...]}, {'summary': [...]} or {name: {metric: value}}, "
                f"got a dict with keys {sorted(bench)}"
            )
    elif isinstance(bench, list):
        rows = bench
    else:
        raise ValueError(f"bench_json: expected a list or dict of results, got {type(bench).__name__}")
    if not rows or not all(isinstance(row, dict) for row in rows):
        raise ValueError(
            "bench_json: expected a non-empty list of result rows (dicts), got " + repr(rows)[:80]
        )
    return rows, setup


def _format_value(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if 0 < abs(value) < 0.01 else f"{value:.2f}"  # one precision in a column
    return "" if value is None else str(value).replace("|", "\\|")


def results_table(rows: list[dict[str, Any]]) -> str:
    """A markdown table over the scalar columns of ``rows``; known metrics first with readable headers."""
    keys: list[str] = []
    for row in rows:
        keys += [
            k
            for k, v in row.items()
            if k not in keys and (v is None or isinstance(v, (str, int, float, bool)))
        ]
    keys.sort(key=lambda k: list(_KNOWN_COLUMNS).index(k) if k in _KNOWN_COLUMNS else len(_KNOWN_COLUMNS))
    header = [_KNOWN_COLUMNS.get(k, k) for k in keys]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(_format_value(row.get(k)) for k in keys) + " |" for row in rows]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------- the card
def _valid_repo_id(name: str | None) -> bool:
    if not name or Path(name).exists():
        return False
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return "/" in name


def render_model_card(
    config: AdaFlashConfig,
    repo_id: str,
    *,
    base_model: str | None = None,
    bench_json: str | os.PathLike | dict | list | None = None,
    training_command: str | None = None,
    datasets: list[str] | None = None,
    license: str = "apache-2.0",
    tags: list[str] | None = None,
    num_parameters: int | None = None,
    dtype: str | None = None,
) -> ModelCard:
    """The drafter's README: YAML metadata the Hub indexes, then usage, settings, results and training."""
    if base_model is not None and not _valid_repo_id(base_model):
        raise ValueError(f"base_model: expected a Hub repo id like 'Qwen/Qwen3-8B', got {base_model!r}")
    card_data = ModelCardData(
        base_model=base_model,
        library_name="transformers",
        license=license,
        datasets=list(datasets) if datasets else None,
        tags=list(dict.fromkeys([*DEFAULT_TAGS, *(tags or ())])),
        model_name=repo_id.split("/")[-1],
    )
    rows, setup = load_bench_results(bench_json) if bench_json is not None else ([], {})
    mask = (
        f"learned mask embedding (placeholder row {config.mask_token_id})"
        if config.learned_mask_embedding
        else f"target embedding row {config.mask_token_id}"
    )
    template = resources.files("adaflash_hf") / "templates" / "model_card.md"
    return ModelCard.from_template(
        card_data,
        template_str=template.read_text(encoding="utf-8"),
        repo_id=repo_id,
        model_name=repo_id.split("/")[-1],
        base_model=base_model,
        num_layers=config.num_hidden_layers,
        block_size=config.block_size,
        hidden_size=config.hidden_size,
        target_model_type=config.target_model_type,
        target_num_hidden_layers=config.target_num_hidden_layers,
        target_layer_ids=list(config.target_layer_ids or ()),
        mask_description=mask,
        draft_vocab_description=(
            f"{len(config.draft_token_ids)} most frequent response tokens (of {config.vocab_size}); tokens outside it "
            "are never proposed"
            if config.draft_token_ids
            else f"the target's full vocabulary ({config.vocab_size})"
        ),
        length_head_variant=config.length_head_variant,
        length_head_bottleneck=config.length_head_bottleneck,
        length_head_gamma=config.length_head_gamma,
        length_head_min_len=config.length_head_min_len,
        num_parameters=f"{num_parameters:,}" if num_parameters is not None else "?",
        dtype=dtype or "?",
        results_table=results_table(rows) if rows else None,
        results_setup=", ".join(f"{k}: {_format_value(v)}" for k, v in setup.items()) or None,
        training_command=training_command,
        datasets=list(datasets or ()),
        adaflash_version=__version__,
    )


def drafter_card(drafter: AdaFlashDrafter, repo_id: str, **kwargs) -> ModelCard:
    """``render_model_card`` for a drafter object: its config, parameter count and stored dtype filled in."""
    return render_model_card(
        drafter.config,
        repo_id,
        num_parameters=sum(p.numel() for p in drafter.parameters()),
        dtype=str(next(drafter.parameters()).dtype).removeprefix("torch."),
        **kwargs,
    )


# -------------------------------------------------------------------------------------------------- staging
def stage_drafter(drafter: AdaFlashDrafter, folder: str | os.PathLike, card: ModelCard) -> list[Path]:
    """Write the repo's files into ``folder`` and check them; returns the files, sorted."""
    folder = Path(folder)
    drafter.save_pretrained(folder)
    card.save(folder / "README.md")
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    names = {p.relative_to(folder).as_posix() for p in files}
    missing = [name for name in REQUIRED_FILES if name not in names]
    if missing:
        raise FileNotFoundError(f"staged drafter: expected files {list(REQUIRED_FILES)}, missing {missing}")
    stored: set[str] = set()
    for path in files:
        if path.suffix == ".safetensors":
            with safe_open(path, framework="pt") as handle:
                stored |= set(handle.keys())
    expected = set(drafter.state_dict())
    if stored != expected:
        raise ValueError(
            f"staged weights: expected the drafter's {len(expected)} tensors, got missing {sorted(expected - stored)}, "
            f"extra {sorted(stored - expected)}"
        )
    return files


def _unreachable_errors() -> tuple[type[BaseException], ...]:
    """What the Hub client raises when no connection can be made: offline mode, a refused or timed-out connection,
    whichever HTTP library this huggingface_hub uses (its transport errors are not OSErrors)."""
    errors: list[type[BaseException]] = [ConnectionError, TimeoutError]
    for module in ("httpx2", "httpx"):
        try:
            errors.append(importlib.import_module(module).TransportError)
        except (ImportError, AttributeError):
            pass
    return tuple(errors)


def push_drafter(
    drafter_or_path: AdaFlashDrafter | str | os.PathLike,
    repo_id: str,
    *,
    private: bool = False,
    revision: str | None = None,
    bench_json: str | os.PathLike | dict | list | None = None,
    training_command: str | None = None,
    datasets: list[str] | None = None,
    license: str = "apache-2.0",
    base_model: str | None = None,
    target_config: PreTrainedConfig | str | os.PathLike | None = None,
    tags: list[str] | None = None,
    commit_message: str | None = None,
    create_pr: bool = False,
    token: str | bool | None = None,
    dry_run: bool = False,
    api: HfApi | None = None,
):
    """Upload a drafter (object, folder in any supported layout, or repo id) with its card in one commit.

    ``base_model`` defaults to ``target_config``'s name when that is a Hub repo id. With ``target_config`` the drafter's
    recorded target fingerprint is checked first. ``dry_run=True`` stages and checks everything and returns the planned
    ``(path_in_repo, size)`` list without calling the Hub. Otherwise returns ``create_commit``'s ``CommitInfo``.
    """
    validate_repo_id(repo_id)
    drafter = load_drafter(drafter_or_path)
    if target_config is not None:
        target_config = load_target_config(target_config)
        check_target_fingerprint(drafter.config, target_config)
        if base_model is None and _valid_repo_id(target_config.name_or_path):
            base_model = target_config.name_or_path
    if base_model is None:
        logger.warning(
            "base_model: not given, so the card does not link the drafter to its target on the Hub"
        )
    card = drafter_card(
        drafter,
        repo_id,
        base_model=base_model,
        bench_json=bench_json,
        training_command=training_command,
        datasets=datasets,
        license=license,
        tags=tags,
    )
    with tempfile.TemporaryDirectory(prefix="adaflash-publish-") as tmp:
        files = stage_drafter(drafter, tmp, card)
        operations = [
            CommitOperationAdd(path_in_repo=path.relative_to(tmp).as_posix(), path_or_fileobj=str(path))
            for path in files
        ]
        if dry_run:
            return [(op.path_in_repo, Path(op.path_or_fileobj).stat().st_size) for op in operations]
        api = api or HfApi(library_name="adaflash-hf", library_version=__version__)
        try:
            url = api.create_repo(repo_id, private=private, exist_ok=True, token=token, repo_type="model")
            repo_id = url.repo_id if isinstance(getattr(url, "repo_id", None), str) else repo_id
            if revision is not None and not revision.startswith("refs/pr/"):
                api.create_branch(repo_id, branch=revision, exist_ok=True, token=token, repo_type="model")
            logger.info(f"Uploading {len(operations)} files to {repo_id}@{revision or 'main'} in one commit")
            return api.create_commit(
                repo_id,
                operations=operations,
                commit_message=commit_message or f"Upload AdaFlash drafter (adaflash-hf {__version__})",
                revision=revision,
                create_pr=create_pr,
                token=token,
                repo_type="model",
            )
        except _unreachable_errors() as error:  # HF_HUB_OFFLINE's OfflineModeIsEnabled among them
            raise ConnectionError(
                f"the Hub is unreachable, nothing was uploaded to {repo_id} ({type(error).__name__}: {error}); "
                "--dry-run (dry_run=True) stages the drafter and lists what would be uploaded, without the Hub"
            ) from error
