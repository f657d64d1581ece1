"""The OpenAI wire format of ``adaflash serve``: request bodies, their checks, and response and chunk bodies.

Requests are parsed with pydantic in strict mode (a string is not a number, a number is not a bool) and every bad
value becomes an ``OpenAIError``: HTTP 400 with OpenAI's body ``{"error": {"message", "type", "param", "code"}}``,
``param`` naming the field (404 ``model_not_found`` for a model this server does not serve, as the OpenAI API
answers). Fields the server cannot honour (``logprobs``, ``tools``, penalties, ``n`` > 1, a ``response_format``
other than text, ...) are refused when set to
anything but their neutral value; other unknown fields are ignored, as the OpenAI API ignores ``user`` or
``metadata`` for a model that has no use for them. ``top_k`` is accepted as an extension (vLLM's).

Defaults follow OpenAI: ``temperature`` 1, ``top_p`` 1, ``max_tokens`` up to the context (capped by the server's
``default_max_tokens``). Every response carries an ``adaflash`` object (the request's verify rounds, accepted drafts
and the drafter weights version that answered it), which OpenAI clients keep as an extra field.
"""

from __future__ import annotations

import json
import time
from typing import Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from adaflash_hf.serving.requests import SEED_MAX, SEED_MIN, SEED_RANGE, SamplingParams

MAX_STOP_STRINGS = 4
# field -> its neutral values: set to anything else, the request is refused (the server cannot honour it)
UNSUPPORTED = {
    "logprobs": (None, False, 0),
    "top_logprobs": (None, 0),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
    "frequency_penalty": (None, 0, 0.0),
    "presence_penalty": (None, 0, 0.0),
    "logit_bias": (None, {}),
    "echo": (None, False),
    "best_of": (None, 1),
    "suffix": (None, ""),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "response_format": (None, {"type": "text"}),  # no constrained decoding: JSON modes would go unenforced
}


class OpenAIError(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None):
        super().__init__(message)
        self.status, self.param, self.code = status, param, code
        self.type = "invalid_request_error" if status < 500 else "server_error"

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.type, "param": self.param, "code": self.code}}


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")


class StreamOptions(_Body):
    include_usage: bool = False


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class _Sampling(_Body):
    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]


FIELD_NAMES = {
    name
    for model in (ChatCompletionRequest, CompletionRequest, ChatMessage, TextPart, StreamOptions)
    for name in model.model_fields
}


def parse_body(raw: bytes, model: type[_Sampling]) -> _Sampling:
    """The request body as ``model``, or an ``OpenAIError`` naming the first bad field."""
    try:
        values = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise OpenAIError(f"body: expected a JSON object, got malformed JSON ({error})") from None
    if not isinstance(values, dict):
        raise OpenAIError(f"body: expected a JSON object, got {type(values).__name__}")
    _refuse_lone_surrogates(values, [])
    try:
        request = model.model_validate(values)
    except ValidationError as error:
        first = error.errors()[0]
        path = [str(p) for p in first["loc"] if isinstance(p, int) or p in FIELD_NAMES]
        param = ".".join(path) or None
        got = "nothing" if first["type"] == "missing" else repr(first.get("input"))[:120]
        raise OpenAIError(f"{param}: {first['msg'].lower()}, got {got}", param=param) from None
    for name, neutral in UNSUPPORTED.items():
        if name in values and values[name] not in neutral:
            raise OpenAIError(
                f"{name}: not supported by this server (expected it unset or {neutral[-1]!r}), got {values[name]!r}",
                param=name,
            )
    return request


def _refuse_lone_surrogates(value, path: list[str]) -> None:
    """JSON's escapes can spell half of a UTF-16 pair (``"\\ud800"``), which is no text: no tokenizer encodes it."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as error:
            param = ".".join(path) or None
            raise OpenAIError(
                f"{param}: expected valid Unicode text, got a lone surrogate {value[error.start]!r} at character "
                f"{error.start}",
                param=param,
            ) from None
    elif isinstance(value, dict):
        for key, item in value.items():
            _refuse_lone_surrogates(key, path)
            _refuse_lone_surrogates(item, [*path, key])
    elif isinstance(value, list):
        for index, item in enumerate(value):
            _refuse_lone_surrogates(item, [*path, str(index)])


def check_model(request: _Sampling, served: str) -> None:
    if request.model != served:
        raise OpenAIError(
            f"model: expected {served!r} (see /v1/models), got {request.model!r}",
            param="model",
            status=404,
            code="model_not_found",
        )


def stop_strings(request: _Sampling) -> list[str]:
    stop = [request.stop] if isinstance(request.stop, str) else list(request.stop or [])
    if len(stop) > MAX_STOP_STRINGS or not all(stop):
        raise OpenAIError(
            f"stop: expected a string or up to {MAX_STOP_STRINGS} non-empty strings, got {request.stop!r}",
            param="stop",
        )
    return stop


def sampling_params(
    request: _Sampling, prompt_tokens: int, context: int, default_max_tokens: int, prompt_field: str
) -> SamplingParams:
    """The engine's ``SamplingParams``, every value checked against OpenAI's ranges and the model's context."""
    if request.n not in (None, 1):
        raise OpenAIError(f"n: expected 1 (one choice per request), got {request.n}", param="n")
    name = "max_tokens"
    max_tokens = request.max_tokens
    if isinstance(request, ChatCompletionRequest) and request.max_completion_tokens is not None:
        name, max_tokens = "max_completion_tokens", request.max_completion_tokens
    if max_tokens is not None and max_tokens < 1:
        raise OpenAIError(f"{name}: expected an integer >= 1, got {max_tokens}", param=name)
    room = context - prompt_tokens
    if room < 1 or (max_tokens is not None and max_tokens > room):
        raise OpenAIError(
            f"{prompt_field}: expected prompt tokens + {name} <= the model's context of {context} tokens, got "
            f"{prompt_tokens} + {max_tokens if max_tokens is not None else 1}",
            param=prompt_field,
        )
    temperature = 1.0 if request.temperature is None else request.temperature
    if not 0 <= temperature <= 2:
        raise OpenAIError(f"temperature: expected a number in [0, 2], got {temperature}", param="temperature")
    top_p = 1.0 if request.top_p is None else request.top_p
    if not 0 < top_p <= 1:
        raise OpenAIError(f"top_p: expected a number in (0, 1], got {top_p}", param="top_p")
    if request.top_k is not None and request.top_k < 0:
        raise OpenAIError(f"top_k: expected an integer >= 0 (0 disables), got {request.top_k}", param="top_k")
    if request.seed is not None and not SEED_MIN <= request.seed <= SEED_MAX:
        raise OpenAIError(f"seed: expected an integer in {SEED_RANGE}, got {request.seed}", param="seed")
    return SamplingParams(
        max_new_tokens=max_tokens if max_tokens is not None else min(default_max_tokens, room),
        temperature=temperature,
        top_p=top_p,
        top_k=request.top_k or 0,
        seed=request.seed,
    )


def chat_prompt_ids(tokenizer, request: ChatCompletionRequest) -> list[int]:
    if not request.messages:
        raise OpenAIError("messages: expected at least one message, got none", param="messages")
    if getattr(tokenizer, "chat_template", None) is None:
        raise OpenAIError("messages: this model has no chat template; use /v1/completions", param="messages")
    messages = [{"role": m.role, "content": m.text()} for m in request.messages]
    encoded = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True
    )
    return list(encoded["input_ids"])


def completion_prompt_ids(tokenizer, request: CompletionRequest, vocab_size: int) -> list[int]:
    prompt = request.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise OpenAIError(
                f"prompt: expected one prompt (a string or a list of token ids), got a batch of {len(prompt)}",
                param="prompt",
            )
        prompt = prompt[0]
    ids = tokenizer(prompt)["input_ids"] if isinstance(prompt, str) else list(prompt)
    if not ids:
        raise OpenAIError("prompt: expected at least one token, got an empty prompt", param="prompt")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise OpenAIError(f"prompt: expected token ids in 0..{vocab_size - 1}, got {bad[:8]}", param="prompt")
    return ids


# ------------------------------------------------------------------------------------------------------ responses
def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def response_body(chat: bool, request_id: str, model: str, text: str, finished, created: int) -> dict:
    """A whole (non-streamed) response; ``finished`` is the worker's final event."""
    choice = {"index": 0, "finish_reason": finished.finish_reason, "logprobs": None}
    choice |= {"message": {"role": "assistant", "content": text}} if chat else {"text": text}
    return {
        "id": request_id,
        "object": "chat.completion" if chat else "text_completion",
        "created": created,
        "model": model,
        "choices": [choice],
        "usage": usage(finished.prompt_tokens, finished.completion_tokens),
        "system_fingerprint": None,
        "adaflash": finished.extra,
    }


class ChunkWriter:
    """Server-sent events of one streamed response, in OpenAI's chunk format."""

    def __init__(self, chat: bool, request_id: str, model: str, include_usage: bool):
        self.chat, self.include_usage = chat, include_usage
        self.head = {
            "id": request_id,
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()),
            "model": model,
            "system_fingerprint": None,
        }

    def _event(self, choices: list, **extra) -> str:
        body = self.head | {"choices": choices} | extra
        if self.include_usage:
            body.setdefault("usage", None)
        return f"data: {json.dumps(body)}\n\n"

    def _choice(self, text: str | None, finish_reason: str | None, role: bool = False) -> dict:
        choice = {"index": 0, "finish_reason": finish_reason, "logprobs": None}
        if not self.chat:
            return choice | {"text": text or ""}
        delta = {"role": "assistant"} if role else {}
        return choice | {"delta": delta | ({"content": text} if text is not None else {})}

    def start(self) -> str:
        """The first chunk (chat: the assistant role, as OpenAI sends it); "" for completions."""
        return self._event([self._choice("", None, role=True)]) if self.chat else ""

    def text(self, text: str) -> str:
        return self._event([self._choice(text, None)])

    def finish(self, finished) -> str:
        events = self._event(
            [self._choice(None if self.chat else "", finished.finish_reason)], adaflash=finished.extra
        )
        if self.include_usage:
            events += self._event([], usage=usage(finished.prompt_tokens, finished.completion_tokens))
        return events + "data: [DONE]\n\n"

    def error(self, error: OpenAIError) -> str:
        return f"data: {json.dumps(error.body())}\n\ndata: [DONE]\n\n"
