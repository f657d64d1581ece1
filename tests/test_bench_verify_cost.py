"""``adaflash bench verify-cost``: every arm's curve over n = 1..max tokens, the CPU's model and bf16 flags in the
record and its table, and what ``prepare_target`` chose for the prepared arms; bad options refused."""

import pytest
import torch

from adaflash_hf.bench import verify_cost
from adaflash_hf.prepared.cpu import cpu_model
from tests.conftest import four_bit_target


def test_the_record_holds_every_arms_curve_and_the_cpu(target_factory):
    record = verify_cost.run_verify_cost(
        four_bit_target(target_factory), verify_cost.ARMS, max_tokens=3, context=70, repeats=1, progress=False
    )  # a 4-bit target, so that the int4 arm runs too
    assert list(record["arms"]) == list(verify_cost.ARMS)
    for arm, result in record["arms"].items():
        assert sorted(result["relative"]) == [1, 2, 3] and all(v > 0 for v in result["relative"].values()), (
            arm
        )
        assert result["one_token_ms"] > 0
    assert record["arms"]["fp32"]["prepared"] is None
    assert record["arms"]["prepared-bf16"]["prepared"]["dtype"] == "torch.bfloat16"
    assert record["arms"]["prepared-fp32"]["prepared"]["invariant"] is True
    assert record["arms"]["prepared-int4"]["prepared"]["weights"] == "int4"
    assert set(record["cpu"]) >= {"model", "bf16_units", "missing_bf16_units"}
    table = verify_cost.markdown_table(record)
    assert cpu_model() in table and "bf16 units" in table and "| 3 |" in table


def test_the_target_it_was_given_is_left_as_it_was(target_factory):
    target = target_factory("qwen3")
    verify_cost.run_verify_cost(
        target, ["prepared-bf16"], max_tokens=2, context=10, repeats=1, progress=False
    )
    assert next(target.parameters()).dtype == torch.float32 and type(target.lm_head) is torch.nn.Linear
    assert target.config._attn_implementation == "sdpa"


def test_an_unknown_arm_is_refused(capsys):
    with pytest.raises(SystemExit) as exit_info:
        verify_cost.make_parser().parse_args(["--arms", "fp16"])
    assert exit_info.value.code == 2 and "--arms" in capsys.readouterr().err
    with pytest.raises(ValueError, match="arm: expected one of"):
        verify_cost.build_arm(None, "fp16")
