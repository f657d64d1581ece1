"""``adaflash bench serve`` on tiny random models: every mode at every level, lossless, and all three outputs."""

import json
import re

import pytest
import torch

from adaflash_hf.bench.serve import QUICK, main, make_parser, run_benchmark, write_outputs


def test_bench_serve_runs_all_modes_and_writes_json_table_and_plot(target_factory, drafter_factory, tmp_path):
    target = target_factory("llama")
    drafter = drafter_factory(target)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 500, (n,), generator=g) for n in (5, 9, 3, 12)]
    results = run_benchmark(target, drafter, prompts, [1, 4], requests_per_level=2, max_new_tokens=6)
    write_outputs(results, tmp_path)
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["ok"] and "goals" not in saved  # a bench measures; experiments/goals.py grades
    rows = {(r["concurrency"], r["mode"]): r for r in saved["summary"]}
    modes = ("plain", "dflash", "adaflash", "hybrid", "goodput", "hybrid_goodput")
    assert set(rows) == {(c, m) for c in (1, 4) for m in modes}
    assert all(
        0 <= r["zero_length_share"] <= 1 and 0 <= r["skipped_drafter_share"] <= 1 for r in rows.values()
    )
    assert rows[4, "plain"]["zero_length_share"] == 1 and rows[4, "dflash"]["zero_length_share"] < 1
    assert all(0 <= r["lookup_share"] <= 1 for r in rows.values()) and rows[4, "plain"]["lookup_share"] == 0
    assert rows[4, "plain"]["requests"] == 4 and rows[1, "plain"]["requests"] == 2
    assert rows[1, "plain"]["speedup_vs_plain"] == 1.0 and rows[1, "plain"]["mean_verify_length"] == 0
    assert rows[1, "dflash"]["mean_verify_length"] > 0
    assert "| 4 | adaflash |" in (tmp_path / "table.md").read_text()
    assert (tmp_path / "speedup_vs_concurrency.png").stat().st_size > 0
    assert saved["cost_curve"] and (tmp_path / "cost_curve.png").stat().st_size > 0  # measured by goodput


def test_warm_up_waves_run_every_mode_untimed_and_keep_their_first_tokens_per_s(
    target_factory, drafter_factory, monkeypatch
):
    from adaflash_hf.bench import serve

    target = target_factory("llama")
    drafter = drafter_factory(target)
    prompts = [torch.randint(0, 500, (n,), generator=torch.Generator().manual_seed(n)) for n in (5, 9)]
    calls = []
    real = serve.run_level
    monkeypatch.setattr(serve, "run_level", lambda *a, **k: calls.append((a[2], a[4])) or real(*a, **k))
    modes = ("plain", "goodput")
    results = run_benchmark(
        target,
        drafter,
        prompts,
        [2],
        modes=modes,
        requests_per_level=2,
        max_new_tokens=4,
        repeats=2,
        warmup_waves=1,
    )
    # one warm-up request per mode, then at the level one untimed round and two timed ones, interleaved
    assert calls == [("plain", 1), ("goodput", 1)] + [(m, 2) for _ in range(3) for m in modes]
    for row in results["summary"]:
        assert len(row["seconds"]) == 2 and row["first_wave_tokens_per_s"] > 0
    assert results["settings"]["warmup_waves"] == 1
    cold = run_benchmark(
        target, drafter, prompts, [2], modes=("plain",), requests_per_level=2, max_new_tokens=4
    )
    assert cold["summary"][0]["first_wave_tokens_per_s"] is None
    with pytest.raises(ValueError, match="warmup_waves: expected an int >= 0, got -1"):
        run_benchmark(target, drafter, prompts, [2], modes=modes, warmup_waves=-1)


def test_modes_without_plain_are_refused_before_loading_anything(tmp_path, capsys):
    assert make_parser().parse_args(["--quick"]).concurrency is None and QUICK["concurrency"] == [1, 2]
    with pytest.raises(SystemExit) as exit_:
        main(["--modes", "dflash", "--output-dir", str(tmp_path)])
    assert exit_.value.code == 2
    assert "--modes: expected a list including plain" in capsys.readouterr().err


@pytest.fixture
def no_target(monkeypatch):
    monkeypatch.setattr(
        "adaflash_hf.assets.load_target", lambda name: pytest.fail("the target loaded before the check")
    )


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--concurrency", "1", "0"], "argument --concurrency: expected an int >= 1, got 0"),
        (["--requests-per-level", "0"], "argument --requests-per-level: expected an int >= 1, got 0"),
        (["--threads", "0"], "argument --threads: expected an int >= 1, got 0"),
        (["--warmup-waves", "-1"], "argument --warmup-waves: expected an int >= 0, got -1"),
        (
            ["--lookup-min-prob", "-0.5"],
            r"argument --lookup-min-prob: expected a number in \[0, 1\], got -0.5",
        ),
    ],
)
def test_bad_options_are_usage_errors_before_the_target_loads(no_target, tmp_path, capsys, flags, message):
    with pytest.raises(SystemExit) as exit_:
        main(["--quick", "--output-dir", str(tmp_path), *flags])
    assert exit_.value.code == 2
    assert re.search(message, capsys.readouterr().err)


def test_a_missing_drafter_folder_is_refused_before_the_target_loads(no_target, tmp_path):
    with pytest.raises(FileNotFoundError, match="expected an existing drafter folder"):
        main(["--quick", "--drafter", str(tmp_path / "missing"), "--output-dir", str(tmp_path)])
