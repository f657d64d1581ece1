"""What a newcomer meets first: errors that name the field or option, what was expected and what was given, raised
before any heavy work, and figures labelled for what they are (issue 25)."""

import json
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models
from transformers import PreTrainedTokenizerFast

import adaflash_hf
from adaflash_hf import AdaFlashConfig, AdaFlashDrafter, cli
from adaflash_hf.trainers.calibrate_head import (
    calibrate_length_head,
    collect_blocks,
    head_figures,
    main,
    make_parser,
    summary_line,
)
from tests.test_learning_curve import drafts_one_token, features_of

REPO = Path(__file__).resolve().parents[1]
SHIPPED = REPO / "examples" / "drafters" / "smollm2-135m-adaflash"
BLOCK = 4


# --------------------------------------------------------------------------------------- calibration's held-out part
def _records(token: int, count: int) -> list[dict]:
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
        records = _records(token, count)
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


# ------------------------------------------------------------------------------------------ calibrate-head inputs
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


# ------------------------------------------------------------------------------------------ loading a missing folder
@pytest.mark.parametrize("name", ["absolute", "path object", "./relative", "a/b/c"])
def test_from_pretrained_of_a_missing_folder_says_no_such_folder(tmp_path, name):
    path = {"absolute": str(tmp_path / "nope"), "path object": tmp_path / "nope"}.get(name, name)
    with pytest.raises(FileNotFoundError, match=rf"got '{path}', which does not exist"):
        AdaFlashDrafter.from_pretrained(path)
    with pytest.raises(FileNotFoundError, match=rf"got '{path}', which does not exist"):
        AdaFlashConfig.from_pretrained(path)


# ------------------------------------------------------------------------------------------ config types at load
@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("block_size", 16.5, r"block_size: expected int, got 16\.5 \(float\)"),
        ("block_size", "16", r"block_size: expected int, got '16' \(str\)"),
        ("block_size", True, r"block_size: expected int, got True \(bool\)"),
        ("hidden_size", 64.0, r"hidden_size: expected int, got 64\.0 \(float\)"),
        ("learned_mask_embedding", 1, r"learned_mask_embedding: expected bool, got 1 \(int\)"),
        ("length_head_gamma", "1.0", r"length_head_gamma: expected float, got '1\.0' \(str\)"),
        ("target_layer_ids", [1, 2.0], r"target_layer_ids: expected list\[int\] \| None, got \[1, 2\.0\]"),
    ],
)
def test_a_drafter_config_of_the_wrong_type_fails_at_load_naming_the_field(
    target_factory, drafter_factory, tmp_path, field, value, message
):
    drafter_factory(target_factory("qwen3")).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, field: value}))
    with pytest.raises(ValueError, match=message):
        AdaFlashDrafter.from_pretrained(tmp_path)


def test_an_int_is_a_valid_float_field(target_factory):
    config = AdaFlashConfig.for_target(target_factory("qwen3").config, length_head_gamma=1, mask_token_id=3)
    assert config.length_head_gamma == 1


# ------------------------------------------------------------------------------------------------------- dtypes
def test_a_drafter_in_another_dtype_than_its_inputs_says_to_load_it_in_the_target_dtype(
    target_factory, drafter_factory
):
    target = target_factory("qwen3")
    drafter = drafter_factory(target).to(torch.bfloat16)
    ids = torch.tensor([[3, 4, 5, 6]])
    adaflash_hf.disable()  # transformers' native DFlash path, as remote code without adaflash_hf runs it
    try:
        with pytest.raises(
            TypeError,
            match=r"noise_embeds: expected the drafter's dtype torch.bfloat16, got torch.float32; load the drafter "
            r"in the target's dtype with from_pretrained\(\.\.\., dtype=target.dtype\), or call drafter.to",
        ):
            target.generate(ids, assistant_model=drafter, speculation_type="dflash", max_new_tokens=4)
    finally:
        adaflash_hf.enable()


def test_a_drafter_in_another_dtype_runs_under_autocast(target_factory, drafter_factory):
    drafter = drafter_factory(target_factory("qwen3")).to(torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = drafter(noise_embeds=torch.randn(1, 16, 64), context_hidden_states=torch.randn(1, 3, 128))
    assert out.last_hidden_state.shape == (1, 16, 64)


@pytest.mark.parametrize(
    "card", ["adaflash_hf/templates/model_card.md", "examples/drafters/smollm2-135m-adaflash/README.md"]
)
def test_the_model_card_says_to_load_the_drafter_in_the_target_dtype_for_the_native_path(card):
    text = " ".join((REPO / card).read_text().split())
    assert (
        "Load it in the target's dtype (`dtype=target.dtype` as above, or `drafter.to(target.dtype)`)" in text
    )


# ---------------------------------------------------------------------------------------------------- check_target
def test_check_target_of_a_tokenizer_says_it_expects_the_target_model(target_factory, drafter_factory):
    drafter = drafter_factory(target_factory("qwen3"))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    )
    with pytest.raises(
        TypeError, match=rf"target: expected the target model .*got a {type(tokenizer).__name__}$"
    ):
        drafter.check_target(tokenizer)
