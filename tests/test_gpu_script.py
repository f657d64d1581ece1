"""examples/gpu/train_drafter.sh on its CPU dry path (DEVICE=cpu): a tiny target, corpus and starting drafter, a time
budget that stops the first run after one step, and a second run of the same command that resumes to max_steps."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import tiny_script_inputs

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "gpu" / "train_drafter.sh"


@pytest.fixture
def tiny_setup(target_factory, drafter_factory, tmp_path):
    target = target_factory("llama")
    tiny_script_inputs(target, tmp_path)
    # The "shipped drafter" the first run starts from: one layer, a draft vocabulary of 64 ids.
    drafter_factory(target, num_hidden_layers=1, draft_token_ids=list(range(0, 512, 8))).save_pretrained(
        tmp_path / "drafter"
    )
    return tmp_path


def run_script(tmp_path, budget):
    env = {
        **os.environ,
        "DEVICE": "cpu",
        "PYTHON": sys.executable,
        "OUTPUT_DIR": str(tmp_path / "out"),
        "TIME_BUDGET": budget,
        "DRAFTER_INIT": str(tmp_path / "drafter"),
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "OUT": "",
    }
    tiny = [
        "--target_model", str(tmp_path / "target"), "--corpus_dir", str(tmp_path / "corpus"), "--domains", "math",
        "--heldout_corpus_dir", "", "--draft_vocab_size", "64", "--max_steps", "3", "--save_steps", "100",
        "--per_device_train_batch_size", "2", "--num_anchors", "4", "--logging_steps", "1", "--disable_tqdm", "true",
    ]  # fmt: skip
    result = subprocess.run(
        ["bash", str(SCRIPT), *tiny], capture_output=True, text=True, timeout=300, env=env
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def test_the_gpu_script_stops_at_its_time_budget_and_the_same_command_resumes(tiny_setup):
    tmp_path = tiny_setup
    first = run_script(tmp_path, budget="1e-9")  # spent after the first step
    assert "resume_from_checkpoint last: no complete checkpoint, a fresh start" in first.stderr
    assert sorted(p.name for p in (tmp_path / "out").glob("checkpoint-*")) == ["checkpoint-1"]
    assert json.loads(first.stdout.strip().splitlines()[-1])["global_step"] == 1

    second = run_script(tmp_path, budget="600")
    assert f"resume_from_checkpoint last: {tmp_path / 'out' / 'checkpoint-1'}" in second.stderr
    reached = json.loads((tmp_path / "out" / "reached.json").read_text())
    assert reached["global_step"] == 3 and reached["blocks_seen"] > 0
    state = json.loads((tmp_path / "out" / "checkpoint-3" / "trainer_state.json").read_text())
    assert [e["step"] for e in state["log_history"] if "loss" in e] == [1, 2, 3]  # one history, continued
    assert (tmp_path / "out" / "model.safetensors").is_file()
