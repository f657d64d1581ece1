"""EMA admission control (AdaFlash §system): who joins the batch this step, and how many drafts fit.

- Memory: each running request reserves its whole target KV (prompt + max_new_tokens) when it is admitted, and
  admission stops at ``kv_budget`` positions: the engine can never run out of KV mid-generation, so it never
  preempts. ``kv_budget=None`` (the default) becomes half of the memory available when the engine starts (CUDA:
  free device memory; CPU: MemAvailable) divided by the target's and drafter's KV bytes per position
  (``default_kv_budget``); pass an int to choose.
- Compute: one target forward takes at most ``token_budget`` query tokens (prefills + Σ(k̂_i + 1)). Admission
  estimates the verify demand of the running requests from an EMA of tokens per verify, so new prefills do not
  crowd out drafts; the drafting policy then fits each step's drafts to it (``policy.fit_budget``: the
  longest drafts are trimmed first).
- Load: N̂ ← (1 - β)·N̂ + β·N over steps (N = running requests). With ``load_aware_gamma`` the length head's γ is
  scaled by min(1, token_budget / (N̂ · block_size)): under light load drafts keep their full predicted length;
  when the fair share of the budget per request drops below a block, every request drafts proportionally less.
- Requests that do not fit stay in the waiting queue (backpressure), in arrival order; when nothing is running
  the head of the queue is always admitted, and ``AdaFlashEngine.add_request`` refuses a request that could
  never fit alone, so every request eventually runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from adaflash_hf.serving.requests import Request


def kv_bytes_per_position(model) -> int:
    """Bytes of K and V for one cached position over every layer of ``model`` (a target or a drafter)."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return config_kv_bytes_per_position(config, next(model.parameters()).element_size())


def config_kv_bytes_per_position(config, element: int) -> int:
    """``kv_bytes_per_position`` from a config (attributes as transformers names them) and bytes per element."""
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * heads * head_dim * element


def available_memory_bytes(device: torch.device) -> int:
    """Free memory where the KV pool lives: CUDA's free device memory, else the OS's MemAvailable."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 << 30  # unknown OS: assume 8 GiB


def default_kv_budget(target, drafter=None, fraction: float = 0.5, available: int | None = None) -> int:
    """KV positions that fit in ``fraction`` of the available memory (``available`` bytes, default: measured)."""
    device = next(target.parameters()).device
    available = available_memory_bytes(device) if available is None else available
    per_position = kv_bytes_per_position(target) + (
        kv_bytes_per_position(drafter) if drafter is not None else 0
    )
    return max(1, int(available * fraction) // per_position)


@dataclass(frozen=True)
class AdmissionConfig:
    max_running: int = 32
    token_budget: int = 2048
    kv_budget: int | None = None
    ema_beta: float = 0.3
    load_aware_gamma: bool = False

    def validate(self, block_size: int) -> None:
        if not (isinstance(self.max_running, int) and self.max_running >= 1):
            raise ValueError(f"admission max_running: expected an int >= 1, got {self.max_running!r}")
        if not (isinstance(self.token_budget, int) and self.token_budget >= self.max_running):
            raise ValueError(
                f"admission token_budget: expected an int >= max_running={self.max_running} (every running request "
                f"verifies at least its anchor), got {self.token_budget!r}"
            )
        if self.kv_budget is not None and not (isinstance(self.kv_budget, int) and self.kv_budget >= 1):
            raise ValueError(f"admission kv_budget: expected None or an int >= 1, got {self.kv_budget!r}")
        if not 0 < self.ema_beta <= 1:
            raise ValueError(f"admission ema_beta: expected a number in (0, 1], got {self.ema_beta!r}")


class AdmissionController:
    def __init__(self, config: AdmissionConfig, block_size: int):
        config.validate(block_size)
        self.config = config
        self.block_size = block_size
        self.ema_running = 0.0
        self.ema_verify_tokens = float(block_size)  # tokens per verify (k̂ + 1), pessimistic until measured

    def check_request(self, request: Request) -> None:
        """A request that could never be admitted alone is refused up front rather than queued forever."""
        prompt = len(request.prompt)
        if prompt > self.config.token_budget:
            raise ValueError(
                f"prompt length: expected <= admission token_budget={self.config.token_budget} (prefill runs in one "
                f"forward), got {prompt}"
            )
        budget = self.config.kv_budget
        if budget is not None and request.kv_reservation > budget:
            raise ValueError(
                f"prompt length + max_new_tokens: expected <= admission kv_budget={budget}, got "
                f"{request.kv_reservation}"
            )

    def admit(self, waiting: Sequence[Request], running: Sequence[Request]) -> list[Request]:
        """The longest prefix of ``waiting`` that fits this step's slots, KV and token budgets."""
        cfg = self.config
        reserved = sum(r.kv_reservation for r in running)
        tokens = len(running) * self.ema_verify_tokens
        admitted: list[Request] = []
        for request in waiting:
            if len(running) + len(admitted) >= cfg.max_running:
                break
            idle = not running and not admitted
            if cfg.kv_budget is not None and reserved + request.kv_reservation > cfg.kv_budget and not idle:
                break
            if tokens + len(request.prompt) > cfg.token_budget and not idle:
                break
            admitted.append(request)
            reserved += request.kv_reservation
            tokens += len(request.prompt)
        return admitted

    def gamma_scale(self) -> float:
        if not self.config.load_aware_gamma or self.ema_running <= 0:
            return 1.0
        return min(1.0, self.config.token_budget / (self.ema_running * self.block_size))

    def update(self, running: int, verify_tokens: int, verifies: int) -> None:
        beta = self.config.ema_beta
        self.ema_running = (
            running if self.ema_running == 0 else (1 - beta) * self.ema_running + beta * running
        )
        if verifies:
            per_request = verify_tokens / verifies
            self.ema_verify_tokens = (1 - beta) * self.ema_verify_tokens + beta * per_request


def with_kv_budget(admission: AdmissionConfig | None, target, drafter) -> AdmissionConfig:
    """``admission`` with ``kv_budget`` derived from the available memory when it is None: a request reserves its
    whole KV up front, so an unbounded pool could ask for more than the machine has."""
    admission = admission or AdmissionConfig()
    if admission.kv_budget is None:
        admission = replace(admission, kv_budget=default_kv_budget(target, drafter))
    return admission
