"""AdaFlash online on-policy distillation: serve live traffic, learn from it, hot-reload the drafter, on one machine.

    accelerate launch trainers/opd.py --config examples/configs/opd_smollm2.yaml
    accelerate launch trainers/opd.py --config examples/configs/opd_smollm2.yaml --max_rounds 2 --use_peft true
    adaflash opd --config examples/configs/opd_smollm2.yaml                      # the same, via the CLI

Steps: load the target (offline SmolLM2 by default, or any Hub id / folder) and the drafter (``--drafter_init``, or a
fresh one), give the trainer its own frozen copy of the target, build a traffic source of held-out prompts in the
``--domains`` order, then run ``adaflash_hf.online.loop.run_online``: the engine serves in a thread, every
``train_threshold`` finished requests train the drafter (``OPDTrainer``), which is published to
``<output_dir>/weights`` and hot-reloaded by the server. Per-round metrics go to ``<output_dir>/metrics.csv`` and the
``report_to`` trackers; atomic checkpoints to ``<output_dir>/checkpoints`` (a rerun resumes from the newest). With
``--use_peft`` the drafter gets LoRA adapters (the length head stays fully trained) and only the adapters and the head
are published. The final drafter is saved to ``<output_dir>/drafter``.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path

from accelerate import PartialState
from transformers.utils import logging
from trl import ModelConfig, TrlParser

from adaflash_hf.assets import load_target
from adaflash_hf.atomic import check_folder_path
from adaflash_hf.launch import run_command, warn_if_cpu_threads_idle
from adaflash_hf.online.config import OnlineConfig
from adaflash_hf.online.loop import MetricsLogger, TrafficSource, run_online
from adaflash_hf.online.weights import load_state, publishable_state
from adaflash_hf.serving import AdaFlashEngine, AdmissionConfig, SamplingParams
from adaflash_hf.trainers.drafter_setup import (
    DrafterArguments,
    add_config_option,
    build_drafter,
    check_drafter_arguments,
    parse_script_args,
)
from adaflash_hf.trainers.opd_config import OPDConfig
from adaflash_hf.trainers.opd_trainer import OPDTrainer

logger = logging.get_logger(__name__)

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass
class OPDScriptArguments(DrafterArguments):
    """The system around the trainer and the loop: target and drafter (``DrafterArguments``), traffic and serving."""

    domains: list[str] = field(
        default_factory=lambda: ["chat", "code", "math"],
        metadata={"help": "Traffic schedule: held-out prompts of each domain in turn, then again."},
    )
    prompts_per_domain: int = field(default=64, metadata={"help": "Held-out prompts per domain phase."})
    phase_prompts: list[int] | None = field(
        default=None,
        metadata={
            "help": "Held-out prompts of each phase, one count per entry of `domains` (None: prompts_per_domain "
            "each). E.g. a short phase of the known domains before a new one: a replay mix rehearses their samples."
        },
    )
    max_prompt_tokens: int = field(default=512, metadata={"help": "Longer prompts keep their last tokens."})
    max_new_tokens: int = field(default=256, metadata={"help": "Tokens generated per request."})
    serving_temperature: float = field(default=0.0, metadata={"help": "Serving temperature (0 = greedy)."})
    serving_mode: str = field(
        default="adaflash",
        metadata={
            "help": "How the serving engine drafts: 'adaflash' (the length head's adaptive rule) or 'dflash' "
            "(fixed length)."
        },
    )
    gamma: float | None = field(
        default=None, metadata={"help": "Length-head γ (None: the drafter config's)."}
    )

    def __post_init__(self):
        check_drafter_arguments(self)
        if self.phase_prompts is not None and (
            len(self.phase_prompts) != len(self.domains) or min(self.phase_prompts, default=0) < 1
        ):
            raise ValueError(
                f"phase_prompts: expected one count >= 1 per domain of {self.domains}, got {self.phase_prompts}"
            )


def lora_config(model_args: ModelConfig, drafter):
    """LoRA on the drafter's projections (no task type: a drafter is not a causal LM); the head is saved in full."""
    from peft import LoraConfig

    return LoraConfig(
        r=model_args.lora_r,
        lora_alpha=model_args.lora_alpha,
        lora_dropout=model_args.lora_dropout,
        target_modules=model_args.lora_target_modules or LORA_TARGETS,
        modules_to_save=[drafter.length_head_name],
    )


def _check_launch(state: PartialState, script_args: OPDScriptArguments, training_args: OPDConfig) -> None:
    """What the online loop cannot run with, refused before the target loads."""
    if state.num_processes != 1:
        raise ValueError(
            f"num_processes: expected 1 (the server, the trainer and their target copies share one device), "
            f"got {state.num_processes}"
        )
    if script_args.serving_mode not in ("adaflash", "dflash"):
        raise ValueError(
            f"serving_mode: expected 'adaflash' or 'dflash' (plain decoding drafts nothing), got "
            f"{script_args.serving_mode!r}"
        )
    if training_args.resume_from_checkpoint is not None:
        raise ValueError(
            "resume_from_checkpoint: expected none (an online run resumes from the newest complete checkpoint in "
            f"<output_dir>/checkpoints; --resume false starts afresh), got {training_args.resume_from_checkpoint!r}"
        )


def main(
    script_args: OPDScriptArguments,
    online_args: OnlineConfig,
    training_args: OPDConfig,
    model_args: ModelConfig,
) -> list[dict]:
    state = PartialState()
    _check_launch(state, script_args, training_args)
    warn_if_cpu_threads_idle(logger, state.device, command="adaflash opd")
    output_dir = Path(training_args.output_dir)
    check_folder_path(output_dir, "output_dir")
    target, tokenizer = load_target(script_args.target_model, option="target_model")
    target = target.to(state.device)
    drafter = build_drafter(script_args, target)
    serving_drafter = copy.deepcopy(drafter).eval()
    peft_config = None
    if model_args.use_peft:
        from peft import get_peft_model

        peft_config = lora_config(model_args, drafter)
        serving_drafter = get_peft_model(serving_drafter, peft_config)

    # Trackers get one row per round (step = round); inside a round train() restarts its step count, so the trainer
    # itself reports to none and its losses reach the trackers as round means.
    trackers = [name for name in training_args.report_to if name != "none"]
    training_args.report_to = []
    trainer = OPDTrainer(
        model=drafter,
        target=copy.deepcopy(
            target
        ),  # the trainer's own frozen copy: serving never shares a module with training
        args=training_args,
        processing_class=tokenizer,
        peft_config=peft_config,
    )
    if peft_config is not None:
        load_state(
            serving_drafter, publishable_state(trainer.model)
        )  # same random adapter init on both sides
    engine = AdaFlashEngine(
        target,
        serving_drafter,
        admission=AdmissionConfig(),
        gamma=script_args.gamma,
        # The paper's rule on the drafter's blocks: every request verifies its drafts each step, which is the
        # feedback OPD learns from (goodput, the greedy default, would stop drafting where the young drafter does not
        # pay yet, and a lookup round, the default's other source, has no block to learn from).
        length_mode="adaptive" if script_args.serving_mode == "adaflash" else "fixed",
        draft_source="diffusion",
    )
    traffic = TrafficSource.from_domains(
        tokenizer,
        script_args.domains,
        script_args.prompts_per_domain,
        seed=training_args.seed,
        max_prompt_tokens=script_args.max_prompt_tokens,
        phase_prompts=script_args.phase_prompts,
    )
    params = SamplingParams(
        max_new_tokens=script_args.max_new_tokens, temperature=script_args.serving_temperature
    )
    metrics = MetricsLogger(output_dir / "metrics.csv", trackers, run_name=output_dir.name)
    rows = run_online(
        trainer,
        engine,
        traffic,
        online_args,
        weights_dir=output_dir / "weights",
        checkpoint_dir=output_dir / "checkpoints",
        metrics=metrics,
        params=params,
        disable_tqdm=training_args.disable_tqdm,
    )
    trainer.accelerator.unwrap_model(trainer.model).save_pretrained(output_dir / "drafter")
    return rows


def make_parser(subparsers=None) -> TrlParser:
    dataclass_types = (OPDScriptArguments, OnlineConfig, OPDConfig, ModelConfig)
    if subparsers is not None:
        parser = subparsers.add_parser(
            "opd", help="Online on-policy distillation.", dataclass_types=dataclass_types
        )
    else:
        parser = TrlParser(dataclass_types)
    return add_config_option(parser)


if __name__ == "__main__":
    run_command(Path(__file__).name, lambda: main(*parse_script_args(make_parser())))
