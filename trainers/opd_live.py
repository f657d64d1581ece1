"""The learner of ``adaflash serve --learn``: an ``OPDTrainer`` with its own copies of the drafter and the frozen
target, wrapped in ``adaflash_hf.online.live.LiveLearner``.

    learner = live_learner(engine, target, tokenizer, "runs/serve", opd_config="examples/configs/opd_smollm2.yaml")

``opd_config`` (optional) is a TRL-style YAML: its ``OPDConfig`` keys (loss, optimisation) and ``OnlineConfig`` keys
(``train_threshold``, ``max_staleness``, ``checkpoint_every``, ``resume``) are read, so the OPD script's config can be
reused; its other keys of the OPD script (traffic, target) have no meaning for a server and are ignored with a
warning naming them, and a key of neither is refused (naming the nearest valid key). Files go under ``learn_dir``:
``weights/`` (published versions), ``checkpoints/`` (atomic, resumed at start), ``trainer/`` (the trainer's
output_dir). Without CUDA the trainer runs on the CPU.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
from pathlib import Path

import torch
from transformers.utils import logging
from trl import ModelConfig, TrlParser

from adaflash_hf.atomic import check_folder_path
from adaflash_hf.launch import load_yaml_mapping
from adaflash_hf.online.config import OnlineConfig
from adaflash_hf.online.live import LiveLearner
from adaflash_hf.online.weights import base_drafter
from adaflash_hf.trainers.opd_config import OPDConfig
from adaflash_hf.trainers.opd_trainer import OPDTrainer

logger = logging.get_logger(__name__)


def _field_names(*dataclass_types) -> set[str]:
    return {f.name for cls in dataclass_types for f in dataclasses.fields(cls)}


def _check_opd_config_keys(path: str, keys) -> None:
    """Refuse a key that no OPD setting has (a misspelt one would otherwise run on its default) and say which keys
    of the OPD script a server leaves aside."""
    from adaflash_hf.trainers.opd import OPDScriptArguments

    used = _field_names(OPDConfig, OnlineConfig)
    script_only = _field_names(OPDScriptArguments, ModelConfig) - used
    for key in keys:
        if str(key) not in used | script_only:
            closest = difflib.get_close_matches(str(key), sorted(used | script_only), n=1)
            raise ValueError(
                f"--opd-config {path}: expected keys of the OPD trainer and buffer settings, got {key!r}"
                + (f" (did you mean {closest[0]!r}?)" if closest else "")
            )
    ignored = sorted(str(key) for key in keys if str(key) in script_only)
    if ignored:
        logger.warning(
            f"--opd-config {path}: {', '.join(ignored)} set the OPD script's traffic, target or model, which a "
            "server does not use: ignored"
        )


def learn_configs(
    learn_dir: str | Path, opd_config: str | None = None, **overrides
) -> tuple[OPDConfig, OnlineConfig]:
    """The trainer's and the buffer's settings: the server's defaults, then ``opd_config``, then ``overrides``."""
    values = {
        "output_dir": str(Path(learn_dir) / "trainer"),
        "use_cpu": not torch.cuda.is_available(),
        "disable_tqdm": True,
        "report_to": "none",
    }
    if opd_config is not None:
        loaded = load_yaml_mapping(opd_config, "--opd-config")
        _check_opd_config_keys(opd_config, loaded)
        values |= loaded
    values |= {key: value for key, value in overrides.items() if value is not None}
    training, online = TrlParser((OPDConfig, OnlineConfig)).parse_dict(values, allow_extra_keys=True)
    return training, online


def live_learner(
    engine,
    target,
    tokenizer,
    learn_dir: str | Path,
    opd_config: str | None = None,
    *,
    drafter=None,
    **overrides,
) -> LiveLearner:
    """The server's learner; ``overrides`` (e.g. ``train_threshold``) win over ``opd_config``. ``engine`` None with
    ``drafter``: an engine in another process serves (``adaflash serve --engine vllm``)."""
    check_folder_path(learn_dir, "--learn-dir")
    training, online = learn_configs(learn_dir, opd_config, **overrides)
    drafter = copy.deepcopy(base_drafter(engine.drafter if engine is not None else drafter))
    target = copy.deepcopy(target) if engine is not None else target
    trainer = OPDTrainer(drafter, target, training, processing_class=tokenizer)
    learn_dir = Path(learn_dir)
    return LiveLearner(trainer, engine, learn_dir / "weights", learn_dir / "checkpoints", online)
