"""AdaFlash inside vLLM, as a plugin: per-request adaptive draft lengths for DFlash drafters, drafter hot reload, and
the trajectories online distillation learns from.

Installed with this package into vLLM's environment (``make vllm-env``; vLLM pins its own transformers), the
``vllm.general_plugins`` entry point calls ``register()`` in every vLLM process. It registers
``AdaFlashDFlashForCausalLM`` (``model``) under the architecture name an ``adaflash export --format dflash`` folder
declares, so the same folder runs in stock vLLM at a fixed length and here adaptively, and makes vLLM's runner build
``AdaFlashProposer`` (``proposer``) for ``speculative_config={"method": "dflash", ...}``. Settings come from the
environment (``rounds.Settings``; ``ADAFLASH_VLLM_POLICY`` = adaptive | goodput | fixed, ``ADAFLASH_VLLM_WEIGHTS``,
``ADAFLASH_VLLM_RECORDS``); ``ADAFLASH_VLLM_DISABLE=1`` leaves vLLM stock. ``worker`` has the RPCs
(``adaflash_stats``, ``adaflash_reload``); ``compat`` holds a fix to vLLM's CPU build that lets a DFlash drafter start
in bf16 under torch.compile. ``adaflash serve --engine vllm`` (``launch``) starts vLLM's OpenAI server
with all of it and, with ``--learn``, trains beside it.

Nothing here but ``launch``, ``rounds`` and ``context`` may be imported without vLLM.
"""

from __future__ import annotations

import os

ARCHITECTURE = "DFlashDraftModel"


def register() -> None:
    """The ``vllm.general_plugins`` entry point."""
    if os.environ.get("ADAFLASH_VLLM_DISABLE", "") not in ("", "0"):
        return
    from vllm import ModelRegistry

    from adaflash_hf.vllm.compat import release_handlers_outside_modes

    release_handlers_outside_modes()
    ModelRegistry.register_model(ARCHITECTURE, "adaflash_hf.vllm.model:AdaFlashDFlashForCausalLM")
    import vllm.v1.worker.gpu_model_runner as runner

    from adaflash_hf.vllm.proposer import AdaFlashProposer

    runner.DFlashProposer = AdaFlashProposer
