"""`adaflash bench generate`: every method lossless, τ accounted the same way for all, outputs written, failures loud."""

import json
import re

import pytest

from adaflash_hf.bench import generate as bench
from adaflash_hf.online.evaluate import length_head_figures
from tests.conftest import BENCH_PROMPTS as PROMPTS

NEW_TOKENS = 24


@pytest.fixture(scope="module")
def results(tiny_pair):
    target, drafter = tiny_pair
    return bench.run_benchmark(target, drafter, PROMPTS, max_new_tokens=NEW_TOKENS, repeats=2, progress=False)


def _corrupt_last_token(target, drafter, input_ids, config):
    output = bench.RUNNERS["plain"](target, drafter, input_ids, config).clone()
    output[0, -1] = (output[0, -1] + 1) % target.config.vocab_size
    return output


def test_summary_has_one_row_per_domain_and_method(results):
    rows = [(row["domain"], row["method"]) for row in results["summary"]]
    assert rows == [(domain, method) for domain in PROMPTS for method in bench.METHODS]
    assert set(results) == {"settings", "ok", "summary", "records", "cost_curve"}
    assert results["cost_curve"]["1"][1] == 1.0  # goodput measured the verify cost, relative to one token
    assert {
        "tau",
        "tokens_per_s",
        "speedup",
        "mean_verify_length",
        "acceptance_per_position",
        "lossless",
    } <= set(results["summary"][0])


def test_every_method_is_lossless_with_a_random_drafter(results):
    assert results["ok"]
    assert all(record["lossless"] for record in results["records"])
    assert all(record["new_tokens"] == NEW_TOKENS for record in results["records"])


def test_plain_has_speedup_one_and_tau_one(results):
    for row in results["summary"]:
        if row["method"] == "plain":
            assert row["speedup"] == 1.0
            assert row["tau"] == 1.0
            assert row["mean_verify_length"] == 0.0


def test_each_call_is_timed_once_per_repeat(results):
    assert all(len(record["seconds"]) == 2 for record in results["records"])
    assert all(record["tokens_per_s"] > 0 for record in results["records"])


def test_adaflash_fixed_verifies_full_blocks_capped_by_the_budget(results, tiny_pair):
    block = tiny_pair[1].config.block_size
    for record in results["records"]:
        if record["method"] == "adaflash_fixed":
            committed = 1  # by the prefill
            for verified, accepted in zip(record["verify_lengths"], record["accepted_lengths"]):
                assert verified == min(block - 1, NEW_TOKENS - committed - 1)
                committed += accepted + 1


def test_length_head_figures_count_diffusion_rounds_and_score_only_uncensored_ones():
    stats = {
        "block_size": 4,
        "verify_lengths": [3, 1, 2, 3, 2],
        "accepted_lengths": [1, 1, 0, 3, 2],
        "predicted_acceptance": [0.5, 0.9, 0.2, 1.0, 0.6],
        "sources": ["diffusion", "diffusion", "diffusion", "diffusion", "lookup"],
    }
    figures = length_head_figures([stats])
    assert figures["k_hat_histogram"] == [0, 1, 1, 2]  # the lookup round is not a k̂ choice
    # Rounds 0 and 2 rejected a verified draft (a* exact); rounds 1 and 3 accepted all they verified (censored).
    assert figures["head_abs_error"] == pytest.approx((abs(0.5 - 1 / 3) + abs(0.2 - 0)) / 2)
    assert figures["head_censored"] == pytest.approx(0.5)


def test_decode_rounds_reads_commits_from_cache_growth():
    # prompt of 12 (prefill), then rounds verifying 7, 7, 2 drafts; final length 40
    calls = [(12, 0), (8, 12), (8, 20), (3, 24)]
    verified, accepted = bench.decode_rounds(calls, final_length=40)
    assert verified == [7, 7, 2]
    assert accepted == [7, 3, 14]


def test_forward_tau_equals_adaflash_stats_tau_with_an_oracle(target_factory, oracle_factory):
    target = target_factory("qwen3")
    ids = PROMPTS["chat"][0][1]
    reference = target.generate(ids, max_new_tokens=60, do_sample=False)
    oracle = oracle_factory(target, reference, seed=3)
    methods = ("plain", "adaflash_fixed", "adaflash_adaptive")
    results = bench.run_benchmark(
        target,
        oracle,
        {"chat": PROMPTS["chat"]},
        methods=methods,
        max_new_tokens=46,
        repeats=1,
        progress=False,
    )
    assert results["ok"]
    for record in results["records"]:
        if record["method"] != "plain":
            assert record["stats_agree"]
            # premise: no last forward that only had room for the bonus token (stats do not count that one)
            assert len(record["verify_lengths"]) == record["stats"]["drafting_rounds"]
            assert record["tau"] > 1.5
            assert record["tau"] == pytest.approx(record["tau_stats"])


def test_a_method_with_wrong_tokens_is_reported_not_lossless(tiny_pair, monkeypatch):
    target, drafter = tiny_pair
    monkeypatch.setitem(bench.RUNNERS, "prompt_lookup", _corrupt_last_token)
    results = bench.run_benchmark(
        target,
        drafter,
        PROMPTS,
        methods=("plain", "prompt_lookup"),
        max_new_tokens=8,
        repeats=1,
        progress=False,
    )
    assert not results["ok"]
    lossless = {row["method"]: row["lossless"] for row in results["summary"]}
    assert lossless == {"plain": True, "prompt_lookup": False}
    assert {r["first_mismatch"] for r in results["records"] if r["method"] == "prompt_lookup"} == {7}
    assert "| chat | prompt_lookup |" in bench.markdown_table(results)


def test_methods_must_include_plain(tiny_pair):
    target, drafter = tiny_pair
    with pytest.raises(ValueError, match="methods: expected a subset .* including 'plain'"):
        bench.run_benchmark(target, drafter, PROMPTS, methods=("adaflash_fixed",), progress=False)


def test_main_writes_json_table_and_plots(offline_main):
    status, out = offline_main()
    assert status == 0
    results = json.loads((out / "results.json").read_text())
    assert results["ok"] and results["settings"]["max_new_tokens"] == bench.QUICK["max_new_tokens"]
    assert results["settings"]["decoding"] == "greedy" and results["settings"]["target_dtype"] == "float32"
    table_rows = [
        line
        for line in (out / "table.md").read_text().splitlines()
        if line.startswith("| chat") or line.startswith("| math")
    ]
    assert len(table_rows) == 2 * len(bench.METHODS)
    hybrid = [r for r in results["summary"] if r["method"] == "adaflash_hybrid"]
    assert hybrid and all(0 <= r["lookup_share"] <= 1 for r in hybrid)
    assert "lookup rounds" in (out / "table.md").read_text()
    for name in (
        "acceptance_per_position.png",
        "acceptance_hist.png",
        "source_share.png",
        "k_hat_distribution.png",
    ):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    adaptive = [r for r in results["summary"] if r["method"] == "adaflash_adaptive"]
    assert all(sum(r["k_hat_histogram"]) > 0 for r in adaptive)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--prompts-per-domain", "0"], "argument --prompts-per-domain: expected an int >= 1, got 0"),
        (["--repeats", "0"], "argument --repeats: expected an int >= 1, got 0"),
        (["--max-new-tokens", "1"], "argument --max-new-tokens: expected an int >= 2, got 1"),
        (["--gamma", "0"], "argument --gamma: expected a number > 0, got 0"),
        (["--lookup-min-prob", "2"], r"argument --lookup-min-prob: expected a number in \[0, 1\], got 2"),
        (
            ["--methods", "adaflash_fixed"],
            r"--methods: expected a list including plain .*got \['adaflash_fixed'\]",
        ),
    ],
)
def test_bad_options_are_usage_errors_before_the_target_loads(no_target, capsys, flags, message):
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--quick", *flags])
    assert exit_info.value.code == 2
    assert re.search(message, capsys.readouterr().err)


def test_more_prompts_than_a_held_out_set_holds_are_refused_before_the_target_loads(no_target):
    with pytest.raises(
        ValueError,
        match=r"--prompts-per-domain: expected at most \d+ \(the held-out math prompts\), got 100000",
    ):
        bench.main(["--methods", "plain", "--domains", "math", "--prompts-per-domain", "100000"])


def test_a_missing_drafter_folder_is_refused_before_the_target_loads(no_target, tmp_path):
    with pytest.raises(FileNotFoundError, match="expected an existing drafter folder"):
        bench.main(["--quick", "--drafter", str(tmp_path / "missing")])


def test_main_exits_nonzero_when_an_output_differs(offline_main, monkeypatch):
    monkeypatch.setitem(bench.RUNNERS, "prompt_lookup", _corrupt_last_token)
    status, out = offline_main("--methods", "plain", "prompt_lookup")
    assert status == 1
    assert not json.loads((out / "results.json").read_text())["ok"]
