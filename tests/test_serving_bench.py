"""``adaflash bench serve`` on tiny random models: every mode at every level, lossless, and all three outputs."""

import json

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
    assert saved["ok"] and set(saved["goals"]) == {
        "adaflash_at_least_plain_everywhere",
        "goodput_at_least_0.97x_plain_everywhere",
    }
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


def test_modes_without_plain_are_refused_before_loading_anything(tmp_path, capsys):
    assert make_parser().parse_args(["--quick"]).concurrency is None and QUICK["concurrency"] == [1, 2]
    with pytest.raises(SystemExit) as exit_:
        main(["--modes", "dflash", "--output-dir", str(tmp_path)])
    assert exit_.value.code == 2
    assert "--modes: expected a list including plain" in capsys.readouterr().err
