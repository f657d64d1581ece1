"""The batched serving engine: continuous batching, per-request adaptive draft lengths, one packed verify.

- ``engine``: ``AdaFlashEngine`` (add_request / step / stream / abort / generate) and ``StepStats``;
- ``requests``: ``SamplingParams``, per-request state, ``RequestOutput`` deltas;
- ``cache``: the per-request KV slot pool, the packed target attention and the drafter's batched cache;
- ``admission``: EMA admission control, token and KV budgets, load-aware γ.
"""

from adaflash_hf.drafting import DraftingSettings
from adaflash_hf.serving.admission import AdmissionConfig
from adaflash_hf.serving.engine import MODES, AdaFlashEngine
from adaflash_hf.serving.requests import RequestOutput, SamplingParams
from adaflash_hf.stats import StepStats

__all__ = [
    "MODES",
    "AdaFlashEngine",
    "AdmissionConfig",
    "DraftingSettings",
    "RequestOutput",
    "SamplingParams",
    "StepStats",
]
