"""The Triton kernels against the float64 reference / the torch fallback.

On CPU each check runs in a subprocess with ``TRITON_INTERPRET=1`` in its environment from the start
(the flag is read when ``@triton.jit`` decorates, and pytest has imported the kernels by then), at small
sizes with small vocabulary tiles so the tiling loops and ragged tails run. With CUDA the same checks run
in-process at larger sizes (``-m gpu``; experiments/gpu/run_gpu_checks.sh).

Tolerances: loss 1e-5 relative, gradients 1e-5 of max|grad| (fp32 math against a float64 reference);
acceptance exact; attention 1e-5 in the interpreter (exact fp32 dots), 5e-3 on GPU (TF32 dots).
"""

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from adaflash_hf.kernels.clipped_kl import clipped_distill_loss_reference, fused_clipped_distill_loss
from adaflash_hf.kernels.verify_accept import verify_accept
from adaflash_hf.kernels.verify_attention import slot_verify_attention
from adaflash_hf.kernels.verify_packing import SlotPacking

REPO = Path(__file__).resolve().parents[1]


def _close(actual, expected, rel):
    scale = max(expected.abs().max().item(), 1e-12)
    err = (actual.double() - expected.double()).abs().max().item()
    assert err <= rel * scale, f"max abs error {err:.3g} > {rel} * {scale:.3g}"


def check_clipped_kl(device: str) -> None:
    warnings.filterwarnings("ignore", category=RuntimeWarning)  # interpreter: masked lanes of log/exp
    small = device == "cpu"
    n, hidden, vocab = (10, 16, 1000) if small else (512, 256, 151936)
    block_v = 256 if small else None
    g = torch.Generator().manual_seed(0)
    h = torch.randn(n, hidden, generator=g)
    weight = torch.randn(vocab, hidden, generator=g) * 0.3
    target = h @ weight.T + torch.randn(n, vocab, generator=g)
    target[:, -5:] = float("-inf")
    target[1, : vocab // 3] = float("-inf")
    row_weights = torch.rand(n, generator=g)
    cases = [
        dict(clip_mode="entry", delta=0.01, temperature=1.0, row_weights=None),
        dict(clip_mode="entry", delta=1e-4, temperature=2.0, row_weights=row_weights),
        dict(clip_mode="row", delta=0.05, temperature=1.0, row_weights=row_weights),
        dict(clip_mode="row", delta=1e-3, temperature=0.7, row_weights=None),
    ]
    for case in cases:
        hd = h.to(device, copy=True).requires_grad_()
        wd = weight.to(device, copy=True).requires_grad_()
        rw = None if case["row_weights"] is None else case["row_weights"].to(device)
        out = fused_clipped_distill_loss(
            hd,
            wd,
            target.to(device),
            **{**case, "row_weights": rw},
            chunk_size=4,
            impl="triton",
            block_v=block_v,
        )
        out.loss.backward()
        hr = h.double().requires_grad_()
        wr = weight.double().requires_grad_()
        ref = clipped_distill_loss_reference(hr, wr, target.double(), **case)
        ref.loss.backward()
        for name in out._fields:
            _close(getattr(out, name).cpu(), getattr(ref, name), 1e-5)
        _close(hd.grad.cpu(), hr.grad, 1e-5)
        _close(wd.grad.cpu(), wr.grad, 1e-5)
    # All-equal logits: uniform distributions, finite gradients.
    flat = fused_clipped_distill_loss(
        torch.zeros(4, hidden, device=device, requires_grad=True),
        weight.to(device),
        torch.zeros(4, vocab, device=device),
        impl="triton",
        block_v=block_v,
    )
    _close(flat.ce.cpu(), torch.tensor(torch.log(torch.tensor(float(vocab))).item()), 1e-6)


def check_verify_accept(device: str) -> None:
    warnings.filterwarnings("ignore", category=RuntimeWarning)
    small = device == "cpu"
    vocab, cases = (300, 12) if small else (151936, 50)
    g = torch.Generator().manual_seed(7)
    for case in range(cases):
        batch = int(torch.randint(1, 6 if small else 65, (1,), generator=g))
        lengths = torch.randint(0, 17, (batch,), generator=g).tolist()
        lengths[0] = [0, 1, 15, 16][case % 4]
        drafts = [torch.randint(0, vocab, (k,), generator=g) for k in lengths]
        draft_tokens = torch.cat(drafts)
        cu_seqlens = torch.tensor([0, *[k + 1 for k in lengths]]).cumsum(0).int()
        total = int(cu_seqlens[-1])
        logits = torch.randn(total, vocab, generator=g)
        is_bonus = torch.zeros(total, dtype=torch.bool)
        is_bonus[cu_seqlens[1:].long() - 1] = True
        logits[~is_bonus, draft_tokens] += 6 * torch.rand(draft_tokens.numel(), generator=g)
        temps = torch.where(torch.rand(batch, generator=g) < 0.4, 0.0, 0.5 + torch.rand(batch, generator=g))
        q = torch.softmax(torch.randn(draft_tokens.numel(), vocab, generator=g), -1) if case % 2 else None
        accept_u = torch.rand(draft_tokens.numel(), generator=g)
        sample_u = torch.rand(batch, generator=g)
        args = (draft_tokens, cu_seqlens, temps, q, accept_u, sample_u)
        expected = verify_accept(logits, *args, impl="torch")
        moved = [None if a is None else a.to(device) for a in args]
        out = verify_accept(logits.to(device), *moved, impl="triton", block_v=128 if small else None)
        assert out.accepted.tolist() == expected.accepted.tolist(), (case, out, expected)
        # A sampled token is the inverse CDF of u; the two kernels sum a 151936-entry CDF in another order, so where
        # u falls within fp32 rounding of a boundary they may pick neighbours. Each must lie between the float64
        # inverse CDFs at u -/+ 3e-5, and such rows must be rare; greedy rows (lo == hi) must match exactly.
        logits64, u = logits.to(device, torch.float64), moved[-1]
        lo = verify_accept(logits64, *moved[:-1], (u - 3e-5).clamp_min(0.0), impl="torch").next_tokens.cpu()
        hi = verify_accept(
            logits64, *moved[:-1], (u + 3e-5).clamp_max(1 - 1e-7), impl="torch"
        ).next_tokens.cpu()
        got = out.next_tokens.cpu()
        for tokens in (got, expected.next_tokens):
            assert bool(((lo <= tokens) & (tokens <= hi)).all()), (case, tokens, lo, hi)
        differ = int((got != expected.next_tokens).sum())
        assert differ <= max(1, batch // 10), (case, differ, batch)


def check_verify_attention(device: str) -> None:
    warnings.filterwarnings("ignore", category=RuntimeWarning)
    small = device == "cpu"
    g = torch.Generator().manual_seed(3)
    # Verifies (k̂ + 1 <= 16 tokens) and two prefills (17, 70 tokens: more than one query tile) on the slot pool.
    lengths = [1, 17, 5, 16, 2, 70]
    starts = [0, 40, 70, 3, 130, 0] if small else [0, 1000, 4000, 3, 130, 0]
    capacity = max(s + n for s, n in zip(starts, lengths)) + 8
    for heads, kv_heads, head_dim in [(4, 2, 24), (2, 2, 64)]:
        slots = torch.randperm(len(lengths) + 2, generator=g)[: len(lengths)].tolist()
        query = torch.randn(sum(lengths), heads, head_dim, generator=g)
        key_pool = torch.randn(len(lengths) + 2, capacity, kv_heads, head_dim, generator=g)
        value_pool = torch.randn(len(lengths) + 2, capacity, kv_heads, head_dim, generator=g)
        reference = SlotPacking.build(slots, starts, lengths, 16, torch.device("cpu"))
        expected = slot_verify_attention(
            query.double(), key_pool.double(), value_pool.double(), reference, impl="torch"
        )
        packing = SlotPacking.build(slots, starts, lengths, 16, torch.device(device))
        args = [x.to(device) for x in (query, key_pool, value_pool)]
        out = slot_verify_attention(*args, packing, impl="triton")
        _close(out.cpu(), expected, 1e-5 if small else 5e-3)


def check_engine_packed_forward(device: str) -> None:
    """The engine's packed target forward (prefills and ragged verifies) with the Triton attention equals it with
    the torch attention."""
    sys.path.insert(
        0, str(Path(__file__).resolve().parent)
    )  # conftest, also inside the interpreter subprocess
    from conftest import make_target

    from adaflash_hf.serving.cache import RaggedBatch, SlotKVStore, packed_target_forward

    warnings.filterwarnings("ignore", category=RuntimeWarning)
    target = make_target("llama", num_hidden_layers=2).to(device)
    rounds = [([5, 0, 2], [0, 0, 0], [7, 20, 3]), ([5, 0, 2, 1], [7, 20, 3, 0], [5, 1, 16, 18])]
    logits = {}
    previous = os.environ.get("ADAFLASH_KERNELS")
    try:
        for impl in ("torch", "triton"):
            os.environ["ADAFLASH_KERNELS"] = impl  # the attention function reads it at every call
            store = SlotKVStore(target.config.num_hidden_layers)
            store.reserve(8, 64)
            g = torch.Generator().manual_seed(0)
            logits[impl] = []
            for slots, starts, lengths in rounds:
                ids = torch.randint(0, 512, (1, sum(lengths)), generator=g).to(device)
                batch = RaggedBatch.build(store, slots, starts, lengths, 16, torch.device(device))
                with torch.no_grad():
                    logits[impl].append(packed_target_forward(target, ids, batch).logits.cpu())
    finally:
        if previous is None:
            os.environ.pop("ADAFLASH_KERNELS", None)
        else:
            os.environ["ADAFLASH_KERNELS"] = previous
    for expected, out in zip(logits["torch"], logits["triton"]):
        _close(out, expected, 1e-5 if device == "cpu" else 5e-3)


CHECKS = [
    "check_clipped_kl",
    "check_verify_accept",
    "check_verify_attention",
    "check_engine_packed_forward",
]


@pytest.mark.parametrize("check", CHECKS)
def test_triton_kernel_in_interpreter(check):
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('interp_checks', {str(Path(__file__))!r})\n"
        "module = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(module)\n"
        f"module.{check}('cpu')\n"
    )
    env = {**os.environ, "TRITON_INTERPRET": "1", "ADAFLASH_KERNELS": "triton"}
    result = subprocess.run(
        [sys.executable, "-P", "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-4000:]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("check", CHECKS)
def test_triton_kernel_on_cuda(check):
    globals()[check]("cuda")
