"""Load generator for ``adaflash serve`` (or any OpenAI-compatible server on this machine): N concurrent streaming
chat clients, closed loop, through the official ``openai`` client.

    adaflash serve --drafter none --port 8001 &   adaflash serve --port 8002 &   adaflash serve --draft-source hybrid --port 8003 &
    adaflash bench http --server plain=http://127.0.0.1:8001/v1 --server adaflash=http://127.0.0.1:8002/v1 \\
        --server hybrid=http://127.0.0.1:8003/v1 --concurrency 1 4 16 --requests 32 --max-tokens 128
    adaflash bench http --server learn=http://127.0.0.1:8000/v1 --domains translate --concurrency 4 \\
        --requests 1000 --learning-curve                      # a shifted workload against `adaflash serve --learn`
    adaflash bench http --concurrency 16 --duration-s 120 --requests 100000 --disconnect-prob 0.3   # a soak

Per server and concurrency level, ``--requests`` requests (held-out prompts of ``--domains`` in turn, each a user
turn) are kept ``c`` at a time in flight until they are done or ``--duration-s`` has passed. Every server runs each
level in turn before the next level, so they share the machine's state. Reported per (server, level): generated
tokens/s (completion tokens over the level's wall time), time to first token and inter-token latency (the gap
between two streamed chunks, what a client sees) p50/p99, τ from the responses' ``adaflash`` statistics (servers
that do not send them show none), 429s, other errors, the drafter weights version and the server's resident memory
(``/metrics``) before and after. With ``--disconnect-prob p`` a client drops its stream after a random number of
chunks with probability p (the server must abort it and go on). ``--learning-curve`` plots τ per request against
requests served for the first server, with a 95% bootstrap interval per window of ``--window`` requests.

``--in-process LABEL=DRAFTER`` adds an engine built in this process the way ``adaflash serve`` builds it with default
flags and ``--drafter DRAFTER`` (``default``: the shipped drafter; ``none``: plain decoding; or a folder), driven
with the same prompts, levels and closed loop through the server's engine thread but no HTTP: its rows beside a
server's show what serving over HTTP costs.

Only loopback servers are driven (127.0.0.0/8, ::1, localhost). Outputs in ``--output-dir``: ``results.json``,
``table.md``, ``tokens_per_s.png`` and, with ``--learning-curve``, ``tau_vs_requests.png``.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import ipaddress
import json
import random
import re
import statistics
import time
import urllib.parse
import urllib.request
from collections import deque
from pathlib import Path

from transformers.utils import logging

from adaflash_hf.bench import report
from adaflash_hf.bench.report import line_plot, table
from adaflash_hf.launch import CONFIG_HELP, int_at_least, number_in, parse_args_with_config
from adaflash_hf.stats import tau_of

logger = logging.get_logger(__name__)

DEFAULT_SERVER = "adaflash=http://127.0.0.1:8000/v1"


def check_loopback(url: str) -> str:
    """``url`` when its host is this machine's loopback; the load generator drives nothing else."""
    host = urllib.parse.urlparse(url).hostname or ""
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise ValueError(f"--server: expected a loopback URL (127.0.0.1, ::1 or localhost), got {url!r}")
    return url.rstrip("/")


def parse_labelled(values: list[str], option: str, what: str, check=str) -> dict[str, str]:
    """``option``'s ``LABEL=VALUE`` entries (``what`` names the value) as label -> ``check(VALUE)``, each label new."""
    entries = {}
    for value in values:
        label, sep, entry = value.partition("=")
        if not sep or not label or not entry or label in entries:
            raise ValueError(f"{option}: expected a new LABEL={what}, got {value!r}")
        entries[label] = check(entry)
    return entries


def load_prompts(domains: list[str], split: str, count: int, seed: int, max_chars: int) -> list[str]:
    """``count`` prompt texts of ``domains`` in turn (each domain's rows shuffled with ``seed``, cycled if short)."""
    from adaflash_hf.data import in_turn, load_domain

    shuffled = {d: load_domain(d, split, n=len(load_domain(d, split)), seed=seed) for d in domains}
    texts = {d: [row["prompt"][-max_chars:] for row in rows] for d, rows in shuffled.items()}
    return in_turn(texts, count, cycle=True)


def scrape(url: str) -> dict[str, float]:
    """The server's ``/metrics`` as name -> value ({} for a server without it)."""
    try:
        text = urllib.request.urlopen(url.removesuffix("/v1") + "/metrics", timeout=10).read().decode()
    except OSError:
        return {}
    return {name: float(value) for name, value in re.findall(r"^([^#\s]\S*) (\S+)$", text, re.M)}


# ------------------------------------------------------------------------------------------------------- clients
async def one_request(client, model: str, prompt: str, max_tokens: int, drop_after: int | None) -> dict:
    """One streamed chat request; ``drop_after`` chunks (None: never) before the client hangs up."""
    import openai

    record = {"status": "ok", "chunk_times": [], "tokens": 0, "finish_reason": None, "adaflash": None}
    started = time.perf_counter()
    try:
        stream = await client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": prompt}],
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                record["chunk_times"].append(time.perf_counter() - started)
            if chunk.choices and chunk.choices[0].finish_reason:
                record["finish_reason"] = chunk.choices[0].finish_reason
                record["adaflash"] = (chunk.model_extra or {}).get("adaflash")
            if chunk.usage is not None:
                record["tokens"] = chunk.usage.completion_tokens
            if drop_after is not None and len(record["chunk_times"]) >= drop_after:
                await stream.close()
                record["status"] = "dropped"
                break
    except openai.RateLimitError:
        record["status"] = "429"
    except openai.OpenAIError as error:
        record["status"], record["error"] = "error", repr(error)[:200]
    record["seconds"] = time.perf_counter() - started
    return record


async def closed_loop(
    prompts: list[str], concurrency: int, duration_s: float, send
) -> tuple[list[dict], float]:
    """Every prompt through ``send(prompt)`` (a coroutine giving its record), ``concurrency`` in flight (a client sends
    its next prompt when its last one is done), until all are done or ``duration_s`` has passed; the records in prompt
    order, each with its ``index``, and the wall seconds."""
    queue = deque(enumerate(prompts))
    records: list[dict] = []
    started = time.perf_counter()

    async def client():
        while queue and time.perf_counter() - started < duration_s:
            index, prompt = queue.popleft()
            records.append(await send(prompt) | {"index": index})

    await asyncio.gather(*(client() for _ in range(concurrency)))
    return sorted(records, key=lambda r: r["index"]), time.perf_counter() - started


async def run_level(
    url: str,
    model: str,
    prompts: list[str],
    concurrency: int,
    max_tokens: int,
    duration_s: float,
    disconnect_prob: float = 0.0,
    seed: int = 0,
) -> tuple[list[dict], float]:
    """``closed_loop`` of streamed chat requests to the server at ``url``."""
    import openai

    rng = random.Random(seed)
    client = openai.AsyncOpenAI(base_url=url, api_key="none", max_retries=0, timeout=600)

    def send(prompt: str):
        drop = rng.randint(1, max(1, max_tokens // 2)) if rng.random() < disconnect_prob else None
        return one_request(client, model, prompt, max_tokens, drop)

    try:
        return await closed_loop(prompts, concurrency, duration_s, send)
    finally:
        await client.close()


def build_in_process(drafter: str):
    """An engine and tokenizer as ``adaflash serve --drafter DRAFTER`` builds them with its other flags' defaults."""
    from adaflash_hf.assets import DEFAULT_TARGET
    from adaflash_hf.serving.server import served_engine
    from adaflash_hf.serving.worker import in_own_thread

    # as the server builds it: on a thread that ends, so that the engine's thread has the only OpenMP team
    engine, _, tokenizer = in_own_thread(
        served_engine, DEFAULT_TARGET, None if drafter == "default" else drafter
    )
    return engine, tokenizer


def run_in_process(
    engine, tokenizer, prompts: list[str], concurrency: int, max_tokens: int, duration_s: float, **_
) -> tuple[list[dict], float]:
    """``run_level`` without HTTP: the same chat prompts, greedy, through the server's engine thread
    (``EngineWorker``) over ``engine`` in this process; a record's chunk times are its text events."""
    from adaflash_hf.serving.requests import SamplingParams
    from adaflash_hf.serving.worker import EngineWorker

    params = SamplingParams(max_new_tokens=max_tokens, temperature=0.0)

    async def send(worker: EngineWorker, prompt: str) -> dict:
        encoded = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True, return_dict=True
        )
        record = {"status": "ok", "chunk_times": [], "tokens": 0, "finish_reason": None, "adaflash": None}
        begun = time.perf_counter()
        handle = worker.submit(list(encoded["input_ids"]), params)
        while (event := await handle.queue.get()).kind not in ("finished", "failed"):
            if event.kind == "text":
                record["chunk_times"].append(time.perf_counter() - begun)
        if event.kind == "failed":
            record["status"], record["error"] = "error", repr(event.error)[:200]
        else:
            counts = {key: event.extra[key] for key in ("verify_rounds", "accepted_drafts")}
            record |= {
                "tokens": event.completion_tokens,
                "finish_reason": event.finish_reason,
                "adaflash": counts,
            }
        return record | {"seconds": time.perf_counter() - begun}

    async def level() -> tuple[list[dict], float]:
        worker = EngineWorker(engine, tokenizer, capacity=concurrency)
        worker.start()
        try:
            return await closed_loop(prompts, concurrency, duration_s, functools.partial(send, worker))
        finally:
            await asyncio.to_thread(worker.shutdown, 0.0)

    return asyncio.run(level())


def _quantile(values: list[float], q: float) -> float | None:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else None


def request_tau(record: dict) -> float | None:
    stats = record.get("adaflash") or {}
    rounds = stats.get("verify_rounds")
    return tau_of(stats["accepted_drafts"] + rounds, rounds) if rounds else None


def summarise(
    label: str, concurrency: int, records: list[dict], seconds: float, before: dict, after: dict
) -> dict:
    done = [r for r in records if r["status"] == "ok"]
    ttft = [r["chunk_times"][0] for r in done if r["chunk_times"]]
    itl = [b - a for r in done for a, b in zip(r["chunk_times"], r["chunk_times"][1:])]
    rounds = sum((r["adaflash"] or {}).get("verify_rounds", 0) for r in done)
    accepted = sum((r["adaflash"] or {}).get("accepted_drafts", 0) for r in done)
    memory = "process_resident_memory_bytes"
    return {
        "server": label,
        "concurrency": concurrency,
        "requests": len(records),
        "completed": len(done),
        "dropped": sum(r["status"] == "dropped" for r in records),
        "rejected_429": sum(r["status"] == "429" for r in records),
        "errors": sum(r["status"] == "error" for r in records),
        "seconds": seconds,
        "tokens_per_s": sum(r["tokens"] for r in done) / seconds if seconds > 0 else 0.0,
        "ttft_p50": _quantile(ttft, 0.5),
        "ttft_p99": _quantile(ttft, 0.99),
        "itl_p50": _quantile(itl, 0.5),
        "itl_p99": _quantile(itl, 0.99),
        "tau": tau_of(accepted + rounds, rounds) if rounds else None,
        "drafter_version": [m.get("adaflash_drafter_weights_version") for m in (before, after)],
        "memory_mb": [m / 2**20 if m is not None else None for m in (before.get(memory), after.get(memory))],
    }


def run_benchmark(
    servers: dict[str, str],
    model: str | None,
    prompts: list[str],
    concurrency: list[int],
    engines: dict | None = None,
    **level,
) -> dict:
    """Every server at every level (servers interleaved per level), then every in-process ``engines`` entry (label ->
    (engine, tokenizer)) at that level; ``level``: ``run_level``'s keyword settings."""
    summary, records = [], {}
    for c in concurrency:
        for label, target in [*servers.items(), *(engines or {}).items()]:
            if isinstance(target, str):
                name = model or _served_model(target)
                before = scrape(target)
                level_records, seconds = asyncio.run(run_level(target, name, prompts, c, **level))
                after = scrape(target)
            else:
                before = after = {}
                level_records, seconds = run_in_process(*target, prompts, c, **level)
            summary.append(summarise(label, c, level_records, seconds, before, after))
            records[f"{label}@{c}"] = level_records
            row = summary[-1]
            row["unsent"] = len(prompts) - len(level_records)
            if row["unsent"]:
                logger.warning(
                    f"{label} c={c}: {row['unsent']} of {len(prompts)} requests not sent: the level's cap, "
                    f"--duration-s {level.get('duration_s')}, was reached after {seconds:.0f} s"
                )
            logger.info(
                f"{label} c={c}: {row['tokens_per_s']:.1f} tok/s, {row['completed']} done, {row['errors']} errors"
            )
    return {"summary": summary, "records": records}


def _served_model(url: str) -> str:
    with urllib.request.urlopen(url + "/models", timeout=10) as response:
        return json.loads(response.read())["data"][0]["id"]


# ------------------------------------------------------------------------------------------------------- reports
def _ms(value) -> str:
    return "n/a" if value is None else f"{1000 * value:.0f}"


# The table's columns: header -> the cell of a summary row.
COLUMNS = {
    "server": lambda r: r["server"],
    "concurrency": lambda r: r["concurrency"],
    "tokens/s": lambda r: f"{r['tokens_per_s']:.1f}",
    "TTFT p50 / p99 (ms)": lambda r: f"{_ms(r['ttft_p50'])} / {_ms(r['ttft_p99'])}",
    "ITL p50 / p99 (ms)": lambda r: f"{_ms(r['itl_p50'])} / {_ms(r['itl_p99'])}",
    "τ": lambda r: "n/a" if r["tau"] is None else f"{r['tau']:.2f}",
    "done": lambda r: (
        f"{r['completed']} ({r['unsent']} unsent: --duration-s)" if r.get("unsent") else r["completed"]
    ),
    "429": lambda r: r["rejected_429"],
    "errors": lambda r: r["errors"],
    "memory MB": lambda r: " → ".join("n/a" if m is None else f"{m:.0f}" for m in r["memory_mb"]),
}


def markdown_table(results: dict) -> str:
    rows = [[cell(r) for cell in COLUMNS.values()] for r in results["summary"]]
    return table(list(COLUMNS), rows, "l" + "r" * 8 + "l")


def learning_curve(records: list[dict], window: int, seed: int = 0) -> list[dict]:
    """τ per window of ``window`` completed requests (in order served): the mean and a 95% bootstrap interval."""
    taus = [t for t in map(request_tau, records) if t is not None]
    rng = random.Random(seed)
    rows = []
    for start in range(0, len(taus) - window + 1, window):
        chunk = taus[start : start + window]
        means = sorted(statistics.fmean(rng.choices(chunk, k=len(chunk))) for _ in range(1000))
        rows.append(
            {"requests": start + window, "tau": statistics.fmean(chunk), "low": means[25], "high": means[974]}
        )
    return rows


def write_outputs(results: dict, output_dir: Path, window: int | None) -> None:
    servers = dict.fromkeys(r["server"] for r in results["summary"])
    rows = {label: [r for r in results["summary"] if r["server"] == label] for label in servers}
    lines = {
        label: ([r["concurrency"] for r in rs], [r["tokens_per_s"] for r in rs]) for label, rs in rows.items()
    }
    xlabel, ylabel = "concurrent streaming clients", "generated tokens/s over HTTP"
    figures = {"tokens_per_s.png": lambda path: line_plot(path, lines, xlabel, ylabel, log2_x=True)}
    if window:
        first = next(iter(results["records"]))
        curve = results["learning_curve"] = learning_curve(results["records"][first], window)
        x = [r["requests"] for r in curve]
        label = f"{first}: mean τ per window"
        figures["tau_vs_requests.png"] = lambda path: line_plot(
            path,
            {label: (x, [r["tau"] for r in curve])},
            "requests served",
            "τ (committed tokens per verify round)",
            bands={label: ([r["low"] for r in curve], [r["high"] for r in curve])},
        )
    report.write_outputs(output_dir, results, markdown_table(results), figures)


# ----------------------------------------------------------------------------------------------------------- CLI
def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="adaflash bench http", description=__doc__.split("\n\n")[0])
    parser.add_argument("--server", action="append", help=f"LABEL=URL, repeatable (default {DEFAULT_SERVER})")
    parser.add_argument(
        "--in-process",
        action="append",
        metavar="LABEL=DRAFTER",
        help="also an engine in this process, as `adaflash serve --drafter DRAFTER` builds it (default: the shipped "
        "drafter; none: plain), with no HTTP; repeatable",
    )
    parser.add_argument("--model", help="model id to send (default: each server's first /v1/models entry)")
    parser.add_argument("--concurrency", type=int_at_least(1), nargs="+", default=[1, 4, 16], help="levels")
    parser.add_argument("--requests", type=int_at_least(1), default=32, help="requests per server and level")
    parser.add_argument("--max-tokens", type=int_at_least(1), default=128, help="max_tokens per request")
    parser.add_argument(
        "--duration-s",
        type=number_in(0, open_low=True),
        default=600.0,
        help="seconds per server and level; requests not sent by then are left out (default 600)",
    )
    parser.add_argument("--domains", nargs="+", default=["chat", "code", "math"], help="in turn")
    parser.add_argument("--split", default="heldout", choices=("heldout", "train"), help="prompt split")
    parser.add_argument(
        "--max-prompt-chars", type=int_at_least(1), default=1500, help="longer keep their end"
    )
    parser.add_argument("--disconnect-prob", type=number_in(0, 1), default=0.0, help="a client's drop chance")
    parser.add_argument("--learning-curve", action="store_true", help="τ against requests (first server)")
    parser.add_argument("--window", type=int_at_least(1), default=100, help="requests per curve point")
    parser.add_argument("--seed", type=int, default=0, help="prompt shuffle and disconnect draws")
    parser.add_argument("--output-dir", type=Path, default=Path("runs/bench_http"), help="where outputs go")
    parser.add_argument("--config", metavar="FILE", help=CONFIG_HELP)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = parse_args_with_config(make_parser(), argv)
    in_process = parse_labelled(args.in_process or [], "--in-process", "DRAFTER (default, none or a folder)")
    servers = args.server or ([] if in_process else [DEFAULT_SERVER])
    servers = parse_labelled(servers, "--server", "URL", check_loopback)
    if set(servers) & set(in_process):
        raise ValueError(
            f"--in-process: expected labels apart from --server's, got {sorted(set(servers) & set(in_process))}"
        )
    prompts = load_prompts(args.domains, args.split, args.requests, args.seed, args.max_prompt_chars)
    engines = {label: build_in_process(drafter) for label, drafter in in_process.items()}
    results = run_benchmark(
        servers,
        args.model,
        prompts,
        args.concurrency,
        engines,
        max_tokens=args.max_tokens,
        duration_s=args.duration_s,
        disconnect_prob=args.disconnect_prob,
        seed=args.seed,
    )
    results["settings"] = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()} | {
        "servers": servers,
        "in_process": in_process,
        "command": report.command("http", argv),
    }
    write_outputs(results, args.output_dir, args.window if args.learning_curve else None)
    return report.finish("http", results, args.output_dir, markdown_table(results))


if __name__ == "__main__":
    raise SystemExit(main())
