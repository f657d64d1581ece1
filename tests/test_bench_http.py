"""``adaflash bench http`` against a real ``adaflash serve`` app on a loopback port: every request completes and is
counted, dropped streams are aborted by the server, the learning curve has its intervals, the outputs are written,
and only loopback servers are driven."""

import json
import time

import pytest

from adaflash_hf.bench import http
from adaflash_hf.serving.server import BackgroundServer, build_engine, create_app
from adaflash_hf.serving.worker import EngineWorker

PROMPTS = ["w5 w6 w7", "w9 w10", "w40 w41 w42", "w100"]


@pytest.fixture(scope="module")
def server(target_factory, drafter_factory, word_tokenizer):
    target = target_factory("llama", initializer_range=0.2)
    worker = EngineWorker(build_engine(target, drafter_factory(target)), word_tokenizer)
    with BackgroundServer(create_app(worker, word_tokenizer, "tiny")) as running:
        yield running


def test_a_level_cut_short_by_its_time_cap_says_how_many_requests_it_left_out(server, caplog):
    results = http.run_benchmark({"a": server.base_url}, None, PROMPTS, [1], max_tokens=8, duration_s=1e-9)
    (row,) = results["summary"]
    assert (
        row["unsent"] == len(PROMPTS) - len(results["records"]["a@1"]) == len(PROMPTS)
    )  # the cap came first
    assert (
        f"{len(PROMPTS)} of {len(PROMPTS)} requests not sent" in caplog.text and "--duration-s" in caplog.text
    )
    assert f"({len(PROMPTS)} unsent: --duration-s)" in http.markdown_table(results)


def test_every_level_completes_its_requests_with_latencies_and_tau(server, tmp_path):
    results = http.run_benchmark(
        {"a": server.base_url, "b": server.base_url}, None, PROMPTS, [1, 2], max_tokens=8, duration_s=60
    )
    rows = results["summary"]
    assert [(r["server"], r["concurrency"]) for r in rows] == [("a", 1), ("b", 1), ("a", 2), ("b", 2)]
    for row in rows:
        assert (row["completed"], row["errors"], row["rejected_429"], row["unsent"]) == (4, 0, 0, 0)
        assert row["tokens_per_s"] > 0 and row["ttft_p50"] <= row["ttft_p99"] and row["itl_p50"] is not None
        assert row["tau"] >= 1.0 and row["memory_mb"][1] > 0
    assert all(r["tokens"] == 8 for r in results["records"]["a@1"])
    http.write_outputs(results, tmp_path, window=2)
    assert {p.name for p in tmp_path.iterdir()} == {
        "results.json",
        "table.md",
        "tokens_per_s.png",
        "tau_vs_requests.png",
    }
    curve = json.loads((tmp_path / "results.json").read_text())["learning_curve"]
    assert [c["requests"] for c in curve] == [2, 4] and all(c["low"] <= c["tau"] <= c["high"] for c in curve)


def test_dropped_streams_are_aborted_by_the_server_and_it_goes_on(server):
    before = http.scrape(server.base_url)['adaflash_requests_finished_total{reason="abort"}']
    records, _ = http.asyncio.run(
        http.run_level(
            server.base_url, "tiny", PROMPTS, 4, max_tokens=200, duration_s=60, disconnect_prob=1.0
        )
    )
    assert [r["status"] for r in records] == ["dropped"] * 4
    deadline = time.monotonic() + 30  # the aborts reach the engine thread between two steps
    while http.scrape(server.base_url)['adaflash_requests_finished_total{reason="abort"}'] < before + 4:
        assert time.monotonic() < deadline, "the dropped requests were not aborted"
        time.sleep(0.05)
    assert http.scrape(server.base_url)["adaflash_requests_running"] == 0
    records, _ = http.asyncio.run(
        http.run_level(server.base_url, "tiny", PROMPTS[:1], 1, max_tokens=4, duration_s=60)
    )
    assert records[0]["status"] == "ok" and records[0]["finish_reason"] == "length"


def test_the_command_drives_a_server_and_prints_the_table(server, tmp_path, capsys):
    argv = [
        "--server",
        f"tiny={server.base_url}",
        "--concurrency",
        "2",
        "--requests",
        "2",
        "--max-tokens",
        "4",
    ]
    argv += ["--domains", "math", "--max-prompt-chars", "60", "--output-dir", str(tmp_path)]
    assert http.main(argv) == 0
    assert "| tiny | 2 |" in capsys.readouterr().out
    assert json.loads((tmp_path / "results.json").read_text())["summary"][0]["completed"] == 2


@pytest.mark.parametrize(
    "url", ["http://10.0.0.1:8000/v1", "http://example.com/v1", "http://0.0.0.0:8000/v1"]
)
def test_only_loopback_servers_are_driven(url):
    with pytest.raises(ValueError, match="--server: expected a loopback URL"):
        http.main(["--server", f"x={url}"])


def test_an_in_process_engine_runs_the_same_prompts_beside_the_server(
    server, target_factory, drafter_factory, word_tokenizer
):
    target = target_factory("llama", initializer_range=0.2)
    engines = {"local": (build_engine(target, drafter_factory(target)), word_tokenizer)}
    results = http.run_benchmark(
        {"http": server.base_url}, None, PROMPTS, [1, 3], engines, max_tokens=8, duration_s=60
    )
    rows = results["summary"]
    assert [(r["server"], r["concurrency"]) for r in rows] == [
        ("http", 1),
        ("local", 1),
        ("http", 3),
        ("local", 3),
    ]
    for row in rows:
        assert (row["completed"], row["errors"]) == (4, 0) and row["tokens_per_s"] > 0 and row["tau"] >= 1.0
    for c in (1, 3):
        served, local = results["records"][f"http@{c}"], results["records"][f"local@{c}"]
        assert [r["tokens"] for r in local] == [r["tokens"] for r in served]
        assert [r["finish_reason"] for r in local] == [r["finish_reason"] for r in served]
        assert all(r["chunk_times"] == sorted(r["chunk_times"]) and r["chunk_times"] for r in local)
    assert rows[1]["memory_mb"] == [None, None]  # no /metrics to read in-process


@pytest.mark.parametrize("value", ["local", "=none", "local=", "a=none a=default"])
def test_in_process_entries_are_checked(value):
    with pytest.raises(ValueError, match="--in-process: expected a new LABEL=DRAFTER"):
        http.main([arg for entry in value.split() for arg in ("--in-process", entry)])
