"""Speculative decoding on a CUDA device, in one command: is it lossless there, is a forward batch-invariant there,
and what does a verify forward cost there.

    python -P experiments/gpu/cuda_checks.py --output runs/cuda_checks.json

Random-weight targets, so the checks need no download: SmolLM2-135M's shape (Llama, 30 layers, hidden 576) with the
shipped drafter (its acceptance on a random target is near 0, but lookup drafts of a random model's repetitive text
are accepted, so rounds keep several tokens and roll back the rest), and a tiny Qwen3 with a random drafter.

1. ``generate``: greedy output with ``assistant_model=drafter`` against plain greedy, token for token, per length mode
   and draft source, in fp32 (TF32 off) and bf16, and the engine's packed verify in fp32.
2. Batch invariance: ``adaflash_hf.prepared.prepare.check_batch_invariance`` (row i of an n-token forward equal, bitwise, to the
   same token decoded alone) on the eager fp32 and bf16 targets, and the largest logit difference per n.
3. The verify-cost curve: median seconds of a forward of n = 1..16 new tokens after 200 tokens of context, as a ratio
   of the 1-token forward (CUDA events around each).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

import adaflash_hf  # noqa: F401  (hooks generate)
from adaflash_hf import AdaFlashConfig, AdaFlashDrafter
from adaflash_hf.prepared.prepare import check_batch_invariance, prepare_target
from adaflash_hf.serving.engine import AdaFlashEngine, SamplingParams

REPO = Path(__file__).resolve().parents[2]
DRAFTER = REPO / "examples" / "drafters" / "smollm2-135m-adaflash"
ARMS = [
    dict(adaflash_length_mode="fixed", adaflash_draft_source="diffusion"),
    dict(adaflash_length_mode="adaptive", adaflash_draft_source="diffusion"),
    dict(adaflash_length_mode="goodput", adaflash_draft_source="diffusion"),
    dict(adaflash_length_mode="goodput", adaflash_draft_source="hybrid"),
    dict(adaflash_length_mode="adaptive", adaflash_draft_source="hybrid"),
]


def smollm2_shaped(dtype, device):
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=8192,
        rope_theta=100000.0,
        tie_word_embeddings=True,
        eos_token_id=None,
        pad_token_id=None,
    )
    target = LlamaForCausalLM(config).to(device=device, dtype=dtype).eval()
    drafter = AdaFlashDrafter.from_pretrained(DRAFTER).to(device=device, dtype=dtype).eval()
    return target, drafter


def tiny_qwen3(dtype, device):
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        eos_token_id=None,
        pad_token_id=None,
    )
    target = Qwen3ForCausalLM(config).to(device=device, dtype=dtype).eval()
    torch.manual_seed(1)
    drafter_config = AdaFlashConfig.for_target(target.config, num_hidden_layers=2, mask_token_id=511)
    drafter = AdaFlashDrafter(drafter_config).to(device=device, dtype=dtype).eval()
    return target, drafter


BUILDERS = {"smollm2-shaped": smollm2_shaped, "tiny-qwen3": tiny_qwen3}


def prompts(vocab: int, count: int, device) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(123)
    return [torch.randint(0, vocab, (1, 24 + 8 * i), generator=generator).to(device) for i in range(count)]


def check_generate(name, target, drafter, ids_list, max_new_tokens):
    rows = []
    plain = [target.generate(ids, max_new_tokens=max_new_tokens, do_sample=False) for ids in ids_list]
    for arm in ARMS:
        equal, taus, lengths = 0, [], []
        started = time.perf_counter()
        for ids, reference in zip(ids_list, plain):
            out = target.generate(
                ids, assistant_model=drafter, max_new_tokens=max_new_tokens, do_sample=False, **arm
            )
            equal += int(out.shape == reference.shape and bool(out.eq(reference).all()))
            stats = drafter.last_stats
            taus.append(stats.tau)
            lengths.append(stats.mean_verify_length)
        row = dict(
            target=name,
            dtype=str(next(target.parameters()).dtype).removeprefix("torch."),
            **{k.removeprefix("adaflash_"): v for k, v in arm.items()},
            exact=f"{equal}/{len(ids_list)}",
            tau=round(statistics.mean(taus), 2),
            mean_verify_length=round(statistics.mean(lengths), 2),
            seconds=round(time.perf_counter() - started, 2),
        )
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def check_engine(name, target, drafter, ids_list, max_new_tokens):
    plain = [
        target.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)[0, ids.shape[1] :].tolist()
        for ids in ids_list
    ]
    engine = AdaFlashEngine(target, drafter)
    outputs = engine.generate(
        [ids[0].tolist() for ids in ids_list], SamplingParams(max_new_tokens=max_new_tokens)
    )
    equal = sum(int(list(out) == ref) for out, ref in zip(outputs, plain))
    row = dict(target=name, engine="default", exact=f"{equal}/{len(ids_list)}", requests=len(ids_list))
    print(json.dumps(row), flush=True)
    return row


def invariance(name, target, rows=16):
    try:
        check_batch_invariance(target, rows)
        verdict = "batch-invariant"
    except RuntimeError as error:
        verdict = str(error).split(":", 1)[1].split(". Prepare")[0].strip()
    device = next(target.parameters()).device
    vocab = target.get_input_embeddings().weight.shape[0]
    generator = torch.Generator().manual_seed(0)
    context = 200
    ids = torch.randint(0, vocab, (1, context + rows), generator=generator).to(device)
    from transformers import DynamicCache

    cache = DynamicCache()
    with torch.inference_mode():
        target(input_ids=ids[:, :context], cache=cache, use_cache=True, logits_to_keep=1)
        alone = (
            target(input_ids=ids[:, context : context + 1], cache=cache, use_cache=True).logits[0, -1].float()
        )
        cache.crop(-1)
        diffs = {}
        for n in (2, 4, 8, 16):
            logits = target(input_ids=ids[:, context : context + n], cache=cache, use_cache=True).logits[0, 0]
            cache.crop(-n)
            diffs[n] = float((logits.float() - alone).abs().max())
    dtype = next(target.parameters()).dtype
    row = dict(
        target=name,
        dtype=str(dtype).removeprefix("torch."),
        eager=verdict,
        prepared=prepared_verdict(name, device, rows) if dtype == torch.bfloat16 else "bf16 only",
        max_abs_diff_row0=diffs,
    )
    print(json.dumps(row), flush=True)
    return row


def prepared_verdict(name, device, rows) -> str:
    """What ``prepare_target(dtype="bf16", invariant=True)`` says on a fresh copy on this device; where it prepares,
    greedy ``generate`` of the prepared target is checked against its own plain decoding too."""
    target, drafter = BUILDERS[name](torch.float32, device)
    try:
        prepare_target(target, dtype="bf16", invariant=True, rows=rows)
    except Exception as error:  # noqa: BLE001 - the report records whatever it raised
        return f"{type(error).__name__}: {str(error)[:300]}"
    drafter.to(torch.bfloat16)
    ids_list = prompts(target.config.vocab_size, 2, device)
    arms = check_generate(f"{name}, prepared", target, drafter, ids_list, 32)
    return "prepared: batch-invariant; generate exact " + ", ".join(arm["exact"] for arm in arms)


def verify_cost(name, target, repeats=20):
    from transformers import DynamicCache

    device = next(target.parameters()).device
    vocab = target.get_input_embeddings().weight.shape[0]
    ids = torch.randint(0, vocab, (1, 216), generator=torch.Generator().manual_seed(0)).to(device)
    cache = DynamicCache()
    seconds = {}
    with torch.inference_mode():
        target(input_ids=ids[:, :200], cache=cache, use_cache=True, logits_to_keep=1)
        for n in (1, 2, 4, 8, 16):
            times = []
            for _ in range(repeats + 3):
                if device.type == "cuda":
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                tick = time.perf_counter()
                target(input_ids=ids[:, 200 : 200 + n], cache=cache, use_cache=True, logits_to_keep=n)
                if device.type == "cuda":
                    end.record()
                    torch.cuda.synchronize()
                    times.append(start.elapsed_time(end) / 1000)
                else:
                    times.append(time.perf_counter() - tick)
                cache.crop(-n)
            seconds[n] = statistics.median(times[3:])
    row = dict(
        target=name,
        dtype=str(next(target.parameters()).dtype).removeprefix("torch."),
        one_token_ms=round(seconds[1] * 1000, 2),
        ratio={n: round(s / seconds[1], 3) for n, s in seconds.items()},
    )
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, default=Path("runs/cuda_checks.json"))
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--device", default="cuda", help="cuda, or cpu for a dry run of the script itself")
    parser.add_argument(
        "--targets", nargs="+", default=["smollm2-shaped", "tiny-qwen3"], choices=list(BUILDERS)
    )
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("cuda_checks.py: --device cuda: no CUDA device (torch.cuda.is_available() is False)")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    name_of_device = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    report = dict(device=name_of_device, torch=torch.__version__, generate=[], engine=[])
    report["invariance"], report["verify_cost"] = [], []
    for name in args.targets:
        build = BUILDERS[name]
        for dtype in (torch.float32, torch.bfloat16):
            target, drafter = build(dtype, device)
            ids_list = prompts(target.config.vocab_size, args.prompts, device)
            report["generate"] += check_generate(name, target, drafter, ids_list, args.max_new_tokens)
            if dtype == torch.float32:
                report["engine"].append(check_engine(name, target, drafter, ids_list, args.max_new_tokens))
            report["invariance"].append(invariance(name, target))
            if name == "smollm2-shaped":
                report["verify_cost"].append(verify_cost(name, target))
            del target, drafter
            if device.type == "cuda":
                torch.cuda.empty_cache()
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
