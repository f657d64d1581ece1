"""The narrow hook that makes ``target.generate(..., assistant_model=drafter)`` run AdaFlash.

transformers has no public hook for a third-party candidate generator, so ``enable()`` wraps four private
``GenerationMixin`` methods narrowly and idempotently: ``_prepare_generation_config`` (``adaflash_*`` kwargs become
config fields), ``_validate_generation_mode`` (our checks, before any forward), ``_get_stopping_criteria`` (the
call's criteria, which the candidate generator checks inside each chunk) and ``_get_candidate_generator`` (an
``AdaFlashCandidateGenerator`` for an ``AdaFlashDrafter`` assistant). Every other assistant goes to the original
methods untouched. The tested transformers range is pinned (``TESTED_TRANSFORMERS``) and checked at ``enable()``.
"""

from __future__ import annotations

import difflib
import functools
import inspect
import weakref

import torch
import transformers
from transformers.generation.candidate_generator import CandidateGenerator
from transformers.generation.configuration_utils import GenerationConfig, GenerationMode
from transformers.generation.utils import GenerationMixin
from transformers.utils import logging

from adaflash_hf.drafting import DraftingSettings
from adaflash_hf.generation import _DRAFTERS_WITH_STATS, AdaFlashCandidateGenerator, drafting_settings
from adaflash_hf.modeling import AdaFlashDrafter
from adaflash_hf.prepared.linear import fast_linears

logger = logging.get_logger(__name__)

TESTED_TRANSFORMERS = ("5.24.0", "5.25.0")  # [low, high)
KNOBS = tuple(f"adaflash_{name}" for name in DraftingSettings.knobs())
_HOOKED = (
    "_get_candidate_generator",
    "_validate_generation_mode",
    "_prepare_generation_config",
    "_get_stopping_criteria",
)
# Assisted-generation fields of transformers that no AdaFlash round reads, and the knob that does their job.
_IGNORED_ASSISTANT_FIELDS = {
    "num_assistant_tokens": "adaflash_length_mode='fixed' (block_size - 1 drafts) or adaflash_gamma / adaflash_min_len",
    "num_assistant_tokens_schedule": "adaflash_length_mode ('adaptive' or 'goodput' size each draft)",
    "assistant_confidence_threshold": "adaflash_length_mode='adaptive' or 'goodput' (the length head and the "
    "drafter's confidences size each draft)",
}
_WARNED_DTYPE: weakref.WeakSet = weakref.WeakSet()  # targets already warned that they are not float32


def _version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("+")[0].split(".")[:3] if part.isdigit())


def check_transformers_support() -> None:
    """Raise a clear error if the installed transformers lacks the internals this integration relies on."""
    version = transformers.__version__
    low, high = TESTED_TRANSFORMERS
    problems = []
    if not _version_tuple(low) <= _version_tuple(version) < _version_tuple(high):
        problems.append(f"transformers version: expected >={low},<{high} (the tested range), got {version}")
    if not getattr(CandidateGenerator, "requires_model_outputs", None) is not None:
        problems.append(
            "CandidateGenerator.requires_model_outputs: expected the 5.x model-outputs protocol, missing"
        )
    for name in _HOOKED:
        if not callable(getattr(GenerationMixin, name, None)):
            problems.append(f"GenerationMixin.{name}: expected a method, missing")
    try:
        from transformers.cache_utils import DFlashCache  # noqa: F401
    except ImportError:
        problems.append("transformers.cache_utils.DFlashCache: expected importable, missing")
    if problems:
        raise RuntimeError("adaflash_hf cannot hook into this transformers: " + "; ".join(problems))


def check_knob_names(generation_config) -> None:
    """Raise on an ``adaflash_*`` field that is no knob: a misspelt knob would otherwise be ignored silently."""
    for name in sorted(vars(generation_config)):
        if name.startswith("adaflash_") and name not in KNOBS:
            closest = difflib.get_close_matches(name, KNOBS, n=1, cutoff=0.0)[0]
            raise ValueError(
                f"generation_config.{name}: expected one of the AdaFlash knobs {KNOBS}, got the unknown name "
                f"{name!r} (did you mean {closest!r}?)"
            )


def validate_adaflash_generation(
    target, drafter: AdaFlashDrafter, generation_mode, generation_config
) -> None:
    """All checks that must fail before any forward pass of an AdaFlash ``generate`` call (the prompt's are in
    ``AdaFlashCandidateGenerator.__init__``, the first place that sees it, still before any forward)."""
    check_knob_names(generation_config)
    drafter.align_dtype(target)
    drafter.check_target(target)
    fast_linears(drafter)
    if generation_config.num_beams > 1 or generation_mode in (
        GenerationMode.BEAM_SEARCH,
        GenerationMode.BEAM_SAMPLE,
    ):
        raise ValueError(
            f"num_beams: expected 1 with an AdaFlash assistant (speculative decoding is greedy or sampling), "
            f"got {generation_config.num_beams}"
        )
    if generation_config.num_return_sequences != 1:
        raise ValueError(
            "num_return_sequences: expected 1 with an AdaFlash assistant (use the batched engine, "
            f"adaflash_hf.serving, for several sequences), got {generation_config.num_return_sequences}"
        )
    if generation_config.cache_implementation not in (None, "dynamic"):
        raise ValueError(
            f"cache_implementation: expected None or 'dynamic' (a cache that can be cropped after rejected drafts), "
            f"got {generation_config.cache_implementation!r}"
        )
    if generation_config.prompt_lookup_num_tokens is not None:
        raise ValueError(
            f"prompt_lookup_num_tokens: expected None with an AdaFlash assistant (got "
            f"{generation_config.prompt_lookup_num_tokens}); for lookup drafts beside the drafter's block pass "
            "adaflash_draft_source='hybrid'"
        )
    # transformers fills unset fields with its global defaults before this check: a value that differs was set.
    defaults = GenerationConfig()._get_default_generation_params()
    for name, knob in _IGNORED_ASSISTANT_FIELDS.items():
        value, default = getattr(generation_config, name, None), defaults.get(name)
        if value not in (None, default):
            raise ValueError(
                f"{name}: expected the default {default!r} with an AdaFlash assistant (no AdaFlash round reads it), "
                f"got {value!r}; use {knob}"
            )
    if generation_config.output_attentions:
        raise ValueError(
            "output_attentions: expected False with an AdaFlash assistant (verify forwards run attention kernels "
            "that return no weights), got True"
        )
    drafting_settings(generation_config, drafter)
    _warn_unless_fp32(target)


def _warn_unless_fp32(target) -> None:
    """Once per target: the token-for-token promise holds in float32, and on a target whose forward is batch-invariant
    (``adaflash_hf.prepare_target``) in any dtype."""
    # its kernels load with the first call, not with the package
    from adaflash_hf.prepared.prepare import is_prepared

    dtype = next(target.parameters()).dtype
    preparation = is_prepared(target)
    if preparation is not None and preparation.invariant:
        return
    if dtype != torch.float32 and target not in _WARNED_DTYPE:
        _WARNED_DTYPE.add(target)
        logger.warning(
            f"target dtype {dtype}: greedy outputs equal plain decoding token for token in float32; in {dtype} a "
            "row's logits can depend on how many rows share the forward, so speculative and plain greedy text may "
            "differ where two tokens are nearly tied (adaflash_hf.prepare_target gives the target a batch-invariant "
            "forward that makes them equal)"
        )


# ------------------------------------------------------------------------------------------------------- the hook
def _wrap_get_candidate_generator(original):
    signature = inspect.signature(original)

    @functools.wraps(original)
    def _get_candidate_generator(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs).arguments
        assistant = bound.get("assistant_model")
        if not isinstance(assistant, AdaFlashDrafter) or _native_dflash(bound["generation_config"]):
            return original(self, *args, **kwargs)
        return AdaFlashCandidateGenerator(
            target=self,
            drafter=assistant,
            generation_config=bound["generation_config"],
            logits_processor=bound.get("logits_processor"),
            input_ids=bound["input_ids"],
            model_kwargs=bound.get("model_kwargs") or {},
        )

    return _get_candidate_generator


def _wrap_validate_generation_mode(original):
    signature = inspect.signature(original)

    @functools.wraps(original)
    def _validate_generation_mode(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs).arguments
        assistant = (bound.get("generation_mode_kwargs") or {}).get("assistant_model")
        generation_config = bound["generation_config"]
        if isinstance(assistant, AdaFlashDrafter):
            # Until this call's generator exists: a call that fails leaves no stale stats behind.
            assistant.last_stats = None
            if _native_dflash(generation_config):
                _refuse_call_knobs(generation_config, "speculation_type='dflash' (transformers' native path)")
                assistant.align_dtype(self)
                assistant.check_target(self)
            else:
                validate_adaflash_generation(self, assistant, bound["generation_mode"], generation_config)
        else:
            name = "None" if assistant is None else type(assistant).__name__
            _refuse_call_knobs(generation_config, f"assistant_model={name}")
        return original(self, *args, **kwargs)

    return _validate_generation_mode


def _wrap_prepare_generation_config(original):
    @functools.wraps(original)
    def _prepare_generation_config(self, generation_config, **kwargs):
        # transformers keeps only kwargs naming existing GenerationConfig fields; ours become fields too, as they
        # would inside a GenerationConfig, instead of failing as unused model kwargs.
        generation_config, model_kwargs = original(self, generation_config, **kwargs)
        names = [key for key in model_kwargs if key.startswith("adaflash_")]
        for name in names:
            setattr(generation_config, name, model_kwargs.pop(name))
        # Knobs passed to this call (not those stored on a reused config): refused unless an AdaFlash drafter runs.
        generation_config._adaflash_call_knobs = tuple(names)
        return generation_config, model_kwargs

    return _prepare_generation_config


def _native_dflash(generation_config) -> bool:
    """``speculation_type="dflash"`` hands an AdaFlash drafter to transformers' own fixed-length DFlash path."""
    return getattr(generation_config, "speculation_type", None) == "dflash"


def _refuse_call_knobs(generation_config, where: str) -> None:
    """``adaflash_*`` kwargs of a call that no AdaFlash generator reads: a misspelt name or a forgotten assistant."""
    names = getattr(generation_config, "_adaflash_call_knobs", ())
    if names:
        check_knob_names(generation_config)
        raise ValueError(
            f"{names[0]}: AdaFlash knobs expected with assistant_model=<an AdaFlashDrafter> and no "
            f"speculation_type='dflash', got {where}; drop the knob or pass the drafter as assistant_model"
        )


def _wrap_get_stopping_criteria(original):
    signature = inspect.signature(original)

    @functools.wraps(original)
    def _get_stopping_criteria(self, *args, **kwargs):
        criteria = original(self, *args, **kwargs)
        # The call's own copy of the config: the candidate generator, built next, reads the criteria from it.
        signature.bind(self, *args, **kwargs).arguments[
            "generation_config"
        ]._adaflash_stopping_criteria = criteria
        return criteria

    return _get_stopping_criteria


_WRAPPERS = {
    "_get_candidate_generator": _wrap_get_candidate_generator,
    "_validate_generation_mode": _wrap_validate_generation_mode,
    "_prepare_generation_config": _wrap_prepare_generation_config,
    "_get_stopping_criteria": _wrap_get_stopping_criteria,
}


def is_enabled() -> bool:
    return all(getattr(getattr(GenerationMixin, name), "_adaflash_original", None) for name in _HOOKED)


def enable() -> None:
    """Install the generate hook (idempotent). Raises if this transformers lacks the internals we rely on."""
    check_transformers_support()
    for name, wrap in _WRAPPERS.items():
        current = getattr(GenerationMixin, name)
        if getattr(current, "_adaflash_original", None) is not None:
            continue
        wrapper = wrap(current)
        wrapper._adaflash_original = current
        setattr(GenerationMixin, name, wrapper)


def disable() -> None:
    """Remove the generate hook; AdaFlash drafters then need ``speculation_type="dflash"`` (fixed length). Clears
    ``last_stats`` of every drafter: the calls that follow are not AdaFlash calls and record none."""
    for drafter in list(_DRAFTERS_WITH_STATS):
        drafter.last_stats = None
    _DRAFTERS_WITH_STATS.clear()
    for name in _HOOKED:
        current = getattr(GenerationMixin, name)
        original = getattr(current, "_adaflash_original", None)
        if original is not None:
            setattr(GenerationMixin, name, original)
