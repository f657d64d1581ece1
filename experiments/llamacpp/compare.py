"""llama.cpp's plain decoding beside ours on the same prompts and the same weights: a figure, not a test.

Not part of ``make test``. Its own install line (llama-cpp-python builds llama.cpp from source, about 7 minutes on 2
cores; the GGUF converter comes with it, under ``vendor/llama.cpp``):

    .venv/bin/pip install llama-cpp-python==0.3.36 --no-binary llama-cpp-python
    .venv/bin/python experiments/llamacpp/compare.py --out runs/llamacpp --prompts 12 --max-new-tokens 96

The target is the offline SmolLM2-135M-Instruct, saved in transformers format and converted to a bf16 GGUF with
llama.cpp's own ``convert_hf_to_gguf.py`` (the shipped Q4_1 file is a different quantisation, and some llama.cpp
builds crash on it). On held-out prompts (chat-templated token ids, the same for every engine), greedy, one request at
a time, ``--threads`` threads, it times: llama.cpp (bf16 GGUF), transformers eager fp32 and bf16, and the target as
``prepare_target(dtype="auto")`` prepares it; tokens/s per engine (new tokens over decode seconds, prompt included)
and each engine's ratio to llama.cpp. Writes ``<out>/results.json`` with the host (CPU model and bf16 units).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path


def host() -> dict:
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    model = next(
        (line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), ""
    )
    flags = set(info.split())
    return {"cpu": model, "bf16_units": [f for f in ("amx_bf16", "avx512_bf16") if f in flags]}


def converter() -> Path:
    import llama_cpp

    root = Path(llama_cpp.__file__).resolve().parent
    for candidate in [root / "vendor/llama.cpp/convert_hf_to_gguf.py", *root.rglob("convert_hf_to_gguf.py")]:
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        "convert_hf_to_gguf.py: expected it inside the llama_cpp package (install llama-cpp-python from source, "
        "see this script's docstring), got none"
    )


def gguf_of(out: Path) -> Path:
    """The target as transformers weights and as a bf16 GGUF (written once)."""
    from adaflash_hf.assets import load_target

    folder, gguf = out / "target", out / "target-bf16.gguf"
    if not gguf.is_file():
        target, tokenizer = load_target()
        target.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        command = [sys.executable, str(converter()), str(folder), "--outtype", "bf16", "--outfile", str(gguf)]
        subprocess.run(command, check=True)
    return gguf


def time_llamacpp(gguf: Path, prompts: list[list[int]], new_tokens: int, threads: int) -> tuple[float, list]:
    from llama_cpp import Llama

    llm = Llama(model_path=str(gguf), n_ctx=2048, n_threads=threads, n_batch=512, verbose=False)
    texts, seconds, produced = [], 0.0, 0
    for prompt in prompts:
        llm.reset()
        started = time.perf_counter()
        tokens = []
        for token in llm.generate(prompt, top_k=1, top_p=1.0, temp=0.0, reset=True):
            if token == llm.token_eos() or len(tokens) == new_tokens:
                break
            tokens.append(token)
        seconds += time.perf_counter() - started
        produced += len(tokens)
        texts.append(tokens)
    return produced / seconds, texts


def time_transformers(target, prompts: list[list[int]], new_tokens: int) -> tuple[float, list]:
    import torch

    texts, seconds, produced = [], 0.0, 0
    for prompt in prompts:
        ids = torch.tensor([prompt])
        started = time.perf_counter()
        out = target.generate(ids, max_new_tokens=new_tokens, do_sample=False)
        seconds += time.perf_counter() - started
        produced += out.shape[1] - ids.shape[1]
        texts.append(out[0, ids.shape[1] :].tolist())
    return produced / seconds, texts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("runs/llamacpp"))
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "2")))
    args = parser.parse_args(argv)
    import torch

    from adaflash_hf import prepare_target
    from adaflash_hf.assets import load_target
    from adaflash_hf.bench.serve import heldout_prompts

    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    gguf = gguf_of(args.out)
    target, tokenizer = load_target()
    prompts = [p.tolist() for p in heldout_prompts(tokenizer, args.prompts, 256)]
    rows = {}
    rows["llama.cpp bf16 GGUF"], _ = time_llamacpp(gguf, prompts, args.max_new_tokens, args.threads)
    rows["transformers eager fp32"], _ = time_transformers(target, prompts, args.max_new_tokens)
    rows["transformers eager bf16"], _ = time_transformers(load_target(dtype=torch.bfloat16)[0], prompts,
                                                           args.max_new_tokens)  # fmt: skip
    rows["prepared target (auto)"], _ = time_transformers(
        prepare_target(target), prompts, args.max_new_tokens
    )
    base = rows["llama.cpp bf16 GGUF"]
    results = {
        "host": host(),
        "threads": args.threads,
        "prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "tokens_per_s": rows,
        "ratio_to_llamacpp": {name: value / base for name, value in rows.items()},
    }
    (args.out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
