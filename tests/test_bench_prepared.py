"""``bench generate --dtype/--prepared/--plain-baselines``: the prepared bf16 target is benchmarked lossless against
its own plain decoding, speed-ups are also reported against the fastest plain decoding (fp32 or bf16, whichever
generated more tokens per second), each method's exact-equality rate is recorded, and the record names the CPU and
its bf16 flags."""

import json
import re

import pytest
import torch

from adaflash_hf.bench import generate as bench
from adaflash_hf.bench.targets import benchmarked_target, plain_baselines
from adaflash_hf.prepared.cpu import cpu_model
from adaflash_hf.prepared.prepare import is_prepared


def record(method, prompt, seconds, baseline_seconds, tokens=10, baseline_tokens=None):
    return {
        "domain": "chat",
        "prompt_id": prompt,
        "method": method,
        "new_tokens": tokens,
        "median_seconds": seconds,
        "plain_baseline_seconds": baseline_seconds,
        "plain_baseline_tokens": baseline_tokens or dict.fromkeys(baseline_seconds, tokens),
    }


def test_the_fastest_plain_is_the_baseline_with_the_most_tokens_per_second():
    records = [
        record("plain", "a", 2.0, {"bf16": 1.0}),
        record("adaflash_hybrid", "a", 0.5, {"bf16": 1.0}),
        record(
            "plain", "b", 2.0, {"bf16": 3.5}
        ),  # bf16 is slower here, faster in all (20 tokens in 4.5 s vs 4.0 s)
    ]
    fastest = bench._fastest_plain(records, {"fp32": None, "bf16": object()})
    assert fastest == {"name": "fp32", "tokens_per_s": {"fp32": 5.0, "bf16": 20 / 4.5}}
    assert [r["speedup_vs_fastest_plain"] for r in records] == [1.0, 4.0, 1.0]
    faster_bf16 = [
        record("plain", "a", 2.0, {"bf16": 1.0}),
        record("adaflash_hybrid", "a", 0.5, {"bf16": 1.0}),
    ]
    assert bench._fastest_plain(faster_bf16, {"fp32": None, "bf16": object()})["name"] == "bf16"
    assert [r["speedup_vs_fastest_plain"] for r in faster_bf16] == [0.5, 2.0]


def test_a_baseline_whose_text_ends_sooner_is_compared_per_token():
    # bf16 greedy text hits EOS after 4 tokens where the target's runs 10: less time, not a faster decoding.
    records = [
        record("plain", "a", 2.0, {"bf16": 1.0}, tokens=10, baseline_tokens={"bf16": 4}),
        record("adaflash_hybrid", "a", 1.0, {"bf16": 1.0}, tokens=10, baseline_tokens={"bf16": 4}),
    ]
    fastest = bench._fastest_plain(records, {"fp32": None, "bf16": object()})
    assert fastest == {"name": "fp32", "tokens_per_s": {"fp32": 5.0, "bf16": 4.0}}
    assert [r["speedup_vs_fastest_plain"] for r in records] == [1.0, 2.0]


def test_baselines_are_copies_and_the_target_itself_where_it_is_that_plain_decoding(tiny_pair):
    loaded, _ = tiny_pair
    target, prepared = benchmarked_target(loaded, "bf16", prepared=True)
    assert prepared["dtype"] == "torch.bfloat16" and prepared["invariant"] and is_prepared(target) is not None
    assert next(loaded.parameters()).dtype == torch.float32 and is_prepared(loaded) is None
    baselines = plain_baselines(loaded, ["fp32", "bf16"], target, prepared)
    assert all(m is not None and m is not loaded and is_prepared(m) is None for m in baselines.values())
    eager, none = benchmarked_target(loaded, "fp32", prepared=False)
    assert none is None and plain_baselines(loaded, ["fp32"], eager, None) == {"fp32": None}


def test_main_benchmarks_the_prepared_bf16_target_lossless_with_speedups_against_the_fastest_plain(
    offline_main,
):
    status, out = offline_main("--dtype", "bf16", "--prepared", "--methods", "plain", "adaflash_hybrid")
    assert status == 0
    results = json.loads((out / "results.json").read_text())
    settings = results["settings"]
    assert settings["target_dtype"] == "bfloat16" and settings["prepared"]["invariant"] is True
    assert settings["fastest_plain"]["name"] in ("fp32", "bf16")
    assert sorted(settings["fastest_plain"]["tokens_per_s"]) == ["bf16", "fp32"]
    assert results["ok"] and all(row["exact_rate"] == 1.0 for row in results["summary"])
    assert all(row["speedup_vs_fastest_plain"] > 0 for row in results["summary"])
    table = (out / "table.md").read_text()
    assert "vs fastest plain" in table and cpu_model() in table and "avx512_bf16" in table


def test_an_unknown_dtype_is_a_usage_error_before_the_target_loads(no_target, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--quick", "--dtype", "fp16"])
    assert exit_info.value.code == 2
    assert re.search(r"argument --dtype: invalid choice: 'fp16'", capsys.readouterr().err)


def test_int4_without_prepared_is_a_usage_error_before_the_target_loads(no_target, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--quick", "--dtype", "int4"])
    assert exit_info.value.code == 2
    assert "--dtype int4: expected --prepared with it" in capsys.readouterr().err


def test_bench_serve_reports_the_prepared_target_against_the_fastest_plain_batched_decoding(
    target_factory, drafter_factory
):
    from adaflash_hf.bench import serve

    loaded = target_factory("llama")
    target, prepared = benchmarked_target(loaded, "bf16", prepared=True)
    baselines = plain_baselines(loaded, ["fp32", "bf16"], target, prepared)
    prompts = [torch.randint(0, 500, (n,), generator=torch.Generator().manual_seed(n)) for n in (70, 9, 3)]
    results = serve.run_benchmark(
        target,
        drafter_factory(target),
        prompts,
        [1, 2],
        modes=("plain", "adaflash", "hybrid"),
        requests_per_level=3,
        max_new_tokens=8,
        baselines=baselines,
    )
    assert results["ok"] and results["settings"]["plain_baselines"] == ["fp32", "bf16"]
    for row in results["summary"]:
        assert row["exact_rate"] == 1.0 and row["fastest_plain"] in ("fp32", "bf16")
        fastest = row["plain_baseline_tokens_per_s"][row["fastest_plain"]]
        assert fastest == max(row["plain_baseline_tokens_per_s"].values())
        assert row["speedup_vs_fastest_plain"] == row["tokens_per_s"] / fastest
    results["settings"].update(target_dtype="bfloat16", prepared=prepared)
    assert "vs fastest plain" in serve.markdown_table(results) and cpu_model() in serve.markdown_table(
        results
    )
