"""`adaflash bench train`: blocks/s and peak memory of the trainer's own step per variant, as JSON and a table."""

import json

import pytest
import torch

from adaflash_hf import cli
from adaflash_hf.bench import train as bench

COLUMNS = [
    "variant",
    "layout",
    "anchors",
    "blocks/step",
    "bf16",
    "draft vocab",
    "layers",
    "CE positions",
    "soft KL weight",
    "s/step",
    "blocks/s",
    "speed-up vs today",
    "peak RSS MiB",
    "step MiB",
]


def test_quick_run_writes_json_and_a_table_with_speedups_against_today(tmp_path, capsys):
    variants = [
        "today",
        "split-24",
        "split-24-bf16-dv",
        "split-24-dv-1layer",
        "split-512-dv-1layer-lp6",
        "split-512-dv-1layer-lp6-soft",
    ]
    argv = ["--quick", "--in-process", "--steps", "1", "--warmup", "0", "--variants", *variants]
    assert bench.main([*argv, "--output", str(tmp_path / "train.json")]) == 0
    table = capsys.readouterr().out.splitlines()
    header = next(line for line in table if line.startswith("| variant"))
    assert [cell.strip() for cell in header.strip("|").split("|")] == COLUMNS
    rows = [line for line in table if line.startswith("| ") and not line.startswith("| variant")]
    assert [row.split("|")[1].strip() for row in rows] == variants

    results = json.loads((tmp_path / "train.json").read_text())
    assert results["settings"]["shape"] == "quick" and results["settings"]["threads"] == 1
    entries = {e["variant"]: e for e in results["variants"]}
    assert entries["today"]["speedup_vs_today"] == 1.0
    assert (
        entries["today"]["attention_layout"] == "dense" and entries["split-24"]["attention_layout"] == "split"
    )
    assert entries["split-24-bf16-dv"]["bf16"] and entries["split-24-bf16-dv"]["draft_vocab_size"] == 128
    assert entries["split-24-dv-1layer"]["drafter_layers"] == 1
    assert (
        entries["split-512-dv-1layer-lp6"]["loss_positions"] == 6
        and entries["today"]["loss_positions"] is None
    )
    assert entries["split-512-dv-1layer-lp6-soft"]["soft_target_weight"] == 0.5
    assert entries["split-512-dv-1layer-lp6"]["soft_target_weight"] == 0.0
    for entry in entries.values():
        assert entry["blocks_per_step"] > 0 and entry["blocks_per_s"] > 0 and entry["peak_rss_mib"] > 0


def test_draft_vocab_is_the_most_frequent_labels_filled_with_random_ids():
    labels = torch.tensor([[7, 7, 7, 3, 3, 9, -100, -100]])
    ids = bench.top_label_vocab(labels, 5, 20, torch.Generator().manual_seed(0))
    assert ids.tolist() == sorted(set(ids.tolist())) and len(ids) == 5
    assert {3, 7, 9} <= set(ids.tolist())
    assert bench.top_label_vocab(labels, 2, 20, torch.Generator()).tolist() == [3, 7]  # the two most frequent


def test_cli_runs_bench_train(capsys):
    assert "train" in cli.BENCH_MODULES
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", "train", "--help"])
    assert exit_info.value.code == 0 and "--quick" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--steps", "0"], "argument --steps: expected an int >= 1, got 0"),
        (["--warmup", "-1"], "argument --warmup: expected an int >= 0, got -1"),
        (["--threads", "0"], "argument --threads: expected an int >= 1, got 0"),
    ],
)
def test_bad_counts_are_usage_errors_before_any_step(capsys, flags, message):
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--quick", *flags])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_real_shapes_are_the_default_targets_and_quick_shapes_read_no_target(monkeypatch):
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=96, num_attention_heads=6, num_key_value_heads=2, head_dim=16)
    monkeypatch.setattr("adaflash_hf.assets.load_target_config", lambda: config)
    shape = bench.shapes(quick=False)
    assert {k: shape[k] for k in bench.TARGET_SHAPE} == {k: getattr(config, k) for k in bench.TARGET_SHAPE}
    assert shape["batch"] == bench.SHAPES["real"]["batch"]
    monkeypatch.setattr("adaflash_hf.assets.load_target_config", lambda: pytest.fail("read a target config"))
    assert bench.shapes(quick=True) == bench.SHAPES["quick"]
