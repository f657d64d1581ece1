"""Micro-benchmark of the kernels: ``adaflash bench kernels [--device cpu|cuda] [--output kernels.json]``.

Clipped distillation loss (forward + backward), per vocabulary size: ``naive`` (materialised N x V logits
and autograd, ``clipped_distill_loss_reference``), ``fallback`` (chunked torch, closed-form gradient) and, on
CUDA, ``triton``. Acceptance over a packed verify batch of B requests with k̂ = 16 (sampling, one-hot
proposals): ``fallback`` and, on CUDA, ``triton``. Times are medians over ``--repeats`` after one warm-up.
Peak memory is the working memory above the inputs: ``torch.cuda.max_memory_allocated`` on CUDA; on CPU
each variant runs in a fresh subprocess and reports its RSS high-water mark minus its RSS before the run
(``experiments/goals.py kernels`` grades the fused loss's goals on the ``--output`` record).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import torch

from adaflash_hf.bench.machine import in_fresh_process, memory_base, memory_peak
from adaflash_hf.bench.report import add_record_options, fmt, parse_record_args, print_record, table
from adaflash_hf.kernels.clipped_kl import clipped_distill_loss_reference, fused_clipped_distill_loss
from adaflash_hf.kernels.verify_accept import verify_accept
from adaflash_hf.launch import int_at_least

LOSS_IMPLS = {"naive": None, "fallback": "torch", "triton": "triton"}


def _median_ms(step, repeats: int, device: str) -> float:
    """Median milliseconds of ``repeats`` calls of ``step``, the device synchronised around each."""
    times = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _loss_inputs(rows: int, hidden: int, vocab: int, device: str, dtype: torch.dtype):
    g = torch.Generator(device=device).manual_seed(0)
    h = torch.randn(rows, hidden, device=device, dtype=dtype, generator=g).requires_grad_()
    weight = (torch.randn(vocab, hidden, device=device, dtype=dtype, generator=g) * 0.02).requires_grad_()
    target = torch.randn(rows, vocab, device=device, dtype=dtype, generator=g)
    return h, weight, target


def _loss_step(variant: str, h, weight, target) -> None:
    if variant == "naive":
        out = clipped_distill_loss_reference(h, weight, target)
    else:
        out = fused_clipped_distill_loss(h, weight, target, impl=LOSS_IMPLS[variant])
    out.loss.backward()
    h.grad = weight.grad = None


def measure_loss(
    variant: str, rows: int, hidden: int, vocab: int, device: str, repeats: int, threads: int
) -> dict:
    """Median time (ms) and peak working memory (MiB) of one forward + backward, in this process."""
    torch.set_num_threads(threads)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    h, weight, target = _loss_inputs(rows, hidden, vocab, device, dtype)
    if device == "cuda":
        _loss_step(variant, h, weight, target)  # warm-up (Triton compile)
    base = memory_base(device)
    ms = _median_ms(lambda: _loss_step(variant, h, weight, target), repeats, device)
    return {"ms": ms, "peak_mib": (memory_peak(device) - base) / 2**20}


def _measure_loss_isolated(variant, rows, hidden, vocab, device, repeats, threads) -> dict:
    """CPU: one fresh process per variant so the RSS high-water mark belongs to that variant alone."""
    if device == "cuda":
        try:
            return measure_loss(variant, rows, hidden, vocab, device, repeats, threads)
        except torch.OutOfMemoryError:
            torch.cuda.empty_cache()
            return {"ms": None, "peak_mib": None, "error": "OOM"}
    spec = [variant, rows, hidden, vocab, device, repeats, threads]
    return in_fresh_process("adaflash_hf.bench.kernels", "measure_loss", spec, threads)


def measure_accept(impl: str, batch: int, vocab: int, device: str, repeats: int, draft_len: int = 16) -> dict:
    g = torch.Generator(device=device).manual_seed(0)
    total = batch * (draft_len + 1)
    logits = torch.randn(total, vocab, device=device, generator=g)
    drafts = torch.randint(0, vocab, (batch * draft_len,), device=device, generator=g)
    cu = torch.arange(0, total + 1, draft_len + 1, device=device, dtype=torch.int32)
    temps = torch.ones(batch, device=device)
    accept_u = torch.rand(batch * draft_len, device=device, generator=g)
    sample_u = torch.rand(batch, device=device, generator=g)
    accept = functools.partial(verify_accept, logits, drafts, cu, temps, None, accept_u, sample_u, impl=impl)
    accept()
    return {"ms": _median_ms(accept, repeats, device)}


def run(args) -> dict:
    loss_variants = ["naive", "fallback"] + (["triton"] if args.device == "cuda" else [])
    results = {"device": args.device, "loss": [], "accept": []}
    for vocab in args.vocab:
        for rows in args.rows:
            naive = None
            for variant in loss_variants:
                entry = {"vocab": vocab, "rows": rows, "hidden": args.hidden, "variant": variant}
                entry.update(
                    _measure_loss_isolated(
                        variant, rows, args.hidden, vocab, args.device, args.repeats, args.threads
                    )
                )
                naive = entry if variant == "naive" else naive
                ok = naive.get("ms") and entry.get("ms")
                entry["speedup_vs_naive"] = naive["ms"] / entry["ms"] if ok else None
                ok = naive.get("peak_mib") and entry.get("peak_mib")
                entry["memory_vs_naive"] = entry["peak_mib"] / naive["peak_mib"] if ok else None
                results["loss"].append(entry)
    accept_impls = ["torch"] + (["triton"] if args.device == "cuda" else [])
    for batch in args.accept_batches:
        for impl in accept_impls:
            entry = {"vocab": args.accept_vocab, "batch": batch, "impl": impl}
            entry.update(measure_accept(impl, batch, args.accept_vocab, args.device, args.repeats))
            results["accept"].append(entry)
    return results


def format_tables(results: dict) -> str:
    loss = [
        [
            e["vocab"],
            e["rows"],
            e["hidden"],
            e["variant"],
            fmt(e.get("ms"), ".1f"),
            fmt(e.get("peak_mib"), ".1f"),
        ]
        + [fmt(e["speedup_vs_naive"]), fmt(e["memory_vs_naive"], ".3f")]
        for e in results["loss"]
    ]
    header = "V|N|H|variant|median ms|peak MiB|speedup vs naive|memory vs naive".split("|")
    text = f"Clipped distillation loss, forward + backward ({results['device']})\n\n" + table(header, loss)
    if results["accept"]:
        rows = [[e["vocab"], e["batch"], e["impl"], fmt(e["ms"])] for e in results["accept"]]
        text += "\nAcceptance, k̂ = 16 per request, sampling\n\n" + table(
            ["V", "B", "impl", "median ms"], rows
        )
    return text


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="adaflash bench kernels", description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    count = int_at_least(1)
    parser.add_argument("--vocab", type=count, nargs="+", default=[49152, 151936])
    parser.add_argument(
        "--rows", type=count, nargs="+", help="N (default: 512 on cpu; 1024 4096 16384 on cuda)"
    )
    parser.add_argument("--hidden", type=count, help="H (default: 576, SmolLM2, on cpu; 4096 on cuda)")
    parser.add_argument("--repeats", type=count, default=3)
    parser.add_argument(
        "--accept-batches", type=count, nargs="*", help="B (default: 1 8 on cpu; 1..128 on cuda)"
    )
    parser.add_argument("--accept-vocab", type=count, default=151936)
    add_record_options(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = parse_record_args(make_parser(), argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: CUDA is not available on this machine")
    cuda = args.device == "cuda"
    args.rows = args.rows or ([1024, 4096, 16384] if cuda else [512])
    args.hidden = args.hidden or (4096 if cuda else 576)
    if args.accept_batches is None:
        args.accept_batches = [1, 2, 4, 8, 16, 32, 64, 128] if cuda else [1, 8]
    results = run(args)
    return print_record(format_tables(results), results, args.output)


if __name__ == "__main__":
    raise SystemExit(main())
