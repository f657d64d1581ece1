"""Where a step's time goes, vLLM plain beside the AdaFlash plugin: both engines in one process (vLLM's engine core
in-process), the same prompts served with c in flight (``check_vllm._continuous``), rounds alternated; vLLM's runner
methods, the plugin's proposal and the gate's timed steps are wrapped with timers. Not part of ``make test``.

    .venv-vllm/bin/python experiments/vllm/step_timers.py --out runs/vllm_check --concurrency 4 --rounds 4 [--gate-off]

``--out`` is a folder ``check_vllm.py prepare`` wrote. Prints each engine's seconds and their ratio, per runner
method its total and mean milliseconds, every step by kind (a request joined / a prefill chunk / drafts verified /
plain) and batch class with its mean wall time (from one ``execute_model`` to the next) and how many of them the
drafter ran after (its mean milliseconds there), and the gate's timed steps per class (what its medians are taken
from). ``--gate-off`` keeps the drafter out of every step (the floor any gate reaches: the cost of a
step with speculative decoding configured); ``--max-tokens-spread F`` gives each prompt its own length, drawn from
64 x [1 - F, 1 + F] (``check_vllm._lengths``); ``--trial-every N`` sets the gate's fewest steps between two drafting
steps tried where drafting loses (``rounds.DrafterGate``; 1: spaced by the trial's own timed loss alone).
"""

from __future__ import annotations

import argparse
import collections
import itertools
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

RUNNER_METHODS = (
    "execute_model",
    "sample_tokens",
    "propose_draft_token_ids",
    "_model_forward",
    "_prepare_inputs",
    "_update_states",
    "_bookkeeping_sync",
    "_sample",
    "_calc_spec_decode_metadata",
)


def _timed(table, counts, owner, name, key_of):
    original = getattr(owner, name)

    def timed(self, *args, **kwargs):
        started = time.perf_counter()
        try:
            return original(self, *args, **kwargs)
        finally:
            key = key_of(self, name)
            table[key] += time.perf_counter() - started
            counts[key] += 1

    setattr(owner, name, timed)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("runs/vllm_check"))
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=4, help="rounds of 4 x c prompts, engines alternated")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--gate-off", action="store_true", help="the drafter out of every step")
    parser.add_argument(
        "--pattern",
        help="the gate's decisions as a cycle of d (draft) and p (plain), e.g. dddp, instead of its own judgement",
    )
    parser.add_argument(
        "--trial-every",
        type=int,
        help="the gate's fewest steps between two drafting steps tried where drafting loses (its default otherwise)",
    )
    parser.add_argument(
        "--max-tokens-spread",
        type=float,
        default=0.0,
        help="each prompt's max tokens from 64 x [1 - F, 1 + F]",
    )
    args = parser.parse_args(argv)

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_DISABLE_COMPILE_CACHE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    import check_vllm
    from vllm import LLM, SamplingParams
    from vllm.v1.worker import gpu_model_runner

    from adaflash_hf.vllm import proposer, rounds
    from adaflash_hf.vllm.rounds import batch_bucket

    if args.gate_off:
        rounds.DrafterGate.draft = lambda self, batch: False
    if args.trial_every is not None:  # the proposer builds its gate with the defaults
        init = rounds.DrafterGate.__init__
        rounds.DrafterGate.__init__ = lambda self, **kw: init(self, **{"trial_every": args.trial_every, **kw})
    if args.pattern:
        cycle = [c == "d" for c in args.pattern.lower()]
        turns = itertools.count()
        rounds.DrafterGate.draft = lambda self, batch: self._decide(cycle[next(turns) % len(cycle)])
    seconds, calls = collections.defaultdict(float), collections.defaultdict(int)

    def engine_of(runner, name):
        return ("plugin" if getattr(runner, "drafter", None) is not None else "plain", name)

    for name in RUNNER_METHODS:
        _timed(seconds, calls, gpu_model_runner.GPUModelRunner, name, engine_of)
    for name in ("propose", "_stash_context", "_write_stashed_context"):
        _timed(seconds, calls, proposer.AdaFlashProposer, name, lambda _, n: ("plugin", "proposer." + n))

    steps: dict[str, list] = collections.defaultdict(
        list
    )  # per engine: [seconds, tokens, requests, new, drafts]
    execute = gpu_model_runner.GPUModelRunner.execute_model

    def execute_noting_the_step(self, scheduler_output, *args, **kwargs):
        record = steps[engine_of(self, "")[0]]
        now = time.perf_counter()
        proposing = seconds[("plugin", "proposer.propose")]
        if record and record[-1] is not None:
            record[-1][0] = now - record[-1][0]
            record[-1][5] = proposing - record[-1][5]  # the drafter's seconds after this step's forward
        drafts = sum(len(v) for v in scheduler_output.scheduled_spec_decode_tokens.values())
        requests = len(scheduler_output.num_scheduled_tokens)
        new = len(scheduler_output.scheduled_new_reqs)
        record.append([now, scheduler_output.total_num_scheduled_tokens, requests, new, drafts, proposing])
        return execute(self, scheduler_output, *args, **kwargs)

    gpu_model_runner.GPUModelRunner.execute_model = execute_noting_the_step

    gate_steps = []  # (kind, class, seconds of the whole step)
    start = rounds.DrafterGate.start

    def start_noting_the_timed_step(self, now, batch, request_ids, tokens=None):
        last = self._last
        prior = getattr(self, "_noted_prior", False)  # whether the proposal before ``last`` drafted
        before = {b: tuple(a.counts[:2]) for b, a in self.arms.items()}
        start(self, now, batch, request_ids, tokens)
        self._noted_prior = last is not None and last.drafted
        for bucket, arm in self.arms.items():
            plain, drafted = before.get(bucket, (0, 0))
            if arm.counts[0] > plain:
                kind = "plain after a drafting step" if prior else "plain after a plain step"
                gate_steps.append((kind, bucket, arm.plain_steps[-1] * last.batch))
            if arm.counts[1] > drafted:
                gate_steps.append(("draft", bucket, arm.draft_steps[-1] * last.batch))

    rounds.DrafterGate.start = start_noting_the_timed_step

    out = args.out
    prompts = json.loads((out / "prompts.json").read_text())
    engines = {}
    for name in ("vllm_plain", "adaflash_goodput"):
        options, env = check_vllm._engines(out, 15)[name]
        if name != "vllm_plain":
            os.environ.update(env)
        engines[name] = LLM(
            model=str(out / "target"),
            dtype=args.dtype,
            max_model_len=2048,
            seed=0,
            distributed_executor_backend="uni",
            **options,
        )
    params = SamplingParams(temperature=0.0, max_tokens=64)
    c = args.concurrency
    for llm in engines.values():
        check_vllm._continuous(llm, prompts[:c], params, c, "warm")
    seconds.clear(), calls.clear(), steps.clear(), gate_steps.clear()
    wall = collections.defaultdict(float)
    for index in range(args.rounds):
        batch = check_vllm._wave(prompts, 4 * c, index)
        own = [
            SamplingParams(temperature=0.0, max_tokens=n)
            for n in check_vllm._lengths(len(batch), params.max_tokens, args.max_tokens_spread, index)
        ]
        for name in list(engines) if index % 2 == 0 else list(engines)[::-1]:
            started = time.perf_counter()
            check_vllm._continuous(engines[name], batch, own, c, f"r{index}")
            wall[name] += time.perf_counter() - started
            steps["plain" if name == "vllm_plain" else "plugin"].append(
                None
            )  # the round's last step: untimed
    print(f"seconds {dict(wall)}; plugin / plain speed {wall['vllm_plain'] / wall['adaflash_goodput']:.3f}")
    for key in sorted(seconds):
        mean = 1000 * seconds[key] / max(calls[key], 1)
        print(f"{key[0]:7s} {key[1]:30s} {seconds[key]:8.2f} s {calls[key]:6d} calls {mean:8.2f} ms")
    for engine, record in steps.items():
        kinds = collections.defaultdict(list)
        for row, after in zip(record, record[1:]):
            if row is None or after is None:
                continue
            took, tokens, requests, new, drafts, drafting = row
            kind = (
                ("join+v" if drafts else "join")
                if new
                else "prefill"
                if tokens > requests + drafts
                else "verify"
                if drafts
                else "plain"
            )
            kinds[(kind, batch_bucket(requests))].append((took, tokens, drafts, drafting))
        for (kind, bucket), rows in sorted(kinds.items()):
            mean = 1000 * sum(r[0] for r in rows) / len(rows)
            tokens = sum(r[1] for r in rows) / len(rows)
            proposed = sum(r[3] > 0 for r in rows)
            drafter = 1000 * sum(r[3] for r in rows) / max(proposed, 1)
            print(
                f"{engine:7s} {kind:8s} class {bucket:3d}: {len(rows):5d} steps, {mean:6.1f} ms, {tokens:6.1f} tokens,"
                f" drafter after {proposed:4d} of them ({drafter:5.1f} ms)"
            )
    for kind in ("plain after a plain step", "plain after a drafting step", "draft"):
        for bucket in sorted({b for k, b, _ in gate_steps if k == kind}):
            values = [1000 * s for k, b, s in gate_steps if k == kind and b == bucket]
            print(
                f"gate {kind} class {bucket}: {len(values)} timed, median {statistics.median(values):.1f} ms a step"
            )
    print(json.dumps(engines["adaflash_goodput"].collective_rpc("adaflash_stats")[0]["gate"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
