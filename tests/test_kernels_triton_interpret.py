"""The Triton kernels against the float64 reference / the torch fallback.

On CPU each check runs in a subprocess with ``TRITON_INTERPRET=1`` in its environment from the start
(the flag is read when ``@triton.jit`` decorates, and pytest has imported the kernels by then), at small
sizes with small vocabulary tiles so the tiling loops and ragged tails run. With CUDA the same checks run
in-process at larger sizes (``-m gpu``; examples/gpu/run_gpu_checks.sh).

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
from adaflash_hf.kernels.verify_attention import packed_verify_attention
from adaflash_hf.kernels.verify_packing import pack_verify_batch

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
        packed = pack_verify_batch(torch.zeros(batch, dtype=torch.long), drafts, [0] * batch)
        logits = torch.randn(packed.total, vocab, generator=g)
        is_bonus = torch.zeros(packed.total, dtype=torch.bool)
        is_bonus[packed.cu_seqlens_q[1:].long() - 1] = True
        logits[~is_bonus, packed.draft_tokens] += 6 * torch.rand(packed.draft_tokens.numel(), generator=g)
        temps = torch.where(torch.rand(batch, generator=g) < 0.4, 0.0, 0.5 + torch.rand(batch, generator=g))
        q = (
            torch.softmax(torch.randn(packed.draft_tokens.numel(), vocab, generator=g), -1)
            if case % 2
            else None
        )
        accept_u = torch.rand(packed.draft_tokens.numel(), generator=g)
        sample_u = torch.rand(batch, generator=g)
        args = (packed.draft_tokens, packed.cu_seqlens_q, temps, q, accept_u, sample_u)
        expected = verify_accept(logits, *args, impl="torch")
        moved = [None if a is None else a.to(device) for a in args]
        out = verify_accept(logits.to(device), *moved, impl="triton", block_v=128 if small else None)
        assert out.accepted.tolist() == expected.accepted.tolist(), (case, out, expected)
        assert out.next_tokens.tolist() == expected.next_tokens.tolist(), (case, out, expected)


def check_verify_attention(device: str) -> None:
    warnings.filterwarnings("ignore", category=RuntimeWarning)
    small = device == "cpu"
    g = torch.Generator().manual_seed(3)
    q_lens = [1, 17, 5, 16, 2]
    prefix_lens = [0, 40, 70, 3, 130] if small else [0, 1000, 4000, 3, 130]
    for heads, kv_heads, head_dim in [(4, 2, 24), (2, 2, 64)]:
        k_lens = [p + n for p, n in zip(prefix_lens, q_lens)]
        cu_q = torch.tensor([0, *q_lens]).cumsum(0).int()
        cu_k = torch.tensor([0, *k_lens]).cumsum(0).int()
        query = torch.randn(sum(q_lens), heads, head_dim, generator=g)
        key = torch.randn(sum(k_lens), kv_heads, head_dim, generator=g)
        value = torch.randn(sum(k_lens), kv_heads, head_dim, generator=g)
        expected = packed_verify_attention(
            query.double(), key.double(), value.double(), cu_q, cu_k, impl="torch"
        )
        args = [x.to(device) for x in (query, key, value, cu_q, cu_k)]
        out = packed_verify_attention(*args, max(q_lens), impl="triton")
        _close(out.cpu(), expected, 1e-5 if small else 5e-3)


CHECKS = ["check_clipped_kl", "check_verify_accept", "check_verify_attention"]


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
