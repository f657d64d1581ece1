"""Drafter training (installed as ``adaflash_hf.trainers``): every module used only by training lives here.

- TRL-style trios, config + trainer + script: ``train_drafter_config.py`` / ``train_drafter_trainer.py`` /
  ``train_drafter.py`` (offline, from a corpus) and ``opd_config.py`` / ``opd_trainer.py`` / ``opd.py`` (online
  on-policy distillation);
- the recipe and its parts: ``dflash_recipe.py`` (anchors, blocks, masks, losses), ``target_features.py``,
  ``drafter_setup.py``, ``optim.py``;
- the data and measurements around it: ``corpus.py`` (``adaflash corpus``) and ``corpus_format.py`` (its files),
  ``learning_curve.py`` (held-out acceptance) and ``calibrate_head.py`` (``adaflash calibrate-head``).

Importing the package imports none of them: ``adaflash corpus --help`` and ``adaflash calibrate-head --help`` need no
trl. The four trainer classes load on first access (PEP 562).
"""

import importlib

# public name -> the module that defines it, imported on first access
_PUBLIC = {
    "DrafterTrainer": "adaflash_hf.trainers.train_drafter_trainer",
    "DrafterTrainingConfig": "adaflash_hf.trainers.train_drafter_config",
    "OPDConfig": "adaflash_hf.trainers.opd_config",
    "OPDTrainer": "adaflash_hf.trainers.opd_trainer",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'adaflash_hf.trainers' has no attribute {name!r}")
    value = getattr(importlib.import_module(_PUBLIC[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_PUBLIC})
