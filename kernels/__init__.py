"""Kernels for AdaFlash, one file per op: Triton kernel -> autograd.Function -> functional -> module.

- ``clipped_kl``: fused lm_head + clipped reverse-KL + hard-CE distillation loss (training).
- ``verify_packing``: geometry of one packed target forward on the engine's slot-pool K/V layout.
- ``verify_attention``: the packed verify attention of that forward, each request to its own slot.
- ``verify_accept``: greedy and speculative-sampling acceptance over the packed batch in one launch.

Every op has a Triton path (CUDA, or CPU under ``TRITON_INTERPRET=1``) and a torch fallback behind one
entry point; ``ADAFLASH_KERNELS=auto|torch|triton`` (or the ``impl=`` argument) picks one
(see ``adaflash_hf.kernels._utils.select_impl``). Importing this package does not import Triton.
"""

__all__ = ["clipped_kl", "verify_accept", "verify_attention", "verify_packing"]
