"""The drafter a training script starts from (``trainers/train_drafter.py`` and ``trainers/opd.py``): the arguments
both scripts share (``DrafterArguments``), and the drafter loaded from a checkpoint or built fresh for the target with
its final-norm initialisation, optional draft vocabulary (``build_drafter``) and optional start from the target's own
last layers (``init_from_target``)."""

import argparse
import difflib
import sys
from dataclasses import dataclass, field

import torch
from transformers.utils import logging

from adaflash_hf.draft_vocab import build_draft_vocab
from adaflash_hf.launch import config_files_in, config_help, load_yaml_mapping
from adaflash_hf.modeling import AdaFlashConfig, AdaFlashDrafter
from adaflash_hf.modeling.configuration_adaflash import build_target_layer_ids

logger = logging.get_logger(__name__)


@dataclass
class DrafterArguments:
    """The target and the drafter to start from, declared once for ``DrafterTrainingConfig`` and OPD's script
    arguments (both inherit it: the same YAML keys, CLI flags and defaults)."""

    target_model: str = field(
        default="smollm2-135m-instruct",
        metadata={
            "help": "Target causal LM: 'smollm2-135m-instruct' (offline GGUF), a Hub id or a local folder."
        },
    )
    drafter_init: str | None = field(
        default=None,
        metadata={
            "help": "Start from this drafter checkpoint (any supported layout) instead of a fresh drafter."
        },
    )
    drafter_layers: int = field(default=2, metadata={"help": "Decoder layers of a fresh drafter."})
    drafter_target_layers: int = field(
        default=3,
        metadata={"help": "How many target layers (evenly spaced, as DFlash) feed a fresh drafter."},
    )
    block_size: int = field(
        default=16,
        metadata={"help": "Block size k of a fresh drafter: one anchor plus k-1 drafted tokens."},
    )
    mask_token_id: int | None = field(
        default=None,
        metadata={
            "help": "Target vocabulary row used as MASK by a fresh drafter; None = a learned mask embedding "
            "(targets with no spare row)."
        },
    )
    length_head_variant: str = field(
        default="two_model",
        metadata={"help": "Length head of a fresh drafter: 'two_model' (official) or 'paper'."},
    )


def check_drafter_arguments(args: DrafterArguments) -> None:
    """Refuse a fresh drafter's shape that cannot draft (called by the configs that inherit ``DrafterArguments``)."""
    for name in ("drafter_layers", "drafter_target_layers"):
        if getattr(args, name) < 1:
            raise ValueError(f"{name}: expected >= 1, got {getattr(args, name)}")
    if args.block_size < 2:
        raise ValueError(f"block_size: expected >= 2, got {args.block_size}")


def check_max_steps(max_steps: int) -> None:
    """TrainingArguments reads a negative ``max_steps`` as "not set" and trains by epochs instead; only TRL's -1 means
    that, so any other negative value is a mistake to refuse, not a run of ``num_train_epochs``."""
    if max_steps < -1 or max_steps == 0:
        raise ValueError(f"max_steps: expected >= 1, or -1 to train by num_train_epochs, got {max_steps}")


def add_config_option(parser):
    """List ``--config FILE`` in a script's ``--help`` (``parser``: its TrlParser). TrlParser takes ``--config FILE``
    out of argv itself before parsing, so this option is never parsed: SUPPRESS keeps a ``config`` attribute from
    reaching the dataclasses. It documents the flag, nothing more."""
    parser.add_argument("--config", metavar="FILE", default=argparse.SUPPRESS, help=config_help(parser))
    return parser


def parse_script_args(parser, argv: list[str] | None = None) -> tuple:
    """``parser.parse_args_and_config(argv)`` (a training script's TrlParser) with its ``--config FILE`` read first
    as ``adaflash``'s commands read theirs: a YAML syntax error is one line naming the file, the line and the column,
    not the YAML scanner's traceback, and a key that is no option of the script names the nearest one."""
    for path in config_files_in(sys.argv[1:] if argv is None else list(argv)):
        _check_config_keys(path, load_yaml_mapping(path), parser)
    return parser.parse_args_and_config(argv)


def _check_config_keys(path: str, values: dict, parser) -> None:
    """Refuse a key no option of the script has, naming the nearest one (TRL's own error names neither)."""
    options = {a.dest for a in parser._actions if a.option_strings and a.dest != "config"} | {"env"}
    for key in values:
        if str(key) not in options:
            closest = difflib.get_close_matches(str(key), sorted(options), n=1)
            raise ValueError(
                f"--config {path}: expected option names of this script, got {key!r}"
                + (f" (did you mean {closest[0]!r}?)" if closest else "")
            )


def build_drafter(args, target, records: list[dict] | None = None) -> AdaFlashDrafter:
    """The drafter a training script starts from: ``args.drafter_init`` loaded in the target's dtype, or a fresh one
    for ``target`` (the ``DrafterArguments`` fields; with ``draft_vocab_size`` a reduced draft vocabulary from
    ``records``). ``args`` is a ``DrafterTrainingConfig`` or OPD's script arguments, both ``DrafterArguments``; the
    offline-only fields (``draft_vocab_size``, ``final_norm_init``, ``init_from_target``) are read with defaults.
    Checked against the target before it is returned."""
    if args.drafter_init:
        drafter = AdaFlashDrafter.from_pretrained(args.drafter_init, dtype=target.dtype)
    else:
        overrides = {
            "num_hidden_layers": args.drafter_layers,
            "block_size": args.block_size,
            "length_head_variant": args.length_head_variant,
        }
        if args.mask_token_id is not None:
            overrides["mask_token_id"] = args.mask_token_id
        # trainers/opd.py builds its fresh drafter here too, from arguments without the offline-only fields.
        draft_vocab_size = getattr(args, "draft_vocab_size", None)
        if draft_vocab_size is not None:
            # FR-Spec / EAGLE-3: the most frequent tokens of the target's own responses; no new parameters.
            eos = target.config.get_text_config().eos_token_id
            overrides["draft_token_ids"], coverage = build_draft_vocab(records or [], draft_vocab_size, eos)
            logger.info(
                f"draft vocabulary: {draft_vocab_size} tokens cover {coverage:.2%} of response tokens"
            )
        config = AdaFlashConfig.for_target(target.config, **overrides)
        text = target.config.get_text_config()
        config.target_layer_ids = build_target_layer_ids(text.num_hidden_layers, args.drafter_target_layers)
        config.name_or_path = ""
        drafter = AdaFlashDrafter(config).to(target.dtype)
        with torch.no_grad():
            # The drafter's states go through the target's lm_head. A unit final-norm scale makes the first logits
            # spread by the head's row norm (about 3 for SmolLM2: CE ~ 20); 1/row-norm starts them near unit scale.
            # 'target' starts from the scale the lm_head was trained with instead (SmolLM2: mean 1.8, not 0.31), which
            # AdamW would otherwise need thousands of steps to reach.
            target_norm = getattr(target.get_decoder(), "norm", None)
            if (
                getattr(args, "final_norm_init", "inverse_row_norm") == "target"
                and getattr(target_norm, "weight", None) is not None
            ):
                drafter.norm.weight.copy_(target_norm.weight)
            else:
                row_norm = target.get_output_embeddings().weight.norm(dim=-1).mean()
                drafter.norm.weight.fill_(float(1.0 / row_norm))
        if getattr(args, "init_from_target", False):
            init_from_target(drafter, target)
    drafter.check_target(target)
    return drafter


# The drafter layer's own names for what a Llama/Qwen-style target layer holds; q_norm / k_norm are Qwen3's and
# stay at identity (ones) for a target without them, which then computes exactly the target layer's projections.
_OPTIONAL_IN_TARGET = ("self_attn.q_norm.weight", "self_attn.k_norm.weight")


@torch.no_grad()
def init_from_target(drafter: AdaFlashDrafter, target) -> None:
    """Start ``drafter`` from the target's own weights instead of random ones (the sweep arm ``init_from_target``).

    Drafter layer i takes target layer L - n + i (its last n decoder layers, in order); ``hidden_norm`` takes the
    first copied layer's ``input_layernorm`` and ``fc`` passes the deepest tapped layer through (identity on its block
    of the concatenated context, zero elsewhere), so the context keys and values start as the copied layer would
    compute them from that hidden state. Every shape is checked before anything is copied: a mismatch (other head
    count, head_dim, intermediate size, biases) is an error naming the parameter and both shapes.
    """
    layers = target.get_decoder().layers
    n = len(drafter.layers)
    if n > len(layers):
        raise ValueError(
            f"init_from_target: expected at most the target's {len(layers)} decoder layers, got a drafter of {n}"
        )
    pairs = []
    for i, layer in enumerate(drafter.layers):
        source_index = len(layers) - n + i
        source = layers[source_index].state_dict()
        own = dict(layer.named_parameters())
        unmapped = sorted(set(source) - set(own))
        if unmapped:
            raise ValueError(
                f"init_from_target: expected target layer {source_index}'s parameters to map onto drafter layer "
                f"{i}, got {unmapped} that the drafter has no place for"
            )
        for name, value in own.items():
            if name not in source and name in _OPTIONAL_IN_TARGET:
                continue
            found = tuple(source[name].shape) if name in source else "no such parameter"
            if found != tuple(value.shape):
                raise ValueError(
                    f"init_from_target: layers.{i}.{name}: expected shape {tuple(value.shape)} (the drafter's), got "
                    f"{found} in target layer {source_index} (a different head count, head_dim or intermediate size?)"
                )
            pairs.append((value, source[name]))
    for value, source in pairs:
        value.copy_(source)
    drafter.hidden_norm.weight.copy_(layers[len(layers) - n].input_layernorm.weight)
    hidden = drafter.config.hidden_size
    deepest = drafter.config.target_layer_ids.index(max(drafter.config.target_layer_ids))
    drafter.fc.weight.zero_()
    drafter.fc.weight[:, deepest * hidden : (deepest + 1) * hidden] = torch.eye(hidden)
