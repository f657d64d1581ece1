"""`adaflash calibrate-head`: only the length head learns, from realised acceptance, and it learns it; its figures
are scored on a held-out part of the sequences (at least one, even of fewer than one split period) or labelled as
the fit set's when nothing is held out; and bad settings and inputs are refused, naming the option, before anything
loads."""

import json
from pathlib import Path

import pytest
import torch

from adaflash_hf import cli
from adaflash_hf.trainers.calibrate_head import (
    calibrate_length_head,
    collect_blocks,
    head_figures,
    main,
    make_parser,
    summary_line,
)
from tests.conftest import drafts_one_token, features_of

REPO = Path(__file__).resolve().parents[1]
SHIPPED = REPO / "examples" / "drafters" / "smollm2-135m-adaflash"
BLOCK = 4


def _records(token: int, count: int = 8) -> list[dict]:
    """Answers of runs: after anchor 7 come `token`s (blocks accepted in full), after anchor 9 other tokens (none)."""
    other = (token + 5) % 200 + 20
    records = []
    for i in range(count):
        prompt = [3, 4 + i, 5]
        response = ([7] + [token] * 5 + [9] + [other] * 5) * 3
        records.append({"id": f"r{i}", "domain": "chat", "input_ids": prompt + response, "prompt_length": 3})
    return records


@pytest.fixture
def setup(target_factory, drafter_factory):
    target = target_factory("llama")
    drafter = drafter_factory(target, block_size=BLOCK)
    token = drafts_one_token(drafter, target)
    records = _records(token)
    layer_ids = drafter.config.target_layer_ids
    with torch.no_grad():
        features = [features_of(target, r, layer_ids) for r in records]
    return target, drafter, records, features


def test_calibration_fits_the_head_alone_and_lowers_its_error(setup):
    target, drafter, records, features = setup
    drafter.reset_length_head(seed=1)
    head_names = {f"{name}" for name in drafter.length_head_parameter_names()}
    before = {n: p.detach().clone() for n, p in drafter.named_parameters()}
    realised = torch.cat([r for _, r in collect_blocks(drafter, target, records, features)])
    assert 0.2 < float((realised == 1).float().mean()) < 0.8  # both full and rejected blocks

    report = calibrate_length_head(drafter, records, features, target, steps=300, learning_rate=3e-3)

    for name, param in drafter.named_parameters():
        if name in head_names:
            continue
        assert torch.equal(param, before[name]), f"{name} changed: only the length head may learn"
    assert any(not torch.equal(p, before[n]) for n, p in drafter.named_parameters() if n in head_names)
    assert report["sequences"] == {"fit": 6, "held_out": 2}
    assert report["after"]["head_mae"] < 0.5 * report["before"]["head_mae"]
    # Better than the best constant (the median a*): the head reads the block, not just the average.
    median_error = (realised - realised.median()).abs().mean()
    assert report["after"]["head_mae"] < median_error
    # k̂ follows the acceptance: more of what the adaptive length verifies is accepted than with the fresh head.
    assert report["after"]["acceptance_of_verified"] > report["before"]["acceptance_of_verified"]
    assert report["loss"][-1] < report["loss"][0]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"holdout_fraction": 1.0}, r"holdout_fraction: expected 0 <= value < 1, got 1.0"),
        ({"steps": 0}, r"steps: expected >= 1, got 0"),
    ],
)
def test_bad_settings_are_named_before_any_forward(setup, kwargs, message):
    target, drafter, records, features = setup
    calls = []
    handle = drafter.register_forward_pre_hook(lambda *a: calls.append(1))
    with pytest.raises(ValueError, match=message):
        calibrate_length_head(drafter, records, features, target, **kwargs)
    handle.remove()
    assert not calls


def test_answers_shorter_than_a_block_are_refused(setup):
    target, drafter, records, features = setup
    short = [{**records[0], "input_ids": records[0]["input_ids"][:5]}]
    with pytest.raises(ValueError, match=r"records: expected at least one answer of 4 tokens or more"):
        calibrate_length_head(drafter, short, [features[0][:4]], target)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--domains", "bogus"], "argument --domains: invalid choice: 'bogus'"),
        (["--steps", "0"], "argument --steps: expected an int >= 1, got 0"),
        (["--learning-rate", "-1"], "argument --learning-rate: expected a number > 0, got -1"),
    ],
)
def test_bad_options_are_usage_errors_before_anything_loads(tmp_path, capsys, flags, message):
    # the drafter folder does not exist: loading anything would fail with another error
    with pytest.raises(SystemExit) as exit_info:
        main(["--drafter", str(tmp_path / "missing"), "--output-dir", str(tmp_path), *flags])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_cli_calibrates_the_shipped_drafter_on_the_offline_target(tmp_path):
    """Integration: the real target answers 2 prompts per domain, the shipped drafter's re-initialised head is fitted
    on its realised acceptance, and the calibrated drafter is saved and loads."""
    from adaflash_hf.bench.targets import DEFAULT_DRAFTER
    from adaflash_hf.modeling import AdaFlashDrafter

    report = main(
        [
            "--drafter", str(DEFAULT_DRAFTER), "--output-dir", str(tmp_path), "--domains", "math",
            "--prompts-per-domain", "2", "--max-new-tokens", "32", "--steps", "50", "--reinit-head",
            "--threads", "1",
        ]
    )  # fmt: skip
    saved = json.loads((tmp_path / "calibration.json").read_text())
    assert saved["blocks"]["fit"] > 0 and saved["after"]["head_mae"] < saved["before"]["head_mae"]
    assert set(saved["references"]) == {"loaded_head"}  # the shipped head, scored on the same held-out blocks
    reloaded = AdaFlashDrafter.from_pretrained(report["drafter"])
    fitted = dict(reloaded.named_parameters())
    for name in reloaded.length_head_parameter_names():
        assert torch.isfinite(fitted[name]).all()


# ------------------------------------------------------------------------------------------ the held-out part
def _two_cycle_records(token: int, count: int) -> list[dict]:
    """Answers whose blocks after anchor 7 are accepted in full and after anchor 9 not at all."""
    response = ([7] + [token] * 5 + [9] + [(token + 5) % 200 + 20] * 5) * 2
    return [
        {"id": f"r{i}", "domain": "chat", "input_ids": [3, 4 + i, 5] + response, "prompt_length": 3}
        for i in range(count)
    ]


@pytest.fixture
def calibration(target_factory, drafter_factory):
    target = target_factory("llama")
    drafter = drafter_factory(target, block_size=BLOCK)
    token = drafts_one_token(drafter, target)

    def records_and_features(count: int):
        records = _two_cycle_records(token, count)
        with torch.no_grad():
            features = [features_of(target, r, drafter.config.target_layer_ids) for r in records]
        return records, features

    return target, drafter, records_and_features


def test_calibration_with_fewer_sequences_than_one_split_period_still_holds_one_out(calibration):
    target, drafter, records_and_features = calibration
    records, features = records_and_features(2)  # holdout_fraction 0.25 holds out every 4th: none of 2 before
    report = calibrate_length_head(drafter, records, features, target, steps=3)
    assert report["scored_on"] == "held_out"
    assert report["sequences"] == {"fit": 1, "held_out": 1}
    # the "after" figures are those of the held-out record's blocks, not of the blocks the head was fitted on
    (states, realised) = collect_blocks(drafter, target, records[1:], features[1:])[0]
    assert report["after"] == head_figures(drafter, states, realised)
    assert summary_line(report).startswith("held-out |â - a*|")


def test_calibration_of_a_single_sequence_with_a_holdout_is_refused(calibration):
    target, drafter, records_and_features = calibration
    records, features = records_and_features(1)
    with pytest.raises(
        ValueError,
        match=r"records with a full block \(4 tokens\): expected at least 2 sequences to hold one out",
    ):
        calibrate_length_head(drafter, records, features, target, steps=3)


def test_calibration_without_a_holdout_labels_its_figures_as_the_fit_set(calibration):
    target, drafter, records_and_features = calibration
    records, features = records_and_features(1)
    report = calibrate_length_head(drafter, records, features, target, steps=3, holdout_fraction=0.0)
    assert report["scored_on"] == "fit" and report["sequences"] == {"fit": 1, "held_out": 0}
    assert summary_line(report).startswith("fit-set (nothing held out) |â - a*|")


def test_calibrate_cli_refuses_a_split_with_no_held_out_part_before_loading(tmp_path):
    argv = ["--drafter", str(SHIPPED), "--output-dir", str(tmp_path), "--domains", "chat"]
    with pytest.raises(
        ValueError, match=r"--prompts-per-domain 1 x 1 domain\(s\): expected at least 2 sequences"
    ):
        main([*argv, "--prompts-per-domain", "1"])
    assert not any(tmp_path.iterdir())


# -------------------------------------------------------------------------------------- calibrate-head inputs
def test_calibrate_corpus_dir_without_features_dir_is_refused_before_loading(tmp_path, capsys):
    corpus = REPO / "examples" / "corpus" / "smollm2"
    argv = [
        "calibrate-head",
        "--drafter",
        str(SHIPPED),
        "--output-dir",
        str(tmp_path),
        "--corpus-dir",
        str(corpus),
    ]
    assert cli.main(argv) == 1
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "adaflash calibrate-head: error: --features-dir: expected the features of --corpus-dir "
        "(adaflash corpus --features-dir), got none"
    )


def test_calibrate_help_says_when_features_dir_is_required():
    assert "required with --corpus-dir" in " ".join(make_parser().format_help().split())


def test_calibrate_head_with_a_missing_drafter_says_no_such_folder(tmp_path, capsys):
    missing = tmp_path / "no-drafter"
    assert cli.main(["calibrate-head", "--drafter", str(missing), "--output-dir", str(tmp_path / "out")]) == 1
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith(
        "adaflash calibrate-head: error: pretrained_model_name_or_path: expected an existing"
    )
    assert f"got '{missing}', which does not exist" in line and "Repo id" not in line
