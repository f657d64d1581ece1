"""The ``adaflash`` command line: --help for every subcommand, export/import/publish end to end, dispatch of bench
modules and accelerate-launched trainer scripts, and 'not available' for parts this installation lacks."""

import ast
import importlib.machinery
import os
import subprocess
import sys
import types
from importlib.metadata import entry_points
from pathlib import Path
from unittest.mock import create_autospec

import pytest
import torch
from huggingface_hub import HfApi

from adaflash_hf import AdaFlashDrafter, cli


def _help(capsys, *argv) -> str:
    with pytest.raises(SystemExit) as exit_info:
        cli.main([*argv, "--help"])
    assert exit_info.value.code == 0
    return capsys.readouterr().out


@pytest.fixture
def drafter_folder(target_factory, drafter_factory, tmp_path):
    drafter = drafter_factory(target_factory("qwen3"))
    drafter.save_pretrained(tmp_path / "drafter")
    return drafter, tmp_path / "drafter"


@pytest.fixture
def fake_bench(monkeypatch):
    """Install a stand-in ``adaflash_hf.bench.generate`` module whose main records its argv."""
    calls = []
    module = types.ModuleType("adaflash_hf.bench.generate")
    module.__spec__ = importlib.machinery.ModuleSpec("adaflash_hf.bench.generate", loader=None)

    def main(argv=None):
        calls.append((list(argv), list(sys.argv)))
        return 0

    module.main = main
    package = types.ModuleType("adaflash_hf.bench")
    package.__spec__ = importlib.machinery.ModuleSpec("adaflash_hf.bench", loader=None, is_package=True)
    package.__path__ = []
    monkeypatch.setitem(sys.modules, "adaflash_hf.bench", package)
    monkeypatch.setitem(sys.modules, "adaflash_hf.bench.generate", module)
    return calls


def test_top_level_help_lists_every_subcommand(capsys):
    text = _help(capsys)
    for command in ("export", "import", "publish", "bench", "train", "opd"):
        assert command in text


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["export"], "--format {dflash,adaflash-official}"),
        (["import"], "--target-config"),
        (["publish"], "--bench-json"),
        (["bench"], "BENCHMARK"),
        (["train"], "--accelerate-config"),
        (["opd"], "--num-processes"),
    ],
)
def test_each_subcommand_has_help(capsys, argv, expected):
    assert expected in _help(capsys, *argv)


def test_export_then_import_round_trips(drafter_folder, tmp_path, capsys):
    drafter, folder = drafter_folder
    assert cli.main(["export", "--format", "dflash", str(folder), str(tmp_path / "dflash")]) == 0
    assert cli.main(["import", str(tmp_path / "dflash"), str(tmp_path / "ours")]) == 0
    assert "wrote AdaFlash checkpoint" in capsys.readouterr().out
    imported = AdaFlashDrafter.from_pretrained(tmp_path / "ours")
    assert all(torch.equal(imported.state_dict()[k], v) for k, v in drafter.state_dict().items())


def test_bad_input_exits_1_with_a_clear_message(drafter_folder, target_factory, tmp_path, capsys):
    _, folder = drafter_folder
    target_factory("qwen3", vocab_size=1024).config.save_pretrained(tmp_path / "target")
    argv = ["export", str(folder), str(tmp_path / "out"), "--target-config", str(tmp_path / "target")]
    assert cli.main(argv) == 1
    assert "adaflash export: error: vocab_size: expected the target's 1024, got 512" in (
        capsys.readouterr().err
    )
    assert cli.main(["import", str(tmp_path / "missing"), str(tmp_path / "out")]) == 1
    assert "expected an existing folder" in capsys.readouterr().err


def test_publish_dry_run_lists_the_files(drafter_folder, capsys):
    _, folder = drafter_folder
    assert cli.main(["publish", str(folder), "org/tiny", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "would upload to org/tiny@main in one commit" in out
    for name in ("README.md", "config.json", "model.safetensors", "modeling_adaflash.py"):
        assert name in out


def test_publish_passes_its_options_to_the_hub(drafter_folder, tmp_path, monkeypatch):
    _, folder = drafter_folder
    api = create_autospec(HfApi, instance=True)
    monkeypatch.setattr("adaflash_hf.hub.HfApi", lambda **kwargs: api)
    bench = tmp_path / "bench.json"
    bench.write_text('[{"method": "adaflash", "tau": 3.1}]')
    argv = ["publish", str(folder), "org/tiny", "--private", "--revision", "exp", "--bench-json", str(bench)]
    assert cli.main([*argv, "--dataset", "a/b", "--base-model", "Qwen/Qwen3-8B"]) == 0
    assert api.create_repo.call_args.kwargs["private"] is True
    assert api.create_branch.call_args.kwargs["branch"] == "exp"
    assert api.create_commit.call_args.kwargs["revision"] == "exp"


def test_bench_dispatches_to_the_module_main(fake_bench):
    assert cli.main(["bench", "generate", "--max-new-tokens", "8", "--help"]) == 0
    assert fake_bench == [
        (["--max-new-tokens", "8", "--help"], ["adaflash bench generate", "--max-new-tokens", "8", "--help"])
    ]


def test_missing_bench_module_is_not_available(monkeypatch, capsys):
    monkeypatch.setattr(cli, "module_available", lambda name: False)
    assert cli.main(["bench", "serve"]) == cli.UNAVAILABLE
    assert "adaflash bench serve: not available in this version" in capsys.readouterr().err


def test_train_launches_the_script_through_accelerate(monkeypatch, tmp_path):
    script = tmp_path / "train_drafter.py"
    script.write_text("")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "run.yaml").write_text("max_steps: 3\n")
    launched = []
    monkeypatch.setattr(cli, "trainer_script", lambda filename: script)
    monkeypatch.setattr(cli.subprocess, "call", lambda command, env: launched.append(command) or 0)
    argv = [
        "train",
        "--num-processes",
        "2",
        "--config",
        "run.yaml",
        "--accelerate-config=acc.yaml",
        "--",  # everything after it goes to the script, even an option of ours
        "--dry-run",
    ]
    assert cli.main(argv) == 0
    assert launched == [
        [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "--quiet",
            "--config_file",
            "acc.yaml",
            "--num_processes",
            "2",
        ]
        + [str(script), "--config", "run.yaml", "--dry-run"]
    ]


def test_train_dry_run_prints_the_command(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(cli, "trainer_script", lambda filename: tmp_path / filename)
    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # chosen: no thread option added (tested below)
    assert cli.main(["opd", "--dry-run", "--config", "opd.yaml"]) == 0
    assert (
        capsys.readouterr()
        .out.strip()
        .endswith(f"accelerate.commands.launch --quiet {tmp_path / 'opd.py'} --config opd.yaml")
    )


def test_an_input_error_of_a_launched_trainer_is_one_line_without_a_traceback(tmp_path):
    missing = tmp_path / "checkpoint-7"
    argv = ["train", "--output_dir", str(tmp_path / "out"), "--resume_from_checkpoint", str(missing)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    env.pop("ADAFLASH_DEBUG", None)
    result = subprocess.run(
        [sys.executable, "-m", "adaflash_hf.cli", *argv], capture_output=True, text=True, timeout=300, env=env
    )
    assert result.returncode == 1
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if "error" in line.lower()]
    assert errors == [
        f"train_drafter.py: error: resume_from_checkpoint: expected 'last' or an existing checkpoint folder, got "
        f"'{missing}', which does not exist"
    ]


def test_a_usage_error_exits_2_and_any_other_input_error_exits_1_with_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", "generate", "--repeats", "0"])
    assert exit_info.value.code == 2
    assert "error: argument --repeats: expected an int >= 1, got 0" in capsys.readouterr().err
    assert cli.main(["import", str(tmp_path / "missing"), str(tmp_path / "out")]) == 1
    assert capsys.readouterr().err.count("\n") == 1


def test_the_help_and_the_readme_state_both_exit_statuses(capsys):
    epilog = " ".join(_help(capsys).split())
    assert "exits with status 2" in epilog and "(exit status 1)" in epilog
    readme = " ".join((Path(__file__).resolve().parents[1] / "README.md").read_text().split())
    assert "exit status 2" in readme and "exit status 1" in readme


def test_missing_trainer_script_is_not_available(monkeypatch, capsys):
    monkeypatch.setattr(cli, "trainer_script", lambda filename: None)
    assert cli.main(["opd", "--config", "x.yaml"]) == cli.UNAVAILABLE
    assert "adaflash opd: not available in this version" in capsys.readouterr().err


def test_console_script_points_at_main(capsys):
    (entry_point,) = entry_points(group="console_scripts", name="adaflash")
    assert entry_point.value == "adaflash_hf.cli:main" and entry_point.load() is cli.main
    with pytest.raises(SystemExit):
        cli.main(["--version"])
    assert capsys.readouterr().out.startswith("adaflash-hf ")


@pytest.mark.parametrize(
    "command", ["export", "import", "publish", "bench", "corpus", "calibrate-head", "train", "opd"]
)
def test_every_subcommand_help_lists_config(capsys, command):
    assert "--config" in _help(capsys, command)


@pytest.mark.parametrize("benchmark", sorted(cli.BENCH_MODULES))
def test_every_benchmark_help_lists_config(capsys, benchmark):
    assert "--config" in _help(capsys, "bench", benchmark)


def test_benchmark_config_file_supplies_options_and_the_command_line_wins(tmp_path):
    from adaflash_hf.bench import train as bench_train

    (tmp_path / "t.yaml").write_text("steps: 7\nthreads: 3\n")
    args = cli.parse_args_with_config(
        bench_train.make_parser(), ["--config", str(tmp_path / "t.yaml"), "--steps", "2"]
    )
    assert (args.steps, args.threads) == (2, 3)
    (tmp_path / "bad.yaml").write_text("stepz: 7\n")
    with pytest.raises(ValueError, match=r"got 'stepz' \(did you mean 'steps'\?\)"):
        cli.parse_args_with_config(bench_train.make_parser(), ["--config", str(tmp_path / "bad.yaml")])


def test_config_file_supplies_options_and_the_command_line_wins(drafter_folder, tmp_path, capsys):
    _, folder = drafter_folder
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "stale").write_text("x")
    (tmp_path / "export.yaml").write_text("format: adaflash-official\noverwrite: true\n")
    argv = ["export", str(folder), str(tmp_path / "out"), "--config", str(tmp_path / "export.yaml")]
    assert cli.main([*argv, "--format", "dflash"]) == 0
    assert "wrote dflash checkpoint" in capsys.readouterr().out
    assert not (tmp_path / "out" / "stale").exists()


def test_config_file_with_an_unknown_option_names_the_closest(drafter_folder, tmp_path, capsys):
    _, folder = drafter_folder
    (tmp_path / "bad.yaml").write_text("target_confg: x\n")
    argv = ["import", str(folder), str(tmp_path / "out"), "--config", str(tmp_path / "bad.yaml")]
    assert cli.main(argv) == 1
    err = capsys.readouterr().err
    assert "bad.yaml: expected option names of this command" in err
    assert "got 'target_confg' (did you mean 'target_config'?)" in err


def test_non_empty_out_points_to_the_overwrite_flag(drafter_folder, tmp_path, capsys):
    _, folder = drafter_folder
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep").write_text("x")
    assert cli.main(["export", str(folder), str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert "out: expected a new or empty folder (or --overwrite), got the non-empty" in err
    assert "overwrite=True" not in err


def test_top_level_help_of_the_console_script_imports_no_torch():
    # -X importtime lists every module the real `adaflash` script imports, on stderr.
    script = Path(sys.executable).with_name("adaflash")
    result = subprocess.run(
        [sys.executable, "-X", "importtime", str(script), "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0 and "export" in result.stdout
    imported = {line.rsplit("|", 1)[-1].strip() for line in result.stderr.splitlines() if "|" in line}
    assert "adaflash_hf.cli" in imported
    assert not {"torch", "transformers", "trl", "yaml"} & imported


def test_import_adaflash_hf_adds_no_heavy_module_beyond_transformers():
    code = (
        "import sys; import transformers.generation.utils; before = set(sys.modules); import adaflash_hf; "
        "assert adaflash_hf.is_enabled(); print(sorted(set(sys.modules) - before))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    added = set(ast.literal_eval(result.stdout.strip().splitlines()[-1]))
    assert not {"trl", "datasets", "matplotlib", "peft", "triton", "accelerate"} & {
        n.split(".")[0] for n in added
    }
    assert not {"adaflash_hf.serving", "adaflash_hf.kernels", "adaflash_hf.trainers"} & added


def test_a_cpu_launch_uses_every_usable_core_unless_the_user_chose(monkeypatch, tmp_path):
    """`accelerate launch` without --cpu sets OMP_NUM_THREADS=1 on a CPU-only machine; `adaflash train` passes the
    usable cores instead, shared by the processes, unless OMP_NUM_THREADS is set or an accelerate config is given."""
    import argparse

    from adaflash_hf.launch import cpu_thread_args, launch_command, usable_cores

    if torch.cuda.is_available() or usable_cores() < 2:
        pytest.skip("needs a CPU-only machine with 2 or more usable cores")
    cores = usable_cores()
    assert cpu_thread_args(1, environ={}) == ["--num_cpu_threads_per_process", str(cores)]
    assert cpu_thread_args(cores, environ={}) == []  # one core a process: accelerate's default is right
    assert cpu_thread_args(1, environ={"OMP_NUM_THREADS": "1"}) == []
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    script = tmp_path / "train_drafter.py"
    plain = launch_command(
        script, argparse.Namespace(accelerate_config=None, num_processes=None), ["--x", "1"]
    )
    assert plain[3:] == ["--quiet", "--num_cpu_threads_per_process", str(cores), str(script), "--x", "1"]
    configured = launch_command(
        script, argparse.Namespace(accelerate_config="acc.yaml", num_processes=None), []
    )
    assert "--num_cpu_threads_per_process" not in configured


@pytest.mark.parametrize("name", ["train", "opd"])
def test_a_yaml_syntax_error_in_the_scripts_config_is_one_line_before_accelerate_starts(
    monkeypatch, tmp_path, capsys, name
):
    config = tmp_path / "run.yaml"
    config.write_text("max_steps: 3\noutput_dir: [runs/x\n")
    monkeypatch.setattr(cli.subprocess, "call", lambda command, env: pytest.fail("launched accelerate"))
    assert cli.main([name, "--config", str(config)]) == 1
    assert capsys.readouterr().err.splitlines() == [
        f"adaflash {name}: error: --config {config}: expected valid YAML, got expected ',' or ']', but got "
        "'<stream end>' at line 3, column 1"
    ]


@pytest.mark.parametrize("name", ["train", "opd"])
def test_the_launched_script_knows_which_adaflash_command_started_it(monkeypatch, tmp_path, name):
    from adaflash_hf.launch import LAUNCHER_ENV

    script = tmp_path / "script.py"
    script.write_text("")
    environments = []
    monkeypatch.setattr(cli, "trainer_script", lambda filename: script)
    monkeypatch.setattr(cli.subprocess, "call", lambda command, env: environments.append(env) or 0)
    assert cli.main([name]) == 0
    assert environments[0][LAUNCHER_ENV] == f"adaflash {name}"


@pytest.mark.parametrize(
    "started,expected,not_expected",
    [
        (
            {"ADAFLASH_LAUNCHED_BY": "adaflash opd", "OMP_NUM_THREADS": "1"},
            "start it as `OMP_NUM_THREADS={share} adaflash opd ...`",
            "start it with",
        ),
        (
            {"ACCELERATE_MIXED_PRECISION": "no", "OMP_NUM_THREADS": "1"},
            "pass `accelerate launch --num_cpu_threads_per_process {share}`, or start it with `adaflash opd`",
            "start it as",
        ),
        (
            {"OMP_NUM_THREADS": "1"},
            "set OMP_NUM_THREADS={share}, or start it with `adaflash opd`",
            "accelerate",
        ),
    ],
    ids=["adaflash", "accelerate-launch", "python"],
)
def test_the_idle_cores_hint_names_a_fix_for_how_the_script_was_started(started, expected, not_expected):
    from adaflash_hf.launch import usable_cores, warn_if_cpu_threads_idle

    if usable_cores() < 2:
        pytest.skip("needs 2 or more usable cores")
    messages = []
    logger = type("Logger", (), {"warning": staticmethod(messages.append)})
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert warn_if_cpu_threads_idle(logger, torch.device("cpu"), command="adaflash opd", environ=started)
    finally:
        torch.set_num_threads(threads)
    assert expected.format(share=usable_cores()) in messages[0] and not_expected not in messages[0]


def test_a_cpu_run_on_fewer_threads_than_cores_warns_with_the_fix(monkeypatch):
    import logging

    from adaflash_hf.launch import usable_cores, warn_if_cpu_threads_idle

    logger = logging.getLogger("test_threads")
    messages = []
    monkeypatch.setattr(logger, "warning", messages.append)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        idle = warn_if_cpu_threads_idle(logger, torch.device("cpu"))
        assert idle == (usable_cores() > 1)
        if idle:
            assert f"of {usable_cores()} usable cores per process (OMP_NUM_THREADS=" in messages[0]
        torch.set_num_threads(usable_cores())
        assert not warn_if_cpu_threads_idle(logger, torch.device("cpu"))
        assert not warn_if_cpu_threads_idle(logger, torch.device("meta"))  # not a CPU run
    finally:
        torch.set_num_threads(threads)
