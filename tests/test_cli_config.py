"""``--config FILE`` values go through the command line's own checks, and every command turns an error in its input
into one line ``adaflash <command>: error: ...`` with exit status 1 (``ADAFLASH_DEBUG=1``: the traceback)."""

import importlib
import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from adaflash_hf import AdaFlashDrafter, cli
from adaflash_hf.launch import parse_args_with_config
from adaflash_hf.trainers import corpus

SHIPPED = Path(__file__).resolve().parents[1] / "examples" / "drafters" / "smollm2-135m-adaflash"


def _subcommand(name):
    return lambda: cli.make_parser().commands[name]


def _module_parser(module):
    return lambda: importlib.import_module(module).make_parser()


# command -> (its parser, the positional arguments it needs, a flag, an int option); every command taking --config
CONFIG_COMMANDS = {
    "export": (_subcommand("export"), ["PATH", "OUT"], "overwrite", None),
    "import": (_subcommand("import"), ["PATH", "OUT"], "overwrite", None),
    "publish": (_subcommand("publish"), ["PATH", "org/name"], "dry_run", None),
    "bench generate": (_module_parser("adaflash_hf.bench.generate"), [], "quick", "repeats"),
    "bench serve": (_module_parser("adaflash_hf.bench.serve"), [], "quick", "repeats"),
    "bench kernels": (_module_parser("adaflash_hf.bench.kernels"), [], None, "repeats"),
    "bench train": (_module_parser("adaflash_hf.bench.train"), [], "quick", "steps"),
    "corpus": (_module_parser("adaflash_hf.trainers.corpus"), [], "rebuild", "max_new_tokens"),
    "calibrate-head": (
        _module_parser("adaflash_hf.trainers.calibrate_head"),
        ["--drafter", "D", "--output-dir", "O"],
        "reinit_head",
        "steps",
    ),
}
FLAG_COMMANDS = [name for name, entry in CONFIG_COMMANDS.items() if entry[2]]
INT_COMMANDS = [name for name, entry in CONFIG_COMMANDS.items() if entry[3]]


def _yaml(tmp_path, text: str, name: str = "c.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def _parse(command: str, config: Path, *extra: str):
    make_parser, positionals, _, _ = CONFIG_COMMANDS[command]
    return parse_args_with_config(make_parser(), [*positionals, "--config", str(config), *extra])


def _one_error_line(capsys, command: str) -> str:
    # stderr may also hold progress bars (loading weights); the error is its last line, and the only one
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1].startswith(f"adaflash {command}: error: "), lines
    assert not any(line.startswith(("adaflash", "Traceback")) for line in lines[:-1]), lines
    return lines[-1]


@pytest.fixture
def drafter_folder(target_factory, drafter_factory, tmp_path):
    drafter_factory(target_factory("qwen3")).save_pretrained(tmp_path / "drafter")
    return tmp_path / "drafter"


@pytest.fixture
def full_out(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    return out


# ------------------------------------------------------------------------------------------------ flags (destructive)
@pytest.mark.parametrize("value", ['"false"', '"False"', '"yes please"', '"true"', "1", "0"])
def test_a_non_boolean_overwrite_in_a_config_is_refused_and_the_full_out_folder_survives(
    drafter_folder, full_out, tmp_path, capsys, value
):
    config = _yaml(tmp_path, f"overwrite: {value}\n", "o.yaml")
    assert cli.main(["export", "--config", str(config), str(drafter_folder), str(full_out)]) == 1
    line = _one_error_line(capsys, "export")
    assert f"--config {config}: overwrite: expected true or false (the flag --overwrite), got" in line
    assert sorted(p.name for p in full_out.iterdir()) == ["keep.txt"]
    assert (full_out / "keep.txt").read_text() == "precious"


def test_a_yaml_false_overwrite_keeps_the_full_out_folder(drafter_folder, full_out, tmp_path, capsys):
    config = _yaml(tmp_path, "overwrite: false\n", "o.yaml")
    assert cli.main(["export", "--config", str(config), str(drafter_folder), str(full_out)]) == 1
    assert "expected a new or empty folder (or --overwrite)" in _one_error_line(capsys, "export")
    assert sorted(p.name for p in full_out.iterdir()) == ["keep.txt"]


@pytest.mark.parametrize("command", FLAG_COMMANDS)
def test_every_config_command_refuses_a_string_for_a_flag(tmp_path, command):
    flag = CONFIG_COMMANDS[command][2]
    config = _yaml(tmp_path, f'{flag}: "false"\n')
    option = "--" + flag.replace("_", "-")
    with pytest.raises(
        ValueError, match=rf"c.yaml: {flag}: expected true or false \(the flag {option}\), got 'false'"
    ):
        _parse(command, config)


@pytest.mark.parametrize("command", FLAG_COMMANDS)
def test_every_config_command_takes_yaml_booleans_for_a_flag(tmp_path, command):
    flag = CONFIG_COMMANDS[command][2]
    assert getattr(_parse(command, _yaml(tmp_path, f"{flag}: true\n")), flag) is True
    assert getattr(_parse(command, _yaml(tmp_path, f"{flag}: false\n")), flag) is False


# -------------------------------------------------------------------------------------------- types, choices, nargs
def _config_example(help_text: str) -> str:
    """The example key of a --config help text."""
    match = re.search(
        r"YAML file of this command's options \(keys: option names, e\.g\. (\w+)\)",
        " ".join(help_text.split()),
    )
    assert match, help_text
    return match[1]


def _option_names(parser) -> set[str]:
    return {a.dest for a in parser._actions if a.option_strings}


@pytest.mark.parametrize("command", list(CONFIG_COMMANDS))
def test_every_config_commands_help_names_one_of_its_own_options(capsys, command):
    make_parser, positionals, _, _ = CONFIG_COMMANDS[command]
    with pytest.raises(SystemExit):
        cli.main([*command.split(), *positionals, "--help"])
    assert _config_example(capsys.readouterr().out) in _option_names(make_parser()) - {"config"}


@pytest.mark.parametrize("script", ["train_drafter", "opd"])
def test_the_trainer_scripts_config_help_names_one_of_their_own_options(script):
    parser = importlib.import_module(f"adaflash_hf.trainers.{script}").make_parser()
    assert _config_example(parser.format_help()) in _option_names(parser) - {"config"}


@pytest.mark.parametrize("command", INT_COMMANDS)
def test_every_config_command_converts_values_with_the_option_type(tmp_path, command):
    name = CONFIG_COMMANDS[command][3]
    option = "--" + name.replace("_", "-")
    assert getattr(_parse(command, _yaml(tmp_path, f'{name}: "7"\n')), name) == 7
    for bad in ("seven", "7.5", "true"):
        expected = r"(int|an int >= \d+)"  # a count's type names its lower bound
        with pytest.raises(
            ValueError, match=rf"c.yaml: {name}: expected {expected} \(as {option} takes\), got"
        ):
            _parse(command, _yaml(tmp_path, f"{name}: {bad}\n"))


def test_the_command_line_still_wins_over_the_config_file(tmp_path):
    args = _parse("bench train", _yaml(tmp_path, "steps: 7\nthreads: 3\n"), "--steps", "2")
    assert (args.steps, args.threads) == (2, 3)


def test_corpus_config_choices_are_checked_before_anything_loads(tmp_path):
    config = _yaml(tmp_path, "layer_ids: 5\nsplit: bogus\n")
    with pytest.raises(
        ValueError,
        match=r"c.yaml: split: expected one of 'train', 'heldout' \(as --split takes\), got 'bogus'",
    ):
        corpus.main(["--config", str(config)])


def test_a_single_config_value_for_a_list_option_is_a_one_item_list_as_on_the_command_line(tmp_path):
    assert _parse("corpus", _yaml(tmp_path, "layer_ids: 5\n")).layer_ids == [5]
    assert _parse("corpus", _yaml(tmp_path, "layer_ids: [1, 14]\n")).layer_ids == [1, 14]
    with pytest.raises(
        ValueError, match=r"c.yaml: layer_ids: expected int \(as --layer-ids takes\), got \[1, 'x'\]"
    ):
        corpus.main(["--config", str(_yaml(tmp_path, "layer_ids: [1, x]\n"))])


def test_a_list_for_a_single_value_option_is_refused(tmp_path):
    with pytest.raises(
        ValueError, match=r"c.yaml: split: expected one value \(as --split takes\), got the list"
    ):
        _parse("corpus", _yaml(tmp_path, "split: [train, heldout]\n"))


def test_a_repeatable_option_on_the_command_line_replaces_the_config_list(tmp_path):
    config = _yaml(tmp_path, "tag: [a, b]\n")
    assert _parse("publish", config).tag == ["a", "b"]
    assert _parse("publish", config, "--tag", "c").tag == ["c"]


def test_null_in_a_config_leaves_the_default(tmp_path):
    assert _parse("calibrate-head", _yaml(tmp_path, "max_sequences: null\nsteps: 9\n")).max_sequences is None


def test_a_config_file_can_supply_a_required_option(tmp_path):
    config = _yaml(tmp_path, "drafter: d\noutput_dir: o\n")
    args = parse_args_with_config(
        _module_parser("adaflash_hf.trainers.calibrate_head")(), ["--config", str(config)]
    )
    assert (args.drafter, args.output_dir) == ("d", "o")


def test_a_number_for_a_path_option_is_the_string_the_command_line_would_pass(
    drafter_folder, tmp_path, capsys
):
    config = _yaml(tmp_path, "target_config: 12\n")
    assert cli.main(["export", str(drafter_folder), str(tmp_path / "new"), "--config", str(config)]) == 1
    assert "target config: expected a config.json file, a model folder or a cached Hub repo id, got '12'" in (
        _one_error_line(capsys, "export")
    )
    assert not (tmp_path / "new").exists()


# ------------------------------------------------------------------------------------------------- the file itself
def test_a_config_with_a_yaml_syntax_error_names_the_file_and_the_line(drafter_folder, tmp_path, capsys):
    config = _yaml(tmp_path, "format: dflash\nsteps: [1\n", "broken.yaml")
    assert cli.main(["export", str(drafter_folder), str(tmp_path / "new"), "--config", str(config)]) == 1
    line = _one_error_line(capsys, "export")
    assert f"--config {config}: expected valid YAML, got" in line and "at line 3, column 1" in line


def test_a_missing_config_file_is_named(tmp_path, capsys):
    assert cli.main(["corpus", "--config", str(tmp_path / "nope.yaml")]) == 1
    assert f"--config: expected an existing YAML file, got '{tmp_path / 'nope.yaml'}'" in (
        _one_error_line(capsys, "corpus")
    )


def test_corpus_config_errors_are_one_line_from_the_cli(tmp_path, capsys):
    assert cli.main(["corpus", "--config", str(_yaml(tmp_path, "split: bogus\n"))]) == 1
    assert "c.yaml: split: expected one of 'train', 'heldout'" in _one_error_line(capsys, "corpus")


# --------------------------------------------------------------------------------------------- one-line errors
def test_an_input_error_of_any_command_is_one_line_with_exit_status_1(capsys, tmp_path):
    assert cli.main(["corpus", "--chat", "-1"]) == 1
    assert "--chat: expected a count >= 0, got -1" in _one_error_line(capsys, "corpus")
    assert cli.main(["bench", "train", "--config", str(_yaml(tmp_path, "stepz: 1\n"))]) == 1
    assert "did you mean 'steps'?" in _one_error_line(capsys, "bench train")


def test_adaflash_debug_shows_the_traceback(monkeypatch):
    monkeypatch.setenv("ADAFLASH_DEBUG", "1")
    with pytest.raises(ValueError, match=r"--chat: expected a count >= 0, got -1"):
        cli.main(["corpus", "--chat", "-1"])


def test_a_bug_keeps_its_traceback(monkeypatch):
    from adaflash_hf.bench import kernels

    def main(argv):
        return {}["a key the code forgot"]

    monkeypatch.setattr(kernels, "main", main)
    with pytest.raises(KeyError):
        cli.main(["bench", "kernels"])


def test_the_console_script_prints_one_line_and_no_traceback():
    script = Path(sys.executable).with_name("adaflash")
    result = subprocess.run(
        [str(script), "corpus", "--chat", "-1"], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        "adaflash corpus: error: --chat: expected a count >= 0, got -1"
    ]


def test_publish_without_the_hub_says_it_is_unreachable_and_points_to_dry_run(drafter_folder, capsys):
    assert cli.main(["publish", str(drafter_folder), "me/test-drafter"]) == 1
    line = _one_error_line(capsys, "publish")
    assert "the Hub is unreachable, nothing was uploaded to me/test-drafter (OfflineModeIsEnabled" in line
    assert "--dry-run (dry_run=True) stages the drafter and lists what would be uploaded" in line


# ---------------------------------------------------------------------------------------------------- trainers
def test_the_trainer_script_help_runs_without_accelerate(capsys):
    assert cli.main(["train", "--dry-run", "--", "--help"]) == 0
    command = capsys.readouterr().out.split()
    assert command[0] == sys.executable and "accelerate.commands.launch" not in command
    assert command[1].endswith("train_drafter.py") and command[2:] == ["--help"]


# ------------------------------------------------------------------------------------------------ strict loading
@pytest.mark.parametrize("change", ["extra", "missing"])
def test_a_strict_load_error_comes_without_transformers_load_report(
    drafter_folder, caplog, monkeypatch, change
):
    weights = load_file(drafter_folder / "model.safetensors")
    if change == "extra":
        weights["extra.weight"] = torch.zeros(2)
    else:
        del weights["norm.weight"]
    save_file(weights, drafter_folder / "model.safetensors", metadata={"format": "pt"})
    monkeypatch.setattr(logging.getLogger("transformers"), "propagate", True)  # to caplog's root handler
    with (
        caplog.at_level(logging.WARNING),
        pytest.raises(ValueError, match=r"unexpected keys \['extra.weight'\]|missing keys \['norm.weight'\]"),
    ):
        AdaFlashDrafter.from_pretrained(drafter_folder)
    assert not [r.getMessage() for r in caplog.records if "LOAD REPORT" in r.getMessage()]


def test_publish_with_the_hub_down_not_offline_says_it_is_unreachable(drafter_folder, capsys, monkeypatch):
    # Not offline mode: a real connection to a port nothing listens on, refused at once (the HTTP client's own error).
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setenv("HF_TOKEN", "hf_not_a_real_token")
    assert cli.main(["publish", str(drafter_folder), "me/test-drafter"]) == 1
    line = _one_error_line(capsys, "publish")
    assert "the Hub is unreachable, nothing was uploaded to me/test-drafter" in line and "--dry-run" in line


def test_a_config_count_below_its_bound_is_refused_as_on_the_command_line(tmp_path):
    with pytest.raises(
        ValueError, match=r"c.yaml: repeats: expected an int >= 1 \(as --repeats takes\), got 0"
    ):
        _parse("bench generate", _yaml(tmp_path, "repeats: 0\n"))
