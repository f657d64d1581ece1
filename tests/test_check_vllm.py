"""experiments/vllm/check_vllm.py run, without vLLM: a stand-in ``vllm`` module on PYTHONPATH records the engine options
it is given and starts, or refuses to start like a GPU build short of memory."""

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "experiments" / "vllm" / "check_vllm.py"
STOCK = (
    "--methods",
    "vllm_plain",
    "vllm_dflash",
)  # the engines without the plugin (its RPCs need real workers)

FAKE_VLLM = """
import json, os


class SamplingParams:
    def __init__(self, **options):
        self.options = options


class TokensPrompt(dict):
    pass


class _Output:
    def __init__(self, ids):
        self.outputs = [type("Completion", (), {"token_ids": ids})()]


class _Engine:  # the step API: one request finishes a step, so requests finish apart; the others report 1 token
    def __init__(self, spec):
        self.spec, self.running = spec, []

    def add_request(self, request_id, prompt, params):
        self.running.append((request_id, params.options["max_tokens"]))
        with open(os.environ["FAKE_VLLM_LOG"] + ".adds", "a") as handle:
            record = {"spec": self.spec, "in_flight": len(self.running), "max_tokens": params.options["max_tokens"]}
            handle.write(json.dumps(record) + "\\n")

    def has_unfinished_requests(self):
        return bool(self.running)

    def step(self):
        request_id, n = self.running.pop(0)
        out = {"request_id": request_id, "finished": True, "outputs": _Output(list(range(n))).outputs}
        running = [{"request_id": r, "finished": False, "outputs": _Output([0]).outputs} for r, _ in self.running]
        return [type("Out", (), o) for o in [out, *running]]


class LLM:
    def __init__(self, **options):
        self.options = options
        self.llm_engine = _Engine("speculative_config" in options)
        with open(os.environ["FAKE_VLLM_LOG"], "a") as handle:
            handle.write(json.dumps(options) + "\\n")
        if os.environ.get("FAKE_VLLM_FAIL"):
            raise ValueError("Free memory on device (20.1/23.6 GiB) is less than desired GPU memory utilization")

    def generate(self, prompts, params, use_tqdm=False):
        with open(os.environ["FAKE_VLLM_LOG"] + ".calls", "a") as handle:
            handle.write(json.dumps({"spec": "speculative_config" in self.options, "n": len(prompts)}) + "\\n")
        return [_Output(list(range(params.options["max_tokens"]))) for _ in prompts]
"""


def run_script(tmp_path, *args, fail=False):
    (tmp_path / "fake").mkdir(exist_ok=True)
    (tmp_path / "fake" / "vllm.py").write_text(FAKE_VLLM)
    out = tmp_path / "check"
    out.mkdir(exist_ok=True)
    (out / "prompts.json").write_text(json.dumps([[1, 2, 3], [4, 5]]))
    env = {
        **os.environ,
        "PYTHONPATH": str(tmp_path / "fake"),
        "FAKE_VLLM_LOG": str(tmp_path / "engines.jsonl"),
    }
    if fail:
        env["FAKE_VLLM_FAIL"] = "1"
    command = [
        sys.executable,
        str(SCRIPT),
        "run",
        "--out",
        str(out),
        "--concurrency",
        "1",
        "--max-tokens",
        "4",
    ]
    result = subprocess.run(
        [*command, *args], capture_output=True, text=True, env=env, timeout=600
    )  # a hang guard: 6 engine processes on a busy host
    engines = [json.loads(line) for line in (tmp_path / "engines.jsonl").read_text().splitlines()]
    return result, engines


def test_gpu_memory_utilization_reaches_every_engine(tmp_path):
    result, engines = run_script(tmp_path, "--dtype", "bfloat16", "--gpu-memory-utilization", "0.6", *STOCK)
    assert result.returncode == 0, result.stderr
    assert len(engines) == 2 and all(e["gpu_memory_utilization"] == 0.6 for e in engines)
    assert json.loads(result.stdout.strip().splitlines()[-1]) == {"vllm_dflash_bfloat16@1": True}


def test_without_gpu_memory_utilization_vllm_keeps_its_default(tmp_path):
    result, engines = run_script(tmp_path, "--dtype", "bfloat16", *STOCK)
    assert result.returncode == 0, result.stderr
    assert not any("gpu_memory_utilization" in e for e in engines)


@pytest.mark.parametrize("value", ["0", "1.5", "most"])
def test_gpu_memory_utilization_outside_zero_one_is_a_usage_error(tmp_path, value):
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "run", "--gpu-memory-utilization", value],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "argument --gpu-memory-utilization: expected a fraction in (0, 1]" in result.stderr


def test_no_engine_starting_is_an_error_naming_each_engines_failure(tmp_path):
    result, engines = run_script(tmp_path, "--dtype", "bfloat16", *STOCK, fail=True)
    assert result.returncode == 1 and len(engines) == 2
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith("check_vllm run: error: expected at least one vLLM engine to run, got none of 2")
    assert "vllm_plain_bfloat16: ValueError: Free memory on device" in line and "vllm_dflash_bfloat16" in line
    assert "{}" not in result.stdout


def test_repeats_run_every_engine_again_in_the_reverse_order_and_summarize_medians(tmp_path):
    result, engines = run_script(tmp_path, "--dtype", "float32", "--repeats", "3", *STOCK)
    assert result.returncode == 0, result.stderr
    started = ["speculative_config" in e for e in engines]
    assert started == [False, True, True, False, False, True]  # plain, DFlash; DFlash, plain; plain, DFlash
    report = json.loads((tmp_path / "check" / "vllm.json").read_text())
    assert report["repeats"] == 3 and sorted(row["repeat"] for row in report["rows"]) == [0, 0, 1, 1, 2, 2]
    summary = {row["engine"]: row for row in report["summary"]}
    plain, dflash = summary["vllm_plain_float32"], summary["vllm_dflash_float32"]
    assert len(plain["runs"]) == 3 and plain["median_tokens_per_s"] == sorted(plain["runs"])[1]
    assert dflash["vs_vllm_plain"] == dflash["median_tokens_per_s"] / plain["median_tokens_per_s"]


def test_repeats_below_one_is_a_usage_error():
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "run", "--repeats", "0"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2 and "--repeats: expected an int >= 1, got 0" in result.stderr


def test_paired_waves_alternate_the_engines_and_give_each_wave_its_ratio_to_plain(tmp_path):
    result, engines = run_script(
        tmp_path, "--dtype", "float32", "--paired", "3", "--concurrency", "2", *STOCK
    )
    assert result.returncode == 0, result.stderr
    assert ["speculative_config" in e for e in engines] == [False, True]  # started once, side by side
    calls = [json.loads(line) for line in (tmp_path / "engines.jsonl.calls").read_text().splitlines()]
    # a warm-up each, then waves of 2 prompts: plain, DFlash; DFlash, plain; plain, DFlash
    assert [(c["spec"], c["n"]) for c in calls] == [
        (False, 1), (True, 1), (False, 2), (True, 2), (True, 2), (False, 2), (False, 2), (True, 2)
    ]  # fmt: skip
    report = json.loads((tmp_path / "check" / "vllm.json").read_text())
    assert report["paired"] is True and report["waves"] == 3
    dflash = [r for r in report["rows"] if r["engine"] == "vllm_dflash_float32"]
    plain = [r for r in report["rows"] if r["engine"] == "vllm_plain_float32"]
    assert [r["wave"] for r in dflash] == [0, 1, 2] and [r["wave"] for r in plain] == [0, 1, 2]
    for d, p in zip(dflash, plain):
        assert d["vs_vllm_plain"] == d["tokens_per_s"] / p["tokens_per_s"] and d["equal_to_plain"] == 1.0
    summary = {row["engine"]: row for row in report["summary"]}["vllm_dflash_float32"]
    ratios = sorted(r["vs_vllm_plain"] for r in dflash)
    assert summary["waves"] == 3 and summary["vs_vllm_plain"] == ratios[1]
    assert summary["vs_vllm_plain_quartiles"][0] <= ratios[1] <= summary["vs_vllm_plain_quartiles"][1]
    # all waves together: every wave's tokens over every wave's seconds, against plain's
    assert all(r["tokens"] == 2 * 4 and r["seconds"] > 0 for r in dflash + plain)
    together = sum(r["seconds"] for r in plain) / sum(r["seconds"] for r in dflash)
    assert summary["vs_vllm_plain_all_waves"] == pytest.approx(together)
    assert report["equals_plain"] == {"vllm_dflash_float32@2": True}


def test_continuous_waves_keep_c_in_flight_and_replace_each_finished_request(tmp_path):
    result, _ = run_script(
        tmp_path, "--dtype", "float32", "--paired", "2", "--continuous", "3", "--concurrency", "2", *STOCK
    )
    assert result.returncode == 0, result.stderr
    adds = [json.loads(line) for line in (tmp_path / "engines.jsonl.adds").read_text().splitlines()]
    # per engine and wave 3 x 2 prompts, never more than 2 in flight, a new one as soon as one finishes
    assert len(adds) == 2 * 2 * 6 and max(a["in_flight"] for a in adds) == 2
    assert sum(a["in_flight"] == 2 for a in adds) == 2 * 2 * 5
    report = json.loads((tmp_path / "check" / "vllm.json").read_text())
    assert report["continuous"] == 3 and report["waves"] == 2
    rows = [r for r in report["rows"] if "wave" in r]
    assert len(rows) == 4 and all(r["tokens"] == 6 * 4 for r in rows)
    assert report["equals_plain"] == {"vllm_dflash_float32@2": True}
    # while 2 were in flight: up to the 5th finish, when no prompt was left to replace it; the tokens then the 5
    # finished requests' and the one token the 6th had
    for row in rows:
        assert row["in_flight_tokens"] == 5 * 4 + 1 and 0 < row["in_flight_seconds"] <= row["seconds"]
        assert row["in_flight_tokens_per_s"] == pytest.approx(
            row["in_flight_tokens"] / row["in_flight_seconds"]
        )
    dflash = [r for r in rows if r["engine"] == "vllm_dflash_float32"]
    plain = {r["wave"]: r for r in rows if r["engine"] == "vllm_plain_float32"}
    for row in dflash:
        ratio = row["in_flight_tokens_per_s"] / plain[row["wave"]]["in_flight_tokens_per_s"]
        assert row["in_flight_vs_vllm_plain"] == pytest.approx(ratio)
    summary = next(s for s in report["summary"] if s["engine"] == "vllm_dflash_float32")
    assert summary["in_flight_vs_vllm_plain"] == pytest.approx(
        statistics.median(r["in_flight_vs_vllm_plain"] for r in dflash)
    )


def test_a_spread_gives_each_prompt_its_own_length_the_same_for_every_engine(tmp_path):
    result, _ = run_script(
        tmp_path, "--dtype", "float32", "--paired", "2", "--continuous", "8", "--concurrency", "2",
        "--max-tokens", "40", "--max-tokens-spread", "0.5", *STOCK,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    adds = [json.loads(line) for line in (tmp_path / "engines.jsonl.adds").read_text().splitlines()]
    plain = [a["max_tokens"] for a in adds if not a["spec"]]
    dflash = [a["max_tokens"] for a in adds if a["spec"]]
    assert plain == dflash and len(plain) == 2 * 16  # two waves of 8 x 2 prompts, alike for both engines
    assert all(20 <= n <= 60 for n in plain) and len(set(plain)) > 4
    assert plain[:16] != plain[16:]  # each wave draws its own
    report = json.loads((tmp_path / "check" / "vllm.json").read_text())
    assert report["max_tokens_spread"] == 0.5
    assert sum(r["tokens"] for r in report["rows"] if r.get("engine") == "vllm_plain_float32") == sum(plain)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--paired", "2", "--max-tokens-spread", "0.5", "--methods", "vllm_plain"],
            "--max-tokens-spread: expected --continuous ROUNDS beside it, got none",
        ),
        (
            ["--paired", "2", "--continuous", "2", "--max-tokens-spread", "1.5", "--methods", "vllm_plain"],
            "--max-tokens-spread: expected a fraction in [0, 1), got 1.5",
        ),
        (["--continuous", "2"], "--continuous: expected --paired WAVES beside it, got none"),
        (
            ["--paired", "2", "--continuous", "0", "--methods", "vllm_plain"],
            "--continuous: expected an int >= 1, got 0",
        ),
        (["--paired", "0"], "--paired: expected an int >= 1, got 0"),
        (
            ["--paired", "2", "--methods", "vllm_dflash"],
            "--paired: expected vllm_plain among --methods, got vllm_dflash",
        ),
        (
            ["--paired", "2", "--methods", "vllm_plain", "vllm_dflash", "adaflash_goodput"],
            "--paired: expected vllm_dflash or the plugin's methods, got both",
        ),
        (
            ["--paired", "2", "--repeats", "2", "--methods", "vllm_plain", "adaflash_goodput"],
            "--paired: expected no --repeats (each wave is a repeat), got --repeats 2",
        ),
    ],
)
def test_bad_paired_options_are_usage_errors(args, message):
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "run", *args], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2 and message in result.stderr
