"""Versioned drafter weights between the OPD trainer and the server: publish, validate, hot reload, checkpoints.

Publishing (trainer side): ``publish_weights(directory, tensors, version)`` writes ``drafter-v{version}.safetensors``
to a temporary file in the same directory, fsyncs it, renames it into place, then replaces ``latest.json``
(version, file name, sha256) the same way. Only the drafter's own tensors travel (``publishable_state``: the whole
drafter including its length head, or only the LoRA adapter and the head under PEFT), never the target.

Hot reload (server side): ``HotReloader.poll()`` is called between engine steps (or between ``generate`` calls). A
new version is applied only if its manifest and file are readable, the sha256 matches, the keys, shapes and dtypes
equal the live model's, every value is finite and a canary forward of the drafter with the new weights is finite.
Otherwise the payload is rejected, counted by reason, remembered (not retried) and serving continues on the previous
weights; a failed canary restores them. On success ``model.weights_version`` becomes the payload's version, so the
rounds the drafter drafts from then on carry it. Requests already in flight keep the drafter context K/V projected by
the previous weights: drafts stay verified by the target, so outputs stay lossless.

Checkpoints: ``save_checkpoint`` writes every file into a staging directory with a manifest of sha256 sums written
last, fsyncs, and renames the directory into place (``adaflash_hf.atomic.atomic_folder``); ``latest_checkpoint`` returns
the newest directory whose manifest verifies, so a save killed half-way is never loaded. The online loop's checkpoint ``checkpoint-v{version}`` holds a
``LearnerState`` (``drafter.safetensors``: the publishable tensors, ``optimizer.pt``, and the version and counters in
the manifest) and the loop's own state: ``save_online_checkpoint`` / ``load_online_checkpoint``.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers.utils import logging

from adaflash_hf.atomic import atomic_folder, atomic_write, atomic_write_json

logger = logging.get_logger(__name__)

MANIFEST = "latest.json"
CHECKPOINT_MANIFEST = "checkpoint.json"
REJECT_REASONS = (
    "unreadable",
    "checksum",
    "missing_keys",
    "unexpected_keys",
    "shape",
    "dtype",
    "non_finite",
    "canary",
)


class PayloadError(ValueError):
    """A published payload that must not be served; ``reason`` is one of ``REJECT_REASONS``."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


# ------------------------------------------------------------------------------------------------ checksums
def sha256_file(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


# ------------------------------------------------------------------------------------------------- payloads
def _is_peft(model) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


def base_drafter(model):
    """The ``AdaFlashDrafter`` under a PEFT wrapper (or the model itself)."""
    return model.get_base_model() if _is_peft(model) else model


def publishable_state(model) -> dict[str, torch.Tensor]:
    """The tensors that are published and hot-reloaded: the drafter and its length head (no target weights), or
    under PEFT only the adapter weights and the modules saved with it (the length head)."""
    if _is_peft(model):
        from peft import get_peft_model_state_dict

        return get_peft_model_state_dict(model)
    return model.state_dict()


def load_state(model, tensors: dict[str, torch.Tensor]) -> None:
    """Copy ``publishable_state``-shaped tensors into ``model`` in place (strictly for a plain drafter)."""
    with torch.no_grad():
        if _is_peft(model):
            from peft import set_peft_model_state_dict

            set_peft_model_state_dict(model, tensors)
        else:
            model.load_state_dict(tensors, strict=True)


def publish_weights(
    directory: str | Path, tensors: dict[str, torch.Tensor], version: int, keep: int = 3
) -> Path:
    """Write version ``version`` atomically and point ``latest.json`` at it; keep the newest ``keep`` files."""
    directory = Path(directory)
    published = newest_published_version(directory)
    if version < published:
        # A reloader never goes back to a lower version: an older number would be published and never served.
        raise ValueError(
            f"version: expected >= {published} (the newest published in {directory}), got {version}"
        )
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"drafter-v{version:06d}.safetensors"
    cpu = {name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}
    atomic_write(path, lambda tmp: save_file(cpu, str(tmp), metadata={"version": str(version)}))
    manifest = {"version": version, "file": path.name, "sha256": sha256_file(path), "created": time.time()}
    atomic_write_json(directory / MANIFEST, manifest)
    for old in sorted(directory.glob("drafter-v*.safetensors"))[:-keep]:
        old.unlink(missing_ok=True)
    return path


def newest_published_version(directory: str | Path) -> int:
    """The highest version ``directory`` holds, by its manifest or by a payload file's name (a manifest that is
    unreadable, or a publish killed before its manifest, still counts its file); 0 when nothing was published."""
    directory = Path(directory)
    versions = [0]
    for path in directory.glob("drafter-v*.safetensors"):
        number = path.name.removeprefix("drafter-v").removesuffix(".safetensors")
        if number.isdigit():
            versions.append(int(number))
    try:
        manifest = read_manifest(directory)
    except PayloadError:
        manifest = None
    if manifest is not None:
        versions.append(manifest["version"])
    return max(versions)


def read_manifest(directory: str | Path) -> dict | None:
    """The current manifest, or None if none was published yet. Raises ``PayloadError("unreadable")``."""
    path = Path(directory) / MANIFEST
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text())
        manifest["version"] = int(manifest["version"])
        _ = manifest["file"], manifest["sha256"]
    except (ValueError, KeyError, TypeError) as error:
        raise PayloadError(
            "unreadable", f"{path}: expected JSON with version/file/sha256, got {error}"
        ) from error
    return manifest


def load_payload(directory: str | Path, manifest: dict) -> dict[str, torch.Tensor]:
    path = Path(directory) / manifest["file"]
    if not path.is_file():
        raise PayloadError("unreadable", f"payload {path}: expected a file, got none")
    actual = sha256_file(path)
    if actual != manifest["sha256"]:
        raise PayloadError("checksum", f"payload {path} sha256: expected {manifest['sha256']}, got {actual}")
    try:
        return load_file(str(path))
    except Exception as error:  # safetensors raises several types for a malformed file
        raise PayloadError("unreadable", f"payload {path}: expected safetensors, got {error}") from error


def validate_payload(
    tensors: dict[str, torch.Tensor], reference: dict[str, torch.Tensor], same_dtype: bool = True
) -> None:
    """Keys, shapes, dtypes (with ``same_dtype``; else any floating dtype) equal to ``reference`` (the live model's
    publishable state) and finite values."""
    missing = sorted(set(reference) - set(tensors))
    if missing:
        raise PayloadError(
            "missing_keys", f"payload keys: expected all {len(reference)}, missing {missing[:8]}"
        )
    unexpected = sorted(set(tensors) - set(reference))
    if unexpected:
        raise PayloadError("unexpected_keys", f"payload keys: expected none extra, got {unexpected[:8]}")
    for name, tensor in tensors.items():
        expected = reference[name]
        if tensor.shape != expected.shape:
            raise PayloadError(
                "shape", f"payload {name} shape: expected {tuple(expected.shape)}, got {tuple(tensor.shape)}"
            )
        wanted = expected.dtype if same_dtype else "a floating dtype"
        if (tensor.dtype != expected.dtype) if same_dtype else not tensor.is_floating_point():
            raise PayloadError("dtype", f"payload {name} dtype: expected {wanted}, got {tensor.dtype}")
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise PayloadError("non_finite", f"payload {name}: expected finite values, got NaN/inf")


@torch.no_grad()
def canary_forward(model, context_positions: int = 8, seed: int = 0) -> None:
    """One drafter forward on a fixed random block and context; raises ``PayloadError("canary")`` if not finite."""
    drafter = base_drafter(model)
    config = drafter.config
    parameter = next(drafter.parameters())
    generator = torch.Generator().manual_seed(seed)
    noise = torch.randn(1, config.block_size, config.hidden_size, generator=generator)
    context = torch.randn(1, context_positions, drafter.fc.in_features, generator=generator)
    out = model(
        noise_embeds=noise.to(parameter.device, parameter.dtype),
        context_hidden_states=context.to(parameter.device, parameter.dtype),
    )
    if not (
        bool(torch.isfinite(out.last_hidden_state).all()) and bool(torch.isfinite(out.acceptance_prob).all())
    ):
        raise PayloadError(
            "canary", "canary forward: expected finite drafter states and acceptance, got NaN/inf"
        )


class HotReloader:
    """Polls a publish directory and swaps validated payloads into ``model`` in place. See the module docstring."""

    def __init__(
        self,
        model,
        directory: str | Path,
        canary: Callable | None = canary_forward,
        *,
        state: Callable = publishable_state,
        load: Callable = load_state,
        same_dtype: bool = True,
    ):
        """``state(model)``/``load(model, tensors)``: the live tensors (names, shapes, dtypes) and how a payload is
        applied; an engine that keeps the drafter in its own layout (vLLM's) passes its own, with ``same_dtype=False``
        where it converts on load."""
        self.model = model
        self.directory = Path(directory)
        self.canary = canary
        self.state, self.load, self.same_dtype = state, load, same_dtype
        self.rejected: Counter[str] = Counter()
        self.swaps = 0
        self._refused: set[tuple[int, str]] = set()
        if getattr(model, "weights_version", None) is None:
            model.weights_version = 0

    @property
    def version(self) -> int:
        return int(self.model.weights_version)

    def poll(self) -> bool:
        """Apply a newer valid payload if there is one; True if the weights changed."""
        try:
            manifest = read_manifest(self.directory)
        except PayloadError as error:
            return self._reject(error, key=(-1, "manifest"))
        if manifest is None or manifest["version"] <= self.version:
            return False
        key = (manifest["version"], manifest["sha256"])
        if key in self._refused:
            return False
        live = self.state(self.model)
        try:
            tensors = load_payload(self.directory, manifest)
            validate_payload(tensors, live, self.same_dtype)
            previous = (
                {name: t.detach().clone() for name, t in live.items()} if self.canary is not None else {}
            )
            self.load(self.model, tensors)
            if self.canary is not None:
                try:
                    self.canary(self.model)
                except PayloadError:
                    self.load(self.model, previous)
                    raise
        except PayloadError as error:
            return self._reject(error, key=key)
        self.model.weights_version = manifest["version"]
        self.swaps += 1
        logger.info(f"hot reload: drafter weights version {manifest['version']} ({manifest['file']})")
        return True

    def _reject(self, error: PayloadError, key: tuple) -> bool:
        if key not in self._refused:
            self._refused.add(key)
            self.rejected[error.reason] += 1
            logger.warning(
                f"hot reload: rejected payload ({error.reason}): {error}; serving version {self.version}"
            )
        return False

    def stats(self) -> dict[str, int]:
        return {"version": self.version, "swaps": self.swaps, "rejected": sum(self.rejected.values())}


# ---------------------------------------------------------------------------------------------- checkpoints
def save_checkpoint(root: str | Path, name: str, write: Callable[[Path], None], state: dict) -> Path:
    """``write(staging_dir)`` the files, add ``checkpoint.json`` (``state`` + sha256 per file) last, then move the
    staging directory to ``root/name`` (``atomic_folder``). A directory already named so is replaced only once the new
    one is complete."""
    final = Path(root) / name
    with atomic_folder(final) as staging:
        write(staging)
        files = {
            str(path.relative_to(staging)): sha256_file(path)
            for path in sorted(p for p in staging.rglob("*") if p.is_file())
        }
        atomic_write_json(staging / CHECKPOINT_MANIFEST, {"state": state, "files": files})
    return final


def checkpoint_problem(path: str | Path) -> str | None:
    """Why the checkpoint at ``path`` cannot be loaded (its manifest unreadable, a file missing or changed), or None
    when it is complete."""
    path = Path(path)
    try:
        manifest = json.loads((path / CHECKPOINT_MANIFEST).read_text())
        files = manifest["files"]
        _ = manifest["state"]
    except OSError as error:
        return f"{CHECKPOINT_MANIFEST}: expected a readable manifest, got {error.strerror or error}"
    except (ValueError, KeyError, TypeError) as error:
        return (
            f"{CHECKPOINT_MANIFEST}: expected JSON with files and state, got {type(error).__name__}: {error}"
        )
    for relative, digest in files.items():
        if not (path / relative).is_file():
            return f"{relative}: expected a file, got none"
        actual = sha256_file(path / relative)
        if actual != digest:
            return f"{relative} sha256: expected {digest}, got {actual}"
    return None


def verify_checkpoint(path: str | Path) -> dict | None:
    """The checkpoint's ``state`` if its manifest exists and every file's sha256 matches, else None."""
    if checkpoint_problem(path) is not None:
        return None
    return json.loads((Path(path) / CHECKPOINT_MANIFEST).read_text())["state"]


def checkpoints_by_round(run_dir: Path) -> dict[int, Path]:
    """The complete checkpoints of an online run (``save_online_checkpoint`` under ``run_dir/checkpoints``), keyed by
    the round after which each was written."""
    found = {}
    for path in sorted((run_dir / "checkpoints").glob("checkpoint-*")):
        state = verify_checkpoint(path)
        if state is not None:
            found[int(state["loop"]["round"])] = path
    return found


def latest_checkpoint(root: str | Path, prefix: str = "checkpoint-") -> Path | None:
    """The complete checkpoint under ``root`` with the greatest name (names are zero-padded versions); staging
    directories are skipped, and a newer checkpoint whose files do not match its manifest is refused with a warning
    naming it, the reason and the checkpoint used instead (its rounds of training are lost, which a user must
    learn from the log, not from the numbers)."""
    root = Path(root)
    if not root.is_dir():
        return None
    refused = []
    chosen = None
    for candidate in sorted(
        (p for p in root.glob(f"{prefix}*") if p.is_dir()), key=lambda p: p.name, reverse=True
    ):
        problem = checkpoint_problem(candidate)
        if problem is None:
            chosen = candidate
            break
        refused.append((candidate, problem))
    instead = (
        f"using {chosen} instead" if chosen is not None else "no older complete checkpoint: none is used"
    )
    for candidate, problem in refused:
        logger.warning(f"checkpoint {candidate} refused ({problem}); {instead}")
    return chosen


@dataclass
class LearnerState:
    """What an online checkpoint restores of a trainer: its ``publishable_state`` tensors, its optimizer state (None
    before the first step), the weights version and its counters (e.g. ``skipped_steps``)."""

    tensors: dict[str, torch.Tensor]
    optimizer: dict | None
    version: int
    counters: dict[str, int] = field(default_factory=dict)


def save_online_checkpoint(root: str | Path, state: LearnerState, loop_state: dict) -> Path:
    """An atomic checkpoint ``root/checkpoint-v{version}`` of ``state`` and the loop's ``loop_state``."""
    tensors = {n: t.detach().to("cpu").contiguous() for n, t in state.tensors.items()}

    def write(directory: Path) -> None:
        save_file(tensors, str(directory / "drafter.safetensors"))
        if state.optimizer is not None:
            torch.save(state.optimizer, directory / "optimizer.pt")

    manifest_state = {"version": state.version, **state.counters, "loop": loop_state}
    return save_checkpoint(root, f"checkpoint-v{state.version:06d}", write, manifest_state)


def load_online_checkpoint(path: str | Path) -> tuple[LearnerState, dict]:
    """The ``LearnerState`` and loop state of a checkpoint written by ``save_online_checkpoint``; refuses incomplete
    ones."""
    path = Path(path)
    state = verify_checkpoint(path)
    if state is None:
        raise ValueError(
            f"checkpoint {path}: expected a complete checkpoint (manifest and matching sha256), got none"
        )
    optimizer = None
    if (path / "optimizer.pt").is_file():
        optimizer = torch.load(path / "optimizer.pt", weights_only=True)
    counters = {k: int(v) for k, v in state.items() if k not in ("version", "loop")}
    learner = LearnerState(
        load_file(str(path / "drafter.safetensors")), optimizer, int(state["version"]), counters
    )
    logger.info(
        f"resumed online checkpoint {path}: version {learner.version}, loop {json.dumps(state['loop'])}"
    )
    return learner, state["loop"]
