"""llama.cpp's plain decoding beside ours on the same prompts and the same weights: a figure, not a test.

Not part of ``make test``. Its own install lines (llama-cpp-python builds llama.cpp from source, about 7 minutes on 2
cores; the GGUF converter is in its source archive, not in the installed package):

    .venv/bin/pip install llama-cpp-python==0.3.36 --no-binary llama-cpp-python sentencepiece
    .venv/bin/pip download llama-cpp-python==0.3.36 --no-binary :all: --no-deps -d runs/llamacpp
    tar xzf runs/llamacpp/llama_cpp_python-0.3.36.tar.gz -C runs/llamacpp
    .venv/bin/python experiments/llamacpp/compare.py --out runs/llamacpp --prompts 12 --max-new-tokens 96 \
        --llama-cpp-dir runs/llamacpp/llama_cpp_python-0.3.36/vendor/llama.cpp

The target is the offline SmolLM2-135M-Instruct, saved in transformers format and converted to a bf16 GGUF with
llama.cpp's own ``convert_hf_to_gguf.py`` (the shipped Q4_1 file is a different quantisation, and some llama.cpp
builds crash on it, so each llama.cpp run is a child process and a crash is recorded, not fatal). On held-out prompts
(chat-templated token ids, the same for every engine), greedy, one request at a time, ``--threads`` threads, it
times (each transformers engine after one untimed generate of 8 tokens): llama.cpp on the bf16 GGUF and on the
shipped Q4_1 one; transformers eager fp32 and bf16; the target as ``prepare_target`` prepares it for bf16, for
``int4`` (its own 4-bit codes) and for ``auto``; and AdaFlash's default (``generate`` with the shipped drafter on the
auto-prepared target, every output checked equal to that target's plain greedy output). Tokens/s per engine (new
tokens over wall seconds, prompt included) and each one's ratio to llama.cpp's bf16 plain decoding. Writes
``<out>/results.json`` with the host (CPU model and bf16 units).
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


def converter(llama_cpp_dir: Path) -> Path:
    """llama.cpp's ``convert_hf_to_gguf.py`` in a llama.cpp source tree (its ``gguf-py`` beside it)."""
    script = llama_cpp_dir / "convert_hf_to_gguf.py"
    if not script.is_file():
        raise FileNotFoundError(
            f"--llama-cpp-dir: expected a llama.cpp source tree with convert_hf_to_gguf.py (see this script's "
            f"docstring), got {llama_cpp_dir}"
        )
    return script


def gguf_of(out: Path, llama_cpp_dir: Path) -> Path:
    """The target as transformers weights and as a bf16 GGUF (written once)."""
    from adaflash_hf.assets import load_target

    folder, gguf = out / "target", out / "target-bf16.gguf"
    if not gguf.is_file():
        target, tokenizer = load_target()
        target.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        command = [sys.executable, str(converter(llama_cpp_dir)), str(folder), "--outtype", "bf16", "--outfile",
                   str(gguf)]  # fmt: skip
        paths = [str(llama_cpp_dir / "gguf-py"), str(llama_cpp_dir), os.environ.get("PYTHONPATH", "")]
        subprocess.run(command, check=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(paths)})
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


def llamacpp_in_child(gguf: Path, prompts_file: Path, args) -> float | str:
    """``time_llamacpp`` in a child process (a llama.cpp build may crash on a quantisation): tokens/s, or why not."""
    command = [sys.executable, __file__, "--child", str(gguf), str(prompts_file), str(args.max_new_tokens),
               str(args.threads)]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        return f"failed (exit {result.returncode}): {result.stderr.strip()[-300:]}"
    return float(result.stdout.strip().splitlines()[-1])


WARMUP_TOKENS = 8


def time_transformers(target, prompts: list[list[int]], new_tokens: int, **generate) -> tuple[float, list]:
    import torch

    # untimed first: a process's first generate with an engine builds its kernels and calibrates (llama.cpp's model
    # is loaded before its clock starts, too)
    target.generate(torch.tensor([prompts[0]]), max_new_tokens=WARMUP_TOKENS, do_sample=False, **generate)
    texts, seconds, produced = [], 0.0, 0
    for prompt in prompts:
        ids = torch.tensor([prompt])
        started = time.perf_counter()
        out = target.generate(ids, max_new_tokens=new_tokens, do_sample=False, **generate)
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
    parser.add_argument(
        "--llama-cpp-dir", type=Path, required=True, help="llama.cpp's source tree (docstring)"
    )
    args = parser.parse_args(argv)
    import copy

    import torch

    from adaflash_hf import AdaFlashDrafter, prepare_target
    from adaflash_hf.assets import load_target, smollm2_gguf_path
    from adaflash_hf.data import heldout_prompt_ids
    from adaflash_hf.prepared.prepare import is_prepared
    from adaflash_hf.serving.server import DEFAULT_DRAFTER

    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    gguf = gguf_of(args.out, args.llama_cpp_dir)
    target, tokenizer = load_target()
    prompts = [p.tolist() for p in heldout_prompt_ids(tokenizer, ("chat", "code", "math"), args.prompts, 256)]
    prompts_file = args.out / "prompts.json"
    prompts_file.write_text(json.dumps(prompts))
    rows = {
        "llama.cpp bf16 GGUF": llamacpp_in_child(gguf, prompts_file, args),
        "llama.cpp Q4_1 GGUF (shipped)": llamacpp_in_child(smollm2_gguf_path(), prompts_file, args),
    }
    rows["transformers eager fp32"], _ = time_transformers(target, prompts, args.max_new_tokens)
    rows["transformers eager bf16"], _ = time_transformers(
        copy.deepcopy(target).to(torch.bfloat16), prompts, args.max_new_tokens
    )
    for dtype in ("bf16", "int4"):
        prepared = prepare_target(copy.deepcopy(target), dtype=dtype)
        rows[f"prepared {dtype}"], _ = time_transformers(prepared, prompts, args.max_new_tokens)
        del prepared
    auto = prepare_target(target)
    chosen = is_prepared(auto)
    rows["prepared auto"], plain = time_transformers(auto, prompts, args.max_new_tokens)
    drafter = AdaFlashDrafter.from_pretrained(str(DEFAULT_DRAFTER)).to(chosen.dtype).eval()
    rows["AdaFlash default (auto target)"], drafted = time_transformers(
        auto, prompts, args.max_new_tokens, assistant_model=drafter
    )
    base = rows["llama.cpp bf16 GGUF"]
    results = {
        "host": host(),
        "threads": args.threads,
        "torch": torch.__version__,
        "prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "auto_chose": {"dtype": str(chosen.dtype), "weights": chosen.weights, "reason": chosen.reason},
        "adaflash_equal_to_plain": sum(a == b for a, b in zip(drafted, plain)),
        "tokens_per_s": rows,
        "ratio_to_llamacpp_bf16": {
            name: value / base
            for name, value in rows.items()
            if isinstance(value, float) and isinstance(base, float)
        },
    }
    (args.out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    print(json.dumps(results, indent=1))
    return 0 if results["adaflash_equal_to_plain"] == len(prompts) else 1


def child(argv: list[str]) -> int:
    gguf, prompts_file, new_tokens, threads = argv
    prompts = json.loads(Path(prompts_file).read_text())
    print(time_llamacpp(Path(gguf), prompts, int(new_tokens), int(threads))[0])
    return 0


if __name__ == "__main__":
    raise SystemExit(child(sys.argv[2:]) if sys.argv[1:2] == ["--child"] else main())
