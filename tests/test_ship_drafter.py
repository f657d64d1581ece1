"""experiments/ship_drafter.py: a trained checkpoint becomes the example drafter (bf16 weights equal to the checkpoint's
rounded to bf16, remote code, a card rendered from a bench JSON plus the notes), and a bad checkpoint leaves the
shipped folder as it was."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from huggingface_hub import ModelCard

from adaflash_hf import AdaFlashDrafter

REPO = Path(__file__).resolve().parents[1]
BENCH = {  # the shape `adaflash bench generate` writes
    "settings": {
        "cpu": "no amx_bf16, avx512_bf16",
        "threads": 2,
        "drafter": "/home/me/runs/x",
        "domains": ["chat"],
    },
    "summary": [
        {"domain": "chat", "method": "plain", "tau": 1.0, "speedup": 1.0, "rounds": 510, "lossless": True},
        {
            "domain": "chat",
            "method": "adaflash_goodput",
            "tau": 1.61,
            "speedup": 1.23,
            "rounds": 300,
            "lossless": True,
        },
    ],
    "records": [{"prompt": "not in the card"}],
}


def _ship_module():
    spec = importlib.util.spec_from_file_location("ship_drafter", REPO / "experiments" / "ship_drafter.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_ship_writes_bf16_weights_remote_code_and_the_measured_card(
    tmp_path, target_factory, drafter_factory
):
    drafter = drafter_factory(target_factory("llama"))
    drafter.save_pretrained(tmp_path / "checkpoint-7")
    (tmp_path / "bench.json").write_text(json.dumps(BENCH))
    (tmp_path / "notes.md").write_text("## Training budget and limits\n\n152k blocks on 2 CPU cores.\n")
    out, copy = tmp_path / "drafters" / "tiny", tmp_path / "card.md"
    (out / "stale").mkdir(parents=True)  # a previous ship is replaced whole
    _ship_module().main(
        [
            str(tmp_path / "checkpoint-7"),
            "--out", str(out),
            "--bench-json", str(tmp_path / "bench.json"),
            "--training-command", "accelerate launch trainers/train_drafter.py --config sweep_baseline.yaml",
            "--notes", str(tmp_path / "notes.md"),
            "--card-copy", str(copy),
        ]
    )  # fmt: skip
    assert not (out / "stale").exists() and (out / "modeling_adaflash.py").is_file()
    shipped = AdaFlashDrafter.from_pretrained(out)
    assert next(shipped.parameters()).dtype == torch.bfloat16
    expected = drafter.state_dict()
    for name, tensor in shipped.state_dict().items():
        torch.testing.assert_close(tensor, expected[name].to(torch.bfloat16), rtol=0, atol=0, msg=name)
    card = ModelCard((out / "README.md").read_text())
    assert card.data.base_model == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert "| method | domain | τ | speed-up | lossless |" in card.text and "bfloat16" in card.text
    assert "| adaflash_goodput | chat | 1.61 | 1.23 | True |" in card.text and "rounds" not in card.text
    assert "cpu: no amx_bf16, avx512_bf16, threads: 2" in card.text and "/home/me" not in card.text
    assert "sweep_baseline.yaml" in card.text and card.text.rstrip().endswith("152k blocks on 2 CPU cores.")
    assert copy.read_text() == (out / "README.md").read_text()


def test_a_folder_without_config_is_refused_and_the_shipped_drafter_stays(
    tmp_path, target_factory, drafter_factory
):
    out = tmp_path / "drafters" / "tiny"
    drafter_factory(target_factory("llama")).save_pretrained(out)
    before = (out / "model.safetensors").read_bytes()
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"checkpoint: expected a drafter folder with config.json"):
        _ship_module().main([str(tmp_path / "empty"), "--out", str(out), "--card-copy", ""])
    assert (out / "model.safetensors").read_bytes() == before


def _curve(points, **meta):
    return {
        "meta": meta,
        "points": [
            {
                "blocks_seen": b,
                "step": s,
                "metrics": {"chat": {"first_position": a}, "all": {"first_position": a}},
            }
            for b, s, a in points
        ],
    }


def test_the_run_curve_continues_the_shipped_one_and_a_bad_offset_ships_nothing(
    tmp_path, target_factory, drafter_factory
):
    ship = _ship_module()
    shipped, run = tmp_path / "learning_curve.json", tmp_path / "run.json"
    shipped.write_text(json.dumps(_curve([(256, 1, 0.04), (382_606, 1778, 0.32)], title="t")))
    run.write_text(json.dumps(_curve([(237, 1, 0.30), (152_300, 700, 0.38)])))
    drafter_factory(target_factory("llama")).save_pretrained(tmp_path / "baseline")
    out = tmp_path / "drafters" / "tiny"
    common = ["--out", str(out), "--card-copy", "", "--curve", str(run), "--shipped-curve", str(shipped)]
    with pytest.raises(
        ValueError, match=r"curve_offset: expected the run to start after .*382606 blocks\), got 1000"
    ):
        ship.main([str(tmp_path / "baseline"), *common, "--curve-offset", "1000"])
    assert not out.exists()  # refused before anything was shipped
    for _ in range(2):  # shipping the same run twice replaces its points, it does not add them again
        ship.main([str(tmp_path / "baseline"), *common, "--curve-offset", "387403"])
    data = json.loads(shipped.read_text())
    assert [p["blocks_seen"] for p in data["points"]] == [256, 382_606, 387_640, 539_703]
    assert [p.get("stage") for p in data["points"]] == [None, None, "baseline", "baseline"]
    assert data["meta"]["title"] == "t" and data["meta"]["stages"]["baseline"]["offset_blocks"] == 387_403
    assert shipped.with_suffix(".png").stat().st_size > 0


def test_a_checkpoint_ships_its_runs_points_up_to_its_step_and_a_later_one_replaces_them(
    tmp_path, target_factory, drafter_factory
):
    ship = _ship_module()
    shipped, run = tmp_path / "learning_curve.json", tmp_path / "run.json"
    shipped.write_text(json.dumps(_curve([(382_606, 1778, 0.32)])))
    run.write_text(json.dumps(_curve([(237, 1, 0.30), (87_000, 400, 0.33), (174_000, 800, 0.36)])))
    drafter = drafter_factory(target_factory("llama"))
    for step in (400, 800):
        drafter.save_pretrained(tmp_path / "long_run" / f"checkpoint-{step}")
        (tmp_path / "long_run" / f"checkpoint-{step}" / "trainer_state.json").write_text(
            json.dumps({"global_step": step})
        )
    common = [
        "--out",
        str(tmp_path / "out"),
        "--card-copy",
        "",
        "--curve",
        str(run),
        "--shipped-curve",
        str(shipped),
    ]
    ship.main([str(tmp_path / "long_run" / "checkpoint-400"), *common, "--curve-offset", "539703"])
    points = json.loads(shipped.read_text())["points"]
    assert [(p["step"], p.get("stage")) for p in points] == [(1778, None), (1, "long_run"), (400, "long_run")]
    ship.main([str(tmp_path / "long_run" / "checkpoint-800"), *common, "--curve-offset", "539703"])
    assert [p["step"] for p in json.loads(shipped.read_text())["points"]] == [1778, 1, 400, 800]
    run.write_text(json.dumps(_curve([(237_000, 900, 0.4)])))
    with pytest.raises(
        ValueError, match=r"curve: expected held-out points up to step 800 in .*run.json, got none"
    ):
        ship.main([str(tmp_path / "long_run" / "checkpoint-800"), *common, "--curve-offset", "539703"])
