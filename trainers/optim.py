"""The drafter's two parameter groups (drafter body, length head), their AdamW and their separate clipping.

Shared by the offline and the online trainer. The groups are clipped each on its own so the length head's loss can
never shrink the drafter's update (AdaFlash trains the head on detached states with its own learning rate).
"""

from __future__ import annotations

import torch

from adaflash_hf.online.weights import base_drafter


def split_drafter_and_head(model) -> dict[str, list[torch.nn.Parameter]]:
    """Trainable parameters as ``{"drafter": [...], "length_head": [...]}``; works on a PEFT-wrapped drafter too."""
    head_prefix = base_drafter(model).length_head_name + "."
    groups: dict[str, list[torch.nn.Parameter]] = {"drafter": [], "length_head": []}
    for name, param in model.named_parameters():
        if param.requires_grad:
            # Under PEFT the head's names gain a "base_model.model." prefix and a modules_to_save level.
            is_head = name.startswith(head_prefix) or f".{head_prefix}" in name
            groups["length_head" if is_head else "drafter"].append(param)
    return groups


def two_group_adamw(groups: dict[str, list[torch.nn.Parameter]], args) -> torch.optim.AdamW:
    """AdamW with the drafter at ``args.learning_rate`` and the head at ``args.length_head_learning_rate``."""
    return torch.optim.AdamW(
        [
            {"params": groups["drafter"], "lr": args.learning_rate, "name": "drafter"},
            {"params": groups["length_head"], "lr": args.length_head_learning_rate, "name": "length_head"},
        ],
        betas=(args.adam_beta1, args.adam_beta2),
        eps=args.adam_epsilon,
        weight_decay=args.weight_decay,
    )


def clip_each_group(groups: dict[str, list[torch.nn.Parameter]], max_norm: float) -> dict[str, torch.Tensor]:
    """Clip every group to ``max_norm`` on its own; returns each group's norm before clipping."""
    norms = {}
    for name, params in groups.items():
        with_grad = [p for p in params if p.grad is not None]
        norms[name] = torch.nn.utils.clip_grad_norm_(with_grad, max_norm) if with_grad else torch.tensor(0.0)
    return norms
