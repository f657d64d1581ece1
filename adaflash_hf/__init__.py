"""adaflash-hf: AdaFlash adaptive-length block-diffusion drafters for Hugging Face transformers and TRL.

``import adaflash_hf`` registers ``AdaFlashConfig``/``AdaFlashDrafter`` with the Auto classes and installs the
narrow ``generate(..., assistant_model=drafter)`` hook (``adaflash_hf.generate_hook``; ``enable()``/``disable()``): that
costs torch, transformers and the drafter's modules. The other public names (the serving engine and its kernels,
``prepare_target``: bf16 where this CPU has bf16 dot products, with a batch-invariant forward) load on first use.
The ``adaflash`` console script defers even the hook to the command it runs (``install()``), so ``adaflash --help``
imports neither torch nor transformers.
"""

import importlib
import sys
from pathlib import Path

from adaflash_hf.version import __version__ as __version__

# public name -> the module that defines it, imported on first access (PEP 562)
_PUBLIC = {
    "AdaFlashCandidateGenerator": "adaflash_hf.generation",
    "disable": "adaflash_hf.generate_hook",
    "enable": "adaflash_hf.generate_hook",
    "is_enabled": "adaflash_hf.generate_hook",
    "AdaFlashConfig": "adaflash_hf.modeling",
    "AdaFlashDrafter": "adaflash_hf.modeling",
    "AdaFlashDrafterOutput": "adaflash_hf.modeling",
    "prepare_target": "adaflash_hf.prepared.prepare",
    "register": "adaflash_hf.registration",
    "AdaFlashEngine": "adaflash_hf.serving",
    "SamplingParams": "adaflash_hf.serving",
    "AdaFlashStats": "adaflash_hf.stats",
    "RoundRecord": "adaflash_hf.stats",
}

__all__ = sorted([*_PUBLIC, "__version__", "install"])


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'adaflash_hf' has no attribute {name!r}")
    value = getattr(importlib.import_module(_PUBLIC[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_PUBLIC})


def install() -> None:
    """What ``import adaflash_hf`` does: register with the Auto classes and install the generate hook. On an
    untested transformers the package stays importable and a warning says why generate will not adapt."""
    from transformers.utils import logging

    from adaflash_hf.generate_hook import enable
    from adaflash_hf.registration import register

    register()
    try:
        enable()
    except RuntimeError as error:
        logging.get_logger(__name__).warning(f"{error}. Call adaflash_hf.enable() after fixing this.")


def _running_as_the_console_script() -> bool:
    # The `adaflash` script imports this package only to reach adaflash_hf.cli, which calls install() itself before
    # running a command: argument parsing and --help then need no torch.
    argv = getattr(sys, "argv", None) or [""]
    return Path(argv[0]).name in ("adaflash", "adaflash.exe")


# Inside vLLM (the plugin, ``adaflash_hf.vllm``, is loaded by vLLM's processes) generate is not ours to hook, and
# vLLM pins a transformers outside the tested range: ``install()`` is left to whoever wants it there.
if not _running_as_the_console_script() and "vllm" not in sys.modules:
    install()
