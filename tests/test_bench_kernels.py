"""`adaflash bench kernels`: its sizes and counts are checked while the arguments are parsed, before any kernel runs."""

import pytest

from adaflash_hf.bench import kernels as bench


@pytest.mark.parametrize(
    "flags",
    [["--vocab", "0"], ["--rows", "512", "-4"], ["--hidden", "0"], ["--repeats", "0"], ["--threads", "0"]],
)
def test_a_size_or_count_below_one_is_a_usage_error(capsys, flags):
    with pytest.raises(SystemExit) as exit_info:
        bench.main(flags)
    assert exit_info.value.code == 2
    assert f"argument {flags[0]}: expected an int >= 1, got {flags[-1]}" in capsys.readouterr().err
