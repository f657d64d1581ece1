"""Load an ``adaflash export --format dflash`` folder in vLLM's CPU build and record, on the offline SmolLM2 target,
the tokens/s of vLLM's plain decoding, of stock fixed-length DFlash, and of the AdaFlash plugin (``adaflash_hf.vllm``)
with the adaptive rule and with goodput, beside how many greedy texts equal plain decoding's.

Not part of ``make test``. Two steps, two virtual environments (vLLM pins its own transformers):

    # 1. in the project's venv: the target in transformers format and the exported drafter
    .venv/bin/python experiments/vllm/check_vllm.py prepare --out runs/vllm_check

    # 2. in vLLM's environment with this package installed there (make vllm-env builds .venv-vllm)
    .venv-vllm/bin/python experiments/vllm/check_vllm.py run --out runs/vllm_check --concurrency 1 4 16 32

``prepare`` writes ``<out>/target`` (SmolLM2-135M-Instruct, fp32, from the offline GGUF), ``<out>/drafter`` (the
export of ``--drafter``, default the shipped one) and ``<out>/prompts.json`` (chat-templated held-out prompts).
``run`` loads the target alone (``vllm_plain``), with ``speculative_config={"method": "dflash", "model":
<out>/drafter, "num_speculative_tokens": 15}`` and the plugin off (``vllm_dflash``: 15 drafts every step), and with the
plugin (``adaflash_adaptive``, ``adaflash_goodput``, with the prefix-cache hits of plain decoding as ``adaflash serve
--engine vllm`` configures it: ``launch.speculative_config``), for each ``--dtype``; generates greedily every prompt in
waves of each ``--concurrency`` (64 tokens each by default); and writes ``<out>/vllm.json``: per engine, dtype and
concurrency the tokens/s, the share of texts equal to plain's, and for the plugin the mean draft length, τ and the
steps the drafter sat out. ``--paired N`` starts the engines of a dtype side by side in one process instead and
runs every level as N waves, each wave by every engine in turn: the ratio to plain is taken per wave, seconds apart
(on a shared host whose speed drifts, engines run minutes apart compare the hour as much as the engine);
``--continuous R`` makes each wave R x c prompts served with c in flight, a finished request replaced at once (as c
clients of a server replace theirs), where a wave of ``llm.generate`` ends on its slowest request; such a wave also
records its tokens/s while c requests were in flight (``in_flight_*``: up to the first request that finished with no
prompt left to replace it), apart from the drain after it, whose length depends on how far apart the last requests
finish. An engine vLLM cannot start is recorded with its error; when none starts, ``run`` says so
and exits with status 1. ``--gpu-memory-utilization`` is passed to vLLM (on a GPU build that finds less free memory
than its default 0.9 asks for, e.g. a 24 GB card). The same prompts and levels in ``adaflash bench serve
--concurrency 1 4 16 --requests-per-level 16 --max-new-tokens 64`` (its held-out prompts are these) give ours beside
them.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SHIPPED = REPO / "examples" / "drafters" / "smollm2-135m-adaflash"
METHODS = ("vllm_plain", "vllm_dflash", "adaflash_adaptive", "adaflash_goodput")


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


def _host() -> dict:
    """The CPU model, its bf16 units and the threads: figures from one CPU kind never stand for another."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    model = next(
        (line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), ""
    )
    flags = set(info.split())
    units = [f if f in flags else f"no {f}" for f in ("amx_bf16", "avx512_bf16")]
    return {
        "cpu": model,
        "bf16_units": ", ".join(units),
        "cores": os.cpu_count(),
        "date": time.strftime("%Y-%m-%d"),
    }


def _plugin_stats(llm, name: str) -> dict | None:
    return llm.collective_rpc("adaflash_stats")[0] if name.startswith("adaflash") else None


def _plugin_delta(before: dict | None, after: dict | None) -> dict:
    """Mean k̂ (over requests of drafting steps, 0 included), τ and the steps the drafter sat out, over one level;
    the drafter gate's measured step costs per batch-size class as they stand at its end."""
    if before is None or after is None:
        return {}

    def proposals(stats):
        return sum(stats["draft_length_histogram"].values()), sum(
            int(k) * n for k, n in stats["draft_length_histogram"].items()
        )

    (n0, s0), (n1, s1) = proposals(before), proposals(after)
    rounds, accepted = after["rounds"] - before["rounds"], after["accepted"] - before["accepted"]
    return {
        "mean_draft_length": (s1 - s0) / max(1, n1 - n0),
        "tau": (accepted + rounds) / rounds if rounds else 0.0,
        "steps_without_drafter": after["steps_without_drafter"] - before["steps_without_drafter"],
        "gate": after.get("gate"),
    }


def _engines(out: Path, speculative_tokens: int) -> dict:
    """name -> (LLM options, the plugin's environment: vLLM's spawned workers read it)."""
    from adaflash_hf.vllm.launch import speculative_config

    dflash = {"method": "dflash", "model": str(out / "drafter"), "num_speculative_tokens": speculative_tokens}
    plugin = {  # as `adaflash serve --engine vllm` configures it
        "speculative_config": speculative_config(out / "drafter", speculative_tokens),
        "worker_extension_cls": "adaflash_hf.vllm.worker.AdaFlashWorkerExtension",
    }
    return {
        "vllm_plain": ({}, {"ADAFLASH_VLLM_DISABLE": "1"}),
        "vllm_dflash": ({"speculative_config": dflash}, {"ADAFLASH_VLLM_DISABLE": "1"}),
        "adaflash_adaptive": (plugin, {"ADAFLASH_VLLM_POLICY": "adaptive"}),
        "adaflash_goodput": (plugin, {"ADAFLASH_VLLM_POLICY": "goodput"}),
    }


def run_engine(out: Path, name: str, dtype: str, concurrency: list[int], max_tokens: int, speculative_tokens: int,
               extra: dict) -> list[dict]:  # fmt: skip
    """One engine at every level, in this process; its texts go to ``<out>/texts-<label>.json`` (plain's are what
    the others are compared with)."""
    from vllm import LLM

    prompts = json.loads((out / "prompts.json").read_text())
    options, env = _engines(out, speculative_tokens)[name]
    os.environ.update(env)
    # vLLM 0.32's compile cache, loaded for a second engine of the same target, can fail and recurse until the
    # worker dies: every engine compiles afresh
    os.environ.setdefault("VLLM_DISABLE_COMPILE_CACHE", "1")
    # a KV cache of its own size: by default vLLM's CPU build reserves 92% of memory and refuses to start when
    # anything else holds more than the rest
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    label = f"{name}_{dtype}"
    try:
        llm = LLM(model=str(out / "target"), dtype=dtype, max_model_len=2048, seed=0, **extra, **options)
    except Exception as error:  # noqa: BLE001 - a method this vLLM build lacks is a result to record
        print(f"{label}: {type(error).__name__}: {str(error)[:300]}")
        return [{"engine": label, "error": f"{type(error).__name__}: {error}"[:500]}]
    plain_path = out / f"texts-vllm_plain_{dtype}.json"
    plain = json.loads(plain_path.read_text()) if plain_path.is_file() and name != "vllm_plain" else {}
    _timed(llm, prompts[:1], 8, 1)  # warm-up
    rows, texts = [], {}
    for c in concurrency:
        before = _plugin_stats(llm, name)
        tokens_per_s, tokens = _timed(llm, prompts, max_tokens, c)
        texts[str(c)] = tokens
        row = {"engine": label, "concurrency": c, "tokens_per_s": tokens_per_s}
        if str(c) in plain:
            row["equal_to_plain"] = sum(a == b for a, b in zip(tokens, plain[str(c)])) / len(tokens)
        rows.append(row | _plugin_delta(before, _plugin_stats(llm, name)))
        print(json.dumps(rows[-1]), flush=True)
    (out / f"texts-{label}.json").write_text(json.dumps(texts))
    return rows


def _in_fresh_process(function: str, label: str, part: Path, **kwargs) -> list[dict]:
    """``function(**kwargs)`` of this script in a fresh Python process (``out`` passed as a path), its rows back
    through ``part``; a process that leaves no rows is recorded as an error of ``label``."""
    part.unlink(missing_ok=True)
    code = (
        "import json, sys; sys.path.insert(0, sys.argv[1]); import check_vllm; from pathlib import Path; "
        "a = json.loads(sys.argv[2]); a['kwargs']['out'] = Path(a['kwargs']['out']); "
        "rows = getattr(check_vllm, a['function'])(**a['kwargs']); Path(a['part']).write_text(json.dumps(rows))"
    )
    args = {"function": function, "part": str(part), "kwargs": kwargs | {"out": str(kwargs["out"])}}
    subprocess.run([sys.executable, "-c", code, str(Path(__file__).parent), json.dumps(args)])
    return json.loads(part.read_text()) if part.is_file() else [{"engine": label, "error": "no result"}]


def summarize(rows: list[dict]) -> list[dict]:
    """Per engine and concurrency: the median tokens/s over the repeats, each repeat's, and the ratio of the medians
    to vLLM plain decoding of the same dtype."""
    runs: dict[tuple[str, int], list[float]] = {}
    for row in rows:
        if "tokens_per_s" in row:
            runs.setdefault((row["engine"], row["concurrency"]), []).append(row["tokens_per_s"])
    medians = {key: statistics.median(values) for key, values in runs.items()}
    summary = []
    for (engine, c), values in runs.items():
        dtype = engine.rsplit("_", 1)[1]
        plain = medians.get((f"vllm_plain_{dtype}", c))
        entry = {
            "engine": engine,
            "concurrency": c,
            "median_tokens_per_s": medians[(engine, c)],
            "runs": values,
        }
        summary.append(entry | ({"vs_vllm_plain": medians[(engine, c)] / plain} if plain else {}))
    return summary


def run(
    out: Path,
    concurrency: list[int],
    max_tokens: int,
    speculative_tokens: int,
    dtypes: list[str],
    gpu_memory_utilization: float | None = None,
    methods: tuple[str, ...] = METHODS,
    eager: bool = False,
    repeats: int = 1,
    waves: int | None = None,
    prefix_caching: bool = True,
    continuous: int | None = None,
    spread: float = 0.0,
) -> int:
    """Every engine in a fresh process of its own (vLLM's CPU build does not always tear one down cleanly enough
    for the next), ``repeats`` times; or, with ``waves``, every engine of a dtype at once in one fresh process
    (``run_paired``). Exit status 0 when at least one engine ran, 1 when none did (each error is recorded)."""
    prompts = json.loads((out / "prompts.json").read_text())
    results: dict = {"max_tokens": max_tokens, "num_speculative_tokens": speculative_tokens, "rows": []}
    results |= {"prompts": len(prompts), "host": _host(), "enforce_eager": eager, "repeats": repeats}
    results |= {"prefix_caching": prefix_caching}
    extra = {} if gpu_memory_utilization is None else {"gpu_memory_utilization": gpu_memory_utilization}
    extra |= {"enforce_eager": True} if eager else {}
    extra |= {} if prefix_caching else {"enable_prefix_caching": False}
    common = {"out": out, "concurrency": concurrency, "max_tokens": max_tokens}
    common |= {"speculative_tokens": speculative_tokens, "extra": extra}
    if waves is not None:
        results |= {"paired": True, "waves": waves, "continuous": continuous, "max_tokens_spread": spread}
        for dtype in dtypes:
            results["rows"] += _in_fresh_process(
                "run_paired",
                f"paired_{dtype}",
                out / f"rows-paired_{dtype}.json",
                **common,
                dtype=dtype,
                methods=list(methods),
                waves=waves,
                continuous=continuous,
                spread=spread,
            )
    # every other repeat in the reverse order: drift of the host falls on both sides
    for repeat in range(repeats if waves is None else 0):
        for dtype in dtypes:
            for name in methods if repeat % 2 == 0 else methods[::-1]:
                results["rows"] += [
                    row | {"repeat": repeat}
                    for row in _in_fresh_process(
                        "run_engine",
                        f"{name}_{dtype}",
                        out / f"rows-{name}_{dtype}.json",
                        **common,
                        name=name,
                        dtype=dtype,
                    )
                ]
    results["summary"] = (summarize if waves is None else summarize_paired)(results["rows"])
    equal: dict[str, bool] = {}
    for row in results["rows"]:
        if "equal_to_plain" in row:
            key = f"{row['engine']}@{row['concurrency']}"
            equal[key] = equal.get(key, True) and row["equal_to_plain"] == 1.0
    results["equals_plain"] = equal
    (out / "vllm.json").write_text(json.dumps(results, indent=1) + "\n")
    if all("error" in row for row in results["rows"]):
        failed = "; ".join(f"{row['engine']}: {row['error']}" for row in results["rows"])
        print(
            f"check_vllm run: error: expected at least one vLLM engine to run, got none of {len(results['rows'])} "
            f"({failed}); {out / 'vllm.json'} records the errors",
            file=sys.stderr,
        )
        return 1
    print(json.dumps(results["equals_plain"]))
    return 0


def _wave(prompts: list[list[int]], concurrency: int, index: int) -> list[list[int]]:
    """Wave ``index`` of ``concurrency`` prompts, taken in turn from the list (it wraps around)."""
    return [prompts[(index * concurrency + j) % len(prompts)] for j in range(concurrency)]


def _lengths(count: int, max_tokens: int, spread: float, index: int) -> list[int]:
    """Per prompt of wave ``index``, its ``max_tokens``: ``max_tokens`` for all with no ``spread``, else drawn
    uniformly from ``max_tokens x [1 - spread, 1 + spread]``, the same for every engine (seeded by the wave)."""
    if not spread:
        return [max_tokens] * count
    draw = random.Random(f"wave-{index}")
    low, high = max(1, round(max_tokens * (1 - spread))), round(max_tokens * (1 + spread))
    return [draw.randint(low, high) for _ in range(count)]


def _continuous(
    llm, prompts: list[list[int]], params, concurrency: int, label: str, in_flight: dict | None = None
) -> list[list[int]]:
    """Every prompt through ``llm``'s engine with ``concurrency`` in flight: a finished request's place is taken by
    the next prompt at once, as by ``concurrency`` clients that each send their next request when the last one is
    answered. ``params`` is one ``SamplingParams`` for all or one per prompt. The texts, in the prompts' order.

    ``in_flight``, a dict, gets the ``seconds`` and ``tokens`` of the wave while ``concurrency`` requests were in
    flight: from the first request sent to the first one that finished with no prompt left to take its place (the
    tokens committed by then, running requests' included). What follows is the wave's drain, at fewer requests
    than the level names, and its length depends on how far apart the last requests finish: requests of one length
    that start together finish together in plain decoding, while any drafting step spreads them."""
    from vllm import TokensPrompt

    engine, done, sent, progress = llm.llm_engine, {}, 0, {}
    started = time.perf_counter()

    def send() -> None:
        nonlocal sent
        own = params[sent] if isinstance(params, list) else params
        engine.add_request(f"{label}-{sent}", TokensPrompt(prompt_token_ids=prompts[sent]), own)
        sent += 1

    while sent < min(concurrency, len(prompts)):
        send()
    while engine.has_unfinished_requests():
        draining = False
        for output in engine.step():
            progress[output.request_id] = len(output.outputs[0].token_ids)
            if output.finished:
                done[int(output.request_id.rsplit("-", 1)[1])] = list(output.outputs[0].token_ids)
                if sent < len(prompts):
                    send()
                else:
                    draining = True
        if draining and in_flight is not None and not in_flight:
            in_flight |= {"seconds": time.perf_counter() - started, "tokens": sum(progress.values())}
    return [done[i] for i in range(len(prompts))]


def _quartiles(values: list[float]) -> list[float]:
    if len(values) < 2:
        return [values[0], values[0]] if values else []
    q = statistics.quantiles(values, n=4, method="inclusive")
    return [q[0], q[2]]


def _rate(rows: list[dict]) -> float:
    return sum(r["tokens"] for r in rows) / sum(r["seconds"] for r in rows)


def summarize_paired(rows: list[dict]) -> list[dict]:
    """Per engine and concurrency: the median tokens/s over the waves and the median (and quartiles) of each wave's
    ratio to vLLM plain decoding of the same wave, same dtype; and the ratio of all waves together (every wave's
    tokens over every wave's seconds, as a server serving them one after another would see it: at one request a
    wave is one prompt, and the median of per-prompt ratios says how a typical prompt fares, not the traffic)."""
    groups: dict[tuple[str, int], list[dict]] = {}
    for row in rows:
        if "tokens_per_s" in row:
            groups.setdefault((row["engine"], row["concurrency"]), []).append(row)
    summary = []
    for (engine, c), group in groups.items():
        entry = {
            "engine": engine,
            "concurrency": c,
            "median_tokens_per_s": statistics.median(r["tokens_per_s"] for r in group),
            "waves": len(group),
        }
        for key in ("vs_vllm_plain", "in_flight_vs_vllm_plain"):  # the whole waves; while c were in flight
            ratios = [r[key] for r in group if key in r]
            if ratios:
                entry |= {key: statistics.median(ratios), f"{key}_quartiles": _quartiles(ratios)}
        plain = groups.get((f"vllm_plain_{engine.rsplit('_', 1)[1]}", c), [])
        if (
            "vs_vllm_plain" in entry
            and len(plain) == len(group)
            and all("seconds" in r for r in group + plain)
        ):
            entry["vs_vllm_plain_all_waves"] = _rate(group) / _rate(plain)
        summary.append(entry)
    return summary


def run_paired(
    out: Path,
    concurrency: list[int],
    max_tokens: int,
    speculative_tokens: int,
    dtype: str,
    methods: tuple[str, ...],
    waves: int,
    extra: dict,
    continuous: int | None = None,
    spread: float = 0.0,
) -> list[dict]:
    """Every engine of ``methods`` started at once in this process, then at each
    level ``waves`` waves of ``concurrency`` prompts, every wave run by each engine in turn, the order reversed
    every other wave. A wave's tokens/s is divided by vLLM plain's on the same wave, run seconds apart: on a shared
    host whose speed drifts by 10-25% within an hour, engines run one after another minutes apart compare the hour,
    not the engine. With ``continuous`` a wave is instead ``continuous x concurrency`` prompts served with
    ``concurrency`` in flight (``_continuous``): requests that finish apart are replaced as a server's clients
    replace them, where a wave of ``llm.generate`` waits for its slowest request. With ``spread`` each prompt of a
    continuous wave asks its own ``max_tokens`` (``_lengths``): requests of one length that start together also
    finish together, and plain decoding then admits the next ones in one step, which traffic of mixed lengths and
    arrivals does not give it."""
    from vllm import LLM, SamplingParams, TokensPrompt

    prompts = json.loads((out / "prompts.json").read_text())
    os.environ.setdefault("VLLM_DISABLE_COMPILE_CACHE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # per engine: all of them run side by side
    # every engine in this process (vLLM's engine core and worker included): an idle engine's processes would
    # otherwise sit on the cores the running one was bound to (vllm_plain ran at 0.55x its own speed that way)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    extra = {**extra, "distributed_executor_backend": "uni"}
    engines, rows = {}, []
    for name in methods:
        options, env = _engines(out, speculative_tokens)[name]
        # the plugin is registered once a process: by the first engine with a drafter
        if name != "vllm_plain":
            os.environ.update(env)
        label = f"{name}_{dtype}"
        try:
            engines[name] = LLM(
                model=str(out / "target"), dtype=dtype, max_model_len=2048, seed=0, **extra, **options
            )
        except Exception as error:  # noqa: BLE001 - a method this vLLM build lacks is a result to record
            print(f"{label}: {type(error).__name__}: {str(error)[:300]}")
            rows.append({"engine": label, "error": f"{type(error).__name__}: {error}"[:500]})
    if "vllm_plain" not in engines:
        return rows
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    warm = SamplingParams(temperature=0.0, max_tokens=8)
    for llm in engines.values():
        llm.generate([TokensPrompt(prompt_token_ids=prompts[0])], warm, use_tqdm=False)
    order = list(engines)
    for c in concurrency:
        before = {name: _plugin_stats(llm, name) for name, llm in engines.items()}
        for index in range(waves):
            wave = _wave(prompts, c * (continuous or 1), index)
            batch = [TokensPrompt(prompt_token_ids=p) for p in wave]
            own = None  # with continuous: one SamplingParams per prompt, each its own length
            if continuous:
                own = [
                    SamplingParams(temperature=0.0, max_tokens=n)
                    for n in _lengths(len(wave), max_tokens, spread, index)
                ]
            measured = {}
            for name in order if index % 2 == 0 else order[::-1]:
                started, window = time.perf_counter(), {}
                if continuous:
                    tokens = _continuous(engines[name], wave, own, c, f"c{c}w{index}", window)
                else:
                    outputs = engines[name].generate(batch, params, use_tqdm=False)
                    tokens = [list(o.outputs[0].token_ids) for o in outputs]
                seconds = time.perf_counter() - started
                if window:
                    window["tokens_per_s"] = window["tokens"] / window["seconds"]
                measured[name] = (sum(map(len, tokens)) / seconds, tokens, seconds, window)
            plain_rate, plain_tokens, _, plain_window = measured["vllm_plain"]
            for name in order:
                rate, tokens, seconds, window = measured[name]
                row = {"engine": f"{name}_{dtype}", "concurrency": c, "wave": index, "tokens_per_s": rate}
                row |= {"tokens": sum(map(len, tokens)), "seconds": seconds}
                row |= {f"in_flight_{key}": value for key, value in window.items()}
                if name != "vllm_plain":
                    row["vs_vllm_plain"] = rate / plain_rate
                    row["equal_to_plain"] = sum(a == b for a, b in zip(tokens, plain_tokens)) / len(tokens)
                    if window and plain_window:
                        row["in_flight_vs_vllm_plain"] = window["tokens_per_s"] / plain_window["tokens_per_s"]
                rows.append(row)
            in_flight = ""
            if all(measured[name][3] for name in order):
                rates = ", ".join(f"{measured[n][3]['tokens_per_s']:.1f}" for n in order)
                in_flight = f" (while c in flight: {rates})"
            print(
                f"c={c} wave {index}: "
                + ", ".join(f"{name} {measured[name][0]:.1f}" for name in order)
                + " tok/s"
                + in_flight,
                flush=True,
            )
        for name, llm in engines.items():
            delta = _plugin_delta(before[name], _plugin_stats(llm, name))
            if delta:
                rows.append({"engine": f"{name}_{dtype}", "concurrency": c, "level": True} | delta)
    return rows


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
    second.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    second.add_argument(
        "--eager", action="store_true", help="enforce_eager (no torch.compile: starts sooner)"
    )
    second.add_argument(
        "--no-prefix-caching",
        action="store_true",
        help="vLLM's prefix cache off for every engine (waves of the same prompts would otherwise prefill from it)",
    )
    second.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="run every engine this many times, the order reversed every other time; the summary has the medians",
    )
    second.add_argument(
        "--continuous",
        type=int,
        metavar="ROUNDS",
        help="with --paired: each wave serves ROUNDS x c prompts keeping c in flight (a finished request replaced at "
        "once, as by c clients), instead of c prompts in one llm.generate that waits for the slowest",
    )
    second.add_argument(
        "--max-tokens-spread",
        type=float,
        default=0.0,
        metavar="F",
        help="with --continuous: each prompt's max tokens drawn from --max-tokens x [1 - F, 1 + F] (the same for every "
        "engine), so that requests finish apart in plain decoding too",
    )
    second.add_argument(
        "--paired",
        type=int,
        metavar="WAVES",
        help="start every engine of a dtype at once and run each level as WAVES waves, every wave by each engine "
        "in turn; ratios are per wave against vLLM plain (which it then needs among --methods)",
    )
    args = parser.parse_args(argv)
    if args.command == "run" and args.repeats < 1:
        parser.error(f"--repeats: expected an int >= 1, got {args.repeats}")
    if args.command == "run" and args.paired is not None:
        if args.paired < 1:
            parser.error(f"--paired: expected an int >= 1, got {args.paired}")
        if "vllm_plain" not in args.methods:
            parser.error(f"--paired: expected vllm_plain among --methods, got {' '.join(args.methods)}")
        if "vllm_dflash" in args.methods and any(m.startswith("adaflash") for m in args.methods):
            parser.error(
                "--paired: expected vllm_dflash or the plugin's methods, got both (the engines share one process, "
                "where the plugin is on or off for all); run them in two --paired runs"
            )
        if args.repeats != 1:
            parser.error(
                f"--paired: expected no --repeats (each wave is a repeat), got --repeats {args.repeats}"
            )
    if args.command == "run" and args.continuous is not None:
        if args.paired is None:
            parser.error("--continuous: expected --paired WAVES beside it, got none")
        if args.continuous < 1:
            parser.error(f"--continuous: expected an int >= 1, got {args.continuous}")
    if args.command == "run" and args.max_tokens_spread:
        if args.continuous is None:
            parser.error("--max-tokens-spread: expected --continuous ROUNDS beside it, got none")
        if not 0 <= args.max_tokens_spread < 1:
            parser.error(f"--max-tokens-spread: expected a fraction in [0, 1), got {args.max_tokens_spread}")
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
        tuple(args.methods),
        args.eager,
        args.repeats,
        args.paired,
        not args.no_prefix_caching,
        args.continuous,
        args.max_tokens_spread,
    )


if __name__ == "__main__":
    sys.exit(main())
