"""The drafter's length head and its learning signal (remote code, like its siblings).

The head reads the drafter's final states of a block (detached) and predicts â, the fraction of the block's
``block_size - 1`` drafts the target will accept; ``AdaFlashDrafter.predict_draft_length`` turns â into k̂. Two
variants: the official AdaFlash code's ``ThreshHeadTwoModel`` (checkpoint keys ``thresh_head_two_model.*``) and the
paper's ``PaperLengthHead`` (``length_head.*``).

Its target is the realised fraction a* = accepted / (block_size - 1) of each block (``realised_acceptance``), its loss
the MSE of â against a* (``length_head_loss``) and its reported error the mean |â - a*| (``length_head_error``): one
definition each, for generate's statistics, the offline recipe, OPD, calibration and the learning curve.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class ThreshHeadTwoModel(nn.Module):
    """The official AdaFlash length head: concat(mean over block, last position) -> bottleneck MLP -> sigmoid."""

    def __init__(self, hidden_size: int, bottleneck: int):
        super().__init__()
        self.down = nn.Linear(2 * hidden_size, bottleneck)
        self.res = nn.Sequential(nn.Linear(bottleneck, bottleneck), nn.SiLU())
        self.out = nn.Linear(bottleneck, 1)

    def forward(self, block_hidden: torch.Tensor) -> torch.Tensor:
        features = torch.cat([block_hidden.mean(dim=-2), block_hidden[..., -1, :]], dim=-1)
        x = F.silu(self.down(features))
        x = x + self.res(x)
        return torch.sigmoid(self.out(x)).squeeze(-1)


class PaperLengthHead(nn.Module):
    """The paper's Algorithm 3 head: per-position Linear+SiLU, mean pool, Linear+sigmoid."""

    def __init__(self, hidden_size: int, bottleneck: int):
        super().__init__()
        self.proj = nn.Linear(hidden_size, bottleneck)
        self.out = nn.Linear(bottleneck, 1)

    def forward(self, block_hidden: torch.Tensor) -> torch.Tensor:
        pooled = F.silu(self.proj(block_hidden)).mean(dim=-2)
        return torch.sigmoid(self.out(pooled)).squeeze(-1)


def draft_lengths(acceptance: torch.Tensor, gamma: float, min_len: int, max_len: int) -> torch.Tensor:
    """The paper's adaptive rule: k̂ = clamp(floor(γ·â·max_len), min_len, max_len), max_len = block_size - 1; a NaN
    â gives min_len. One definition for every engine (``AdaFlashDrafter.predict_draft_length``, the vLLM plugin)."""
    if not 0 <= min_len <= max_len:
        raise ValueError(f"min_len: expected 0..{max_len} (block_size - 1), got {min_len}")
    if not (gamma > 0 and math.isfinite(gamma)):
        raise ValueError(f"gamma: expected a finite value > 0, got {gamma}")
    prob = torch.nan_to_num(acceptance.float(), nan=0.0, posinf=1.0, neginf=0.0)
    return torch.floor(gamma * prob * max_len).clamp(min_len, max_len).to(torch.long)


LENGTH_HEAD_ATTRIBUTE = {"two_model": "thresh_head_two_model", "paper": "length_head"}
LENGTH_HEAD_CLASS = {"two_model": ThreshHeadTwoModel, "paper": PaperLengthHead}


def realised_acceptance(accepted, block_size: int):
    """a* = accepted / (block_size - 1): the accepted fraction of a block's drafts, the length head's target.

    ``accepted`` is a count (a float comes back) or a tensor of counts (float32 comes back)."""
    if isinstance(accepted, torch.Tensor):
        return accepted.float() / (block_size - 1)
    return accepted / (block_size - 1)


def length_head_error(predicted: torch.Tensor, realised: torch.Tensor) -> torch.Tensor:
    """|â - a*| per block, for tensors ``predicted`` (â) and ``realised`` (a*) of the same shape."""
    return (predicted - realised).abs()


def length_head_loss(predicted: torch.Tensor, realised: torch.Tensor) -> torch.Tensor:
    """The length head's training loss: the mean squared error of â (in float32) against a*."""
    return F.mse_loss(predicted.float(), realised)
