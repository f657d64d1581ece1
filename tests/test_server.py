"""``adaflash serve`` through the official ``openai`` client against a real uvicorn server on a loopback port: greedy
text equals plain ``target.generate``, concurrent clients each get their solo output, streamed == whole, usage,
stop strings, OpenAI-style 400s naming the field, disconnects that free their slot, and 429 under overload."""

import json
import logging
import re
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import torch

from adaflash_hf import cli
from adaflash_hf.prepared.prepare import is_prepared
from adaflash_hf.serving import openai_api as api
from adaflash_hf.serving.server import BackgroundServer, build_engine, create_app, prepare_served_target
from adaflash_hf.serving.worker import EngineWorker

PROMPTS = [
    "w5 w6 w7",
    "w9 w10 w11 w12",
    "w40 w41",
    "w100 w7 w300 w8 w9",
    "w77",
    "w200 w201 w202",
    "w6 w6",
    "w450",
]


def running_server(target, drafter, tokenizer, max_waiting=64, **engine_options):
    """The app over ``build_engine(target, drafter, **engine_options)``, served on a free loopback port."""
    worker = EngineWorker(build_engine(target, drafter, **engine_options), tokenizer, max_waiting=max_waiting)
    server = BackgroundServer(create_app(worker, tokenizer, "tiny", default_max_tokens=16))
    server.target, server.tokenizer = target, tokenizer
    return server


@pytest.fixture(scope="module")
def target(target_factory):
    # A random target whose greedy text does not repeat one token from the start.
    return target_factory("llama", initializer_range=0.2)


@pytest.fixture(scope="module")
def server(target, drafter_factory, word_tokenizer):
    with running_server(target, drafter_factory(target), word_tokenizer) as running:
        yield running


def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=60)


def plain_tokens(server, prompt_ids, max_new_tokens):
    out = server.target.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, len(prompt_ids) :].tolist()


def plain_text(server, prompt_ids, max_new_tokens):
    return server.tokenizer.decode(plain_tokens(server, prompt_ids, max_new_tokens), skip_special_tokens=True)


def metrics(server) -> dict[str, float]:
    text = (
        urllib.request.urlopen(server.base_url.removesuffix("/v1") + "/metrics", timeout=10).read().decode()
    )
    return {name: float(value) for name, value in re.findall(r"^([^#\s]\S*) (\S+)$", text, re.M)}


def wait_for(condition, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


def post(server, path, body: bytes):
    request = urllib.request.Request(
        server.base_url + path, data=body, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_greedy_completion_equals_plain_generate(server):
    prompt_ids = server.tokenizer(PROMPTS[0])["input_ids"]
    response = client(server).completions.create(
        model="tiny", prompt=PROMPTS[0], max_tokens=24, temperature=0
    )
    assert response.choices[0].text == plain_text(server, prompt_ids, 24)
    assert response.choices[0].finish_reason == "length"


def test_greedy_chat_equals_plain_generate_on_the_chat_template(server):
    messages = [{"role": "user", "content": PROMPTS[1]}]
    prompt_ids = server.tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)
    response = client(server).chat.completions.create(
        model="tiny", messages=messages, max_tokens=20, temperature=0
    )
    assert response.choices[0].message.content == plain_text(server, prompt_ids["input_ids"], 20)
    assert response.choices[0].message.role == "assistant"


def test_eight_concurrent_clients_each_get_their_solo_output(server):
    def ask(prompt):
        return client(server).completions.create(model="tiny", prompt=prompt, max_tokens=20, temperature=0)

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        texts = [r.choices[0].text for r in pool.map(ask, PROMPTS)]
    assert texts == [plain_text(server, server.tokenizer(p)["input_ids"], 20) for p in PROMPTS]


def test_streamed_chunks_concatenate_to_the_whole_text_with_usage(server):
    messages = [{"role": "user", "content": PROMPTS[3]}]
    whole = client(server).chat.completions.create(
        model="tiny", messages=messages, max_tokens=18, temperature=0
    )
    chunks = list(
        client(server).chat.completions.create(
            model="tiny",
            messages=messages,
            max_tokens=18,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    prompt = server.tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)
    assert whole.usage.prompt_tokens == len(prompt["input_ids"])
    assert (whole.usage.completion_tokens, whole.usage.total_tokens) == (18, whole.usage.prompt_tokens + 18)


def test_streamed_completion_equals_the_whole_one(server):
    whole = client(server).completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=15, temperature=0)
    chunks = client(server).completions.create(
        model="tiny", prompt=PROMPTS[2], max_tokens=15, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_string_ends_the_text_where_plain_decoding_reaches_it(server, stream):
    prompt_ids = server.tokenizer(PROMPTS[4])["input_ids"]
    tokens = plain_tokens(server, prompt_ids, 30)
    words = server.tokenizer.decode(tokens, skip_special_tokens=True).split(" ")
    stop = " " + words[6]  # the word's first occurrence ends the text there
    full = " ".join(words)
    expected = full[: full.index(stop)]
    response = client(server).completions.create(
        model="tiny", prompt=PROMPTS[4], max_tokens=30, temperature=0, stop=[stop, "never"], stream=stream
    )
    if stream:
        chunks = list(response)
        text, reason = "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason
    else:
        text, reason = response.choices[0].text, response.choices[0].finish_reason
        used = next(
            n for n in range(1, 31) if stop in server.tokenizer.decode(tokens[:n], skip_special_tokens=True)
        )
        assert response.usage.completion_tokens == used
    assert (text, reason) == (expected, "stop")


def test_a_seeded_sampling_request_repeats_its_text(server):
    def sample():
        response = client(server).completions.create(
            model="tiny", prompt=PROMPTS[5], max_tokens=12, temperature=0.9, top_p=0.95, seed=7
        )
        return response.choices[0].text

    assert sample() == sample()


def test_a_tiny_positive_temperature_answers_the_greedy_text(server):
    prompt_ids = server.tokenizer(PROMPTS[6])["input_ids"]
    response = client(server).completions.create(
        model="tiny", prompt=PROMPTS[6], max_tokens=16, temperature=5e-324, seed=1
    )
    assert response.choices[0].text == plain_text(server, prompt_ids, 16)


BAD = [
    (b'{"model": "tiny", "prompt": "w5", ', None),
    (b'{"model": "other", "prompt": "w5"}', "model"),
    (b'{"model": "tiny", "prompt": "w5", "max_tokens": -3}', "max_tokens"),
    (b'{"model": "tiny", "prompt": "w5", "max_tokens": "ten"}', "max_tokens"),
    (b'{"model": "tiny", "prompt": "w5", "max_tokens": 600}', "prompt"),
    (b'{"model": "tiny", "prompt": "w5", "n": 2}', "n"),
    (b'{"model": "tiny", "prompt": "w5", "temperature": "hot"}', "temperature"),
    (b'{"model": "tiny", "prompt": "w5", "stop": [1]}', "stop"),
    (b'{"model": "tiny", "prompt": "w5", "logprobs": 2}', "logprobs"),
    (b'{"model": "tiny", "prompt": ["w5", "w6"]}', "prompt"),
    (b'{"prompt": "w5"}', "model"),
    (b'{"model": "tiny", "prompt": "w5 \\ud800"}', "prompt"),
    (b'{"model": "tiny", "prompt": "w5", "response_format": {"type": "json_object"}}', "response_format"),
    (b'{"model": "tiny", "prompt": "w5", "seed": 1180591620717411303424}', "seed"),
]


@pytest.mark.parametrize("body,param", BAD)
def test_bad_input_answers_an_openai_error_naming_the_field_and_serving_goes_on(server, body, param):
    status, error = post(server, "/completions", body)
    assert status == (404 if param == "model" and b"other" in body else 400)
    assert error["error"]["param"] == param and error["error"]["type"] == "invalid_request_error"
    assert param is None or param in error["error"]["message"]
    ok = client(server).completions.create(model="tiny", prompt="w5", max_tokens=2, temperature=0)
    assert ok.choices[0].finish_reason == "length"


def test_a_json_response_format_is_refused_naming_the_field_and_text_is_accepted(server):
    schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
    with pytest.raises(openai.BadRequestError, match="response_format: not supported") as refused:
        client(server).chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "w5"}], max_tokens=2, response_format=schema
        )
    assert refused.value.body["param"] == "response_format" and "json_schema" in refused.value.body["message"]
    text = client(server).chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "w5"}],
        max_tokens=2,
        response_format={"type": "text"},
    )
    assert text.choices[0].finish_reason == "length"


def test_bad_chat_messages_name_the_message_field(server):
    status, error = post(
        server, "/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content": 5}]}'
    )
    assert status == 400 and error["error"]["param"] == "messages.0.content"
    with pytest.raises(openai.BadRequestError, match="messages"):
        client(server).chat.completions.create(model="tiny", messages=[])


def test_a_lone_surrogate_in_a_message_is_a_400_naming_the_message_field(server):
    body = b'{"model": "tiny", "messages": [{"role": "user", "content": "a\\ud800b"}]}'
    status, error = post(server, "/chat/completions", body)
    assert status == 400 and error["error"]["param"] == "messages.0.content"
    assert "expected valid Unicode text, got a lone surrogate '\\ud800'" in error["error"]["message"]


def test_an_unexpected_server_error_is_a_500_in_the_openai_error_shape(server, monkeypatch):
    def broken(tokenizer, request):
        raise RuntimeError("template exploded")

    monkeypatch.setattr(api, "chat_prompt_ids", broken)
    status, error = post(
        server, "/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content": "w5"}]}'
    )
    assert status == 500 and error["error"]["type"] == "server_error"
    assert error["error"]["message"] == "server: unexpected RuntimeError: template exploded"


def test_a_client_that_disconnects_mid_stream_frees_its_slot(server):
    aborted = metrics(server).get('adaflash_requests_finished_total{reason="abort"}', 0)
    stream = client(server).completions.create(
        model="tiny", prompt=PROMPTS[0], max_tokens=400, temperature=0, stream=True
    )
    next(iter(stream))
    wait_for(lambda: metrics(server)["adaflash_requests_running"] == 1)
    stream.close()
    wait_for(lambda: metrics(server)['adaflash_requests_finished_total{reason="abort"}'] == aborted + 1)
    assert metrics(server)["adaflash_requests_running"] == 0
    later = client(server).completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=24, temperature=0)
    assert later.choices[0].text == plain_text(server, server.tokenizer(PROMPTS[0])["input_ids"], 24)


def test_a_non_streamed_client_that_goes_away_has_its_request_aborted(server):
    before = metrics(server)
    impatient = openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=0.3)
    with pytest.raises(openai.APITimeoutError):
        impatient.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=480, temperature=0)
    aborted = 'adaflash_requests_finished_total{reason="abort"}'
    wait_for(lambda: metrics(server)[aborted] == before.get(aborted, 0) + 1)
    finished = 'adaflash_requests_finished_total{reason="length"}'
    assert metrics(server)[finished] == before[finished]


def sse_lines(base_url: str, body: dict, first_line: threading.Event) -> list[str]:
    """The non-empty lines of a streamed response; ``first_line`` is set once one has arrived."""
    request = urllib.request.Request(
        base_url + "/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    lines = []
    with urllib.request.urlopen(request, timeout=60) as response:
        assert response.status == 200
        for line in response:
            if line.strip():
                lines.append(line.decode().strip())
                first_line.set()
    return lines


def test_streams_still_running_when_the_grace_period_ends_get_an_error_event_and_done(
    target, word_tokenizer, caplog
):
    worker = EngineWorker(build_engine(target, None), word_tokenizer)
    server = BackgroundServer(create_app(worker, word_tokenizer, "tiny"), grace_s=0.3)
    body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 480, "temperature": 0, "stream": True}
    started = [threading.Event(), threading.Event()]
    with caplog.at_level(logging.INFO), ThreadPoolExecutor(2) as pool:
        with server:
            streams = [pool.submit(sse_lines, server.base_url, body, event) for event in started]
            assert all(event.wait(30) for event in started)
        # leaving the block stops the server as SIGTERM does
        ends = [stream.result()[-2:] for stream in streams]
    for error, done in ends:
        assert done == "data: [DONE]"
        error = json.loads(error.removeprefix("data: "))["error"]
        assert error["code"] == "shutting_down" and "grace period of 0.3 s" in error["message"]
    cut = [r for r in caplog.records if "grace period" in r.getMessage()]
    assert len(cut) == 1 and "stopping 2 unfinished request(s)" in cut[0].getMessage()
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]


def test_models_health_and_metrics(server):
    assert [m.id for m in client(server).models.list()] == ["tiny"]
    root = server.base_url.removesuffix("/v1")
    assert json.loads(urllib.request.urlopen(root + "/health", timeout=10).read()) == {"status": "ok"}
    values = metrics(server)
    for name in (
        "adaflash_tokens_per_second",
        "adaflash_tau",
        "adaflash_mean_verify_length",
        "adaflash_drafter_weights_version",
        "adaflash_admission_ema_running",
        "adaflash_step_seconds_p99",
    ):
        assert name in values, name
    assert values["adaflash_generated_tokens_total"] > 0


def test_a_prompt_past_2048_tokens_is_served_when_the_context_holds_it(target_factory, word_tokenizer):
    long_context = target_factory("llama", max_position_embeddings=4096)
    with running_server(long_context, None, word_tokenizer) as long_server:
        prompt = [5 + i % 500 for i in range(3000)]
        response = client(long_server).completions.create(
            model="tiny", prompt=prompt, max_tokens=2, temperature=0
        )
    assert (response.usage.prompt_tokens, response.choices[0].finish_reason) == (3000, "length")


def test_the_token_budget_defaults_to_the_models_context(target_factory):
    long_context = target_factory("llama", max_position_embeddings=8192)
    assert build_engine(long_context, None).admission.config.token_budget == 8192


def test_a_prompt_over_the_token_budget_is_a_400_naming_the_limit(target, word_tokenizer):
    with running_server(target, None, word_tokenizer, token_budget=64) as small:
        body = json.dumps({"model": "tiny", "prompt": list(range(5, 105)), "max_tokens": 2}).encode()
        status, error = post(small, "/completions", body)
    assert status == 400 and error["error"]["param"] == "prompt"
    assert (
        "prompt: expected a prompt of at most 64 tokens (the server's --token-budget"
        in error["error"]["message"]
    )
    assert error["error"]["message"].endswith("got 100")


def test_a_token_budget_below_max_running_is_a_usage_error_naming_both(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["serve", "--token-budget", "8", "--max-running", "16", "--target", "/nonexistent"])
    assert exit_info.value.code == 2
    assert "error: --token-budget 8: expected at least --max-running 16" in capsys.readouterr().err


def test_overload_answers_429_with_retry_after_and_every_accepted_request_completes(target, word_tokenizer):
    with running_server(target, None, word_tokenizer, max_waiting=1, max_running=1) as busy:
        accepted = [
            client(busy).chat.completions.create(
                model="tiny",
                messages=[{"role": "user", "content": p}],
                max_tokens=300,
                temperature=0,
                stream=True,
            )
            for p in PROMPTS[:2]
        ]
        for stream in accepted:  # the role chunk: accepted, one running and one waiting
            next(iter(stream))
        refused = []
        for prompt in PROMPTS[2:6]:
            with pytest.raises(openai.RateLimitError) as error:
                client(busy).completions.create(model="tiny", prompt=prompt, max_tokens=4)
            refused.append(error.value.response.headers["retry-after"])
        assert refused == ["1"] * 4
        done = [list(stream)[-1].choices[0].finish_reason for stream in accepted]
        assert done == ["length", "length"]
        assert metrics(busy)["adaflash_requests_rejected_total"] == 4


@pytest.mark.parametrize(
    "dtype, learn, expected",
    [("fp32", False, None), ("bf16", False, torch.bfloat16), ("auto", True, None), ("fp32", True, None)],
)
def test_the_served_targets_dtype(target_factory, dtype, learn, expected):
    # --dtype bf16 always gets the batch-invariant forward (lossless against plain decoding of the same target);
    # auto with --learn stays fp32, where the trainer's drafter copy trains.
    target = target_factory("llama")
    prepare_served_target(target, dtype, learn)
    preparation = is_prepared(target)
    assert (preparation and preparation.dtype) == expected
    assert next(target.parameters()).dtype == (expected or torch.float32)
    assert preparation is None or preparation.invariant


def test_auto_times_the_engines_packed_forward_to_choose_the_served_dtype(target_factory, monkeypatch):
    import adaflash_hf.prepared.prepare as prepare
    import adaflash_hf.serving.server as server_module

    timed = []
    monkeypatch.setattr(prepare, "detect_bf16_units", lambda: ("avx512_bf16",))
    real = server_module.packed_forward_timer
    monkeypatch.setattr(
        server_module, "packed_forward_timer", lambda m: timed.append(m) or real(m, sizes=(1, 2))
    )
    target = target_factory("llama")
    prepare_served_target(target, "auto", learn=False)
    reason = is_prepared(target).reason
    assert len(timed) == 2 and "measured fastest" in reason
    assert reason.count("ms a prompt token") == 2  # the prompts' prefill is timed and weighed too


@pytest.mark.parametrize("dtype", ["bf16", "int4"])
def test_serve_refuses_bf16_weights_with_learn_before_loading_anything(dtype, capsys):
    assert cli.main(["serve", "--learn", "--dtype", dtype, "--target", "/nonexistent"]) == 1
    err = capsys.readouterr().err
    assert "--dtype: expected auto or fp32 with --learn" in err and f"got {dtype}" in err


@pytest.mark.parametrize(
    "option", [["--train-threshold", "5"], ["--learn-dir", "runs/x"], ["--opd-config", "opd.yaml"]]
)
def test_a_learn_option_without_learn_is_a_usage_error_naming_both(capsys, option):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["serve", *option, "--target", "/nonexistent"])
    assert exit_info.value.code == 2
    assert f"error: {' '.join(option)}: expected together with --learn" in capsys.readouterr().err


@pytest.mark.parametrize("option", [["--length-mode", "fixed"], ["--draft-source", "hybrid"]])
def test_a_drafting_option_with_drafter_none_is_a_usage_error_naming_both(capsys, option):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["serve", "--drafter", "none", *option, "--target", "/nonexistent"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"error: {' '.join(option)}: expected a drafter to draft with, got --drafter none" in err


def test_a_port_out_of_range_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["serve", "--port", "70000", "--target", "/nonexistent"])
    assert exit_info.value.code == 2
    assert (
        "argument --port: expected an int in 0..65535 (0: a free one), got 70000" in capsys.readouterr().err
    )


def test_a_host_this_machine_cannot_listen_on_is_one_line_naming_host(capsys):
    assert cli.main(["serve", "--host", "192.0.2.1", "--target", "/nonexistent"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(
        "adaflash serve: error: --host: expected an address of this machine to listen on, got "
    )
    assert "'192.0.2.1'" in err and err.count("\n") == 1


@pytest.mark.integration
def test_the_real_target_with_the_shipped_drafter_answers_chat_as_plain_generate():
    from adaflash_hf.assets import load_target
    from adaflash_hf.serving.server import load_drafter_for

    target, tokenizer = load_target()
    messages = [{"role": "user", "content": "Name three primary colors."}]
    worker = EngineWorker(build_engine(target, load_drafter_for(target, None)), tokenizer)
    with BackgroundServer(create_app(worker, tokenizer, "smollm2")) as server:
        answer = client(server).chat.completions.create(
            model="smollm2", messages=messages, max_tokens=40, temperature=0, stop=["\n\n"]
        )
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)[
        "input_ids"
    ]
    plain = target.generate(torch.tensor([prompt]), max_new_tokens=40, do_sample=False)[0, len(prompt) :]
    text = tokenizer.decode(plain, skip_special_tokens=True)
    assert answer.choices[0].message.content == text.split("\n\n")[0]
    expected_reason = "stop" if "\n\n" in text or tokenizer.eos_token_id in plain.tolist() else "length"
    assert answer.choices[0].finish_reason == expected_reason


EVERYDAY_PROMPTS = [
    "What is tea?",
    "Name three primary colors.",
    "Write a Python function that reverses a string.",
    "Translate 'good morning, how are you?' into French.",
    "Summarize in one sentence: the meeting moved to Friday because two speakers were ill.",
    "What is 17 times 23?",
    "Give me a tip for sleeping better.",
    "Explain what a hash map is.",
    "Write a haiku about rain.",
    "Which planet is closest to the sun?",
    "List two uses of baking soda.",
    "How do I boil an egg?",
    "What does HTTP stand for?",
    "Tom has 5 apples and eats 2. How many are left?",
    "Suggest a name for a grey cat.",
    "Why is the sky blue?",
]


@pytest.mark.integration
def test_the_default_server_answers_the_same_greedy_text_at_one_client_and_at_sixteen():
    # adaflash serve's defaults (the target prepared by --dtype auto, the shipped drafter, default drafting): a
    # request's text does not depend on what else is in the batch, nor on whether a drafter drafts at all.
    from adaflash_hf.assets import DEFAULT_TARGET
    from adaflash_hf.serving.server import served_engine

    engine, target, tokenizer = served_engine(DEFAULT_TARGET)

    def answers(worker_engine, concurrency):
        worker = EngineWorker(worker_engine, tokenizer)
        with BackgroundServer(create_app(worker, tokenizer, "smollm2")) as server:

            def ask(prompt):
                reply = client(server).chat.completions.create(
                    model="smollm2",
                    messages=[{"role": "user", "content": prompt}],
                    max_tokens=32,
                    temperature=0,
                )
                return reply.choices[0].message.content

            with ThreadPoolExecutor(concurrency) as pool:
                return list(pool.map(ask, EVERYDAY_PROMPTS))

    alone = answers(engine, 1)
    assert answers(engine, 16) == alone
    assert answers(build_engine(target, None), 16) == alone
