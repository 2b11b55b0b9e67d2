"""Request bodies of the OpenAI API, as pydantic models, and the error body.

The fields are the ones the official client sends (openai-python 3.x, `completions.create`
and `chat.completions.create`); `top_k` and `ignore_eos` are vLLM's extensions. Fields the
engine does not implement (`UNSUPPORTED`: best_of, suffix, response_format, tools, penalties,
logprobs, ...) are accepted at their neutral value and refused with a 400 naming the field
otherwise, so a request never silently gets something other than it asked for. Other unknown
field names are ignored (the client adds new ones over time); a known field of the wrong
type is a 400. Types are strict, as the API documents them: `max_tokens: "5"`, `5.0` or
`true` is a 400 naming the field, not a silent 5 or 1 (a float field takes an integer). A
string holding a lone surrogate (half a UTF-16 pair, which no tokenizer and no JSON writer
takes) is a 400 naming its field.
"""

from __future__ import annotations

import re
import time
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictBool, StrictInt
from pydantic import StrictFloat as _StrictFloat

from fivefold.errors import ConfigError
from fivefold.serve.sampling_params import SEED_RANGE, SamplingParams


class BadField(ConfigError):
    """A request field with a value this server refuses (HTTP 400, `param` = the field)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


def error_body(message: str, param: str | None = None, kind: str = "invalid_request_error",
               code: int | str = 400) -> dict:
    """OpenAI's error object: {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


# Fields of the OpenAI API (and vLLM's sampling extensions) that this server does not
# implement, each with the values that ask for nothing (None always does).
UNSUPPORTED: dict[str, tuple] = {
    "best_of": (1,), "suffix": ("",), "presence_penalty": (0,), "frequency_penalty": (0,),
    "logprobs": (False,), "top_logprobs": (0,), "response_format": ({"type": "text"},),
    "tools": ([],), "tool_choice": ("none",), "functions": ([],), "function_call": ("none",),
    "prediction": (), "audio": (), "modalities": (["text"],), "prompt_logprobs": (),
    "min_tokens": (0,), "repetition_penalty": (1,), "min_p": (0,),
}


def _utf8(value: str) -> str:
    """Refuse a lone surrogate: pydantic names the field in the 400 (a ValueError)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"holds a lone surrogate at character {e.start} (half of a UTF-16 "
                         f"pair); send valid Unicode text") from None
    return value


Text = Annotated[str, Field(strict=True), AfterValidator(_utf8)]
Number = _StrictFloat  # an int or a float; not a string, not a bool
TokenIds = list[StrictInt]
_TOKEN_KEY = re.compile(r"-?[0-9]+")


def _neutral(value: Any, allowed: tuple) -> bool:
    # 0 == False in Python, but `logprobs: 0` asks for the chosen tokens' log-probabilities
    return value is None or any(isinstance(value, bool) == isinstance(a, bool) and value == a
                                for a in allowed)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: StrictBool = False


class _Sampling(BaseModel):
    # extras are kept (and otherwise ignored) so that UNSUPPORTED can look at them
    model_config = ConfigDict(extra="allow")

    model: Text | None = None
    max_tokens: StrictInt | None = None
    temperature: Number = 1.0
    top_p: Number = 1.0
    top_k: StrictInt = 0
    n: StrictInt = Field(1, ge=1, le=16)
    seed: StrictInt | None = Field(None, ge=SEED_RANGE[0], le=SEED_RANGE[1])
    stop: Text | list[Text] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    ignore_eos: StrictBool = False
    logit_bias: dict[str, Number] | None = None
    user: Text | None = None

    def refuse_unsupported(self) -> None:
        for name, allowed in UNSUPPORTED.items():
            value = getattr(self, name, None)
            if not _neutral(value, allowed):
                raise BadField(name, f"{name} = {value!r} is not supported by this server; "
                                     f"leave it out")
        if self.stream_options is not None and not self.stream:
            raise BadField("stream_options", "stream_options is only allowed with stream: "
                                             "true")

    def _logit_bias(self) -> dict[int, float]:
        """Keys are token ids written as decimal integers; two keys naming one token ("5"
        and "05") are refused, not summed past the documented [-100, 100]."""
        bias: dict[int, float] = {}
        for key, value in (self.logit_bias or {}).items():
            if not _TOKEN_KEY.fullmatch(key):
                raise BadField("logit_bias", f"logit_bias key {key!r} is not a token id; keys "
                                             f"are integers written as strings")
            if int(key) in bias:
                raise BadField("logit_bias", f"logit_bias names token {int(key)} twice; give "
                                             f"each token once")
            bias[int(key)] = value
        return bias

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        self.refuse_unsupported()
        max_tokens = default_max_tokens if self.max_tokens is None else self.max_tokens
        return SamplingParams(max_tokens=max_tokens, temperature=self.temperature,
                              top_k=self.top_k, top_p=self.top_p, seed=self.seed,
                              stop=tuple([self.stop] if isinstance(self.stop, str)
                                         else self.stop or ()), ignore_eos=self.ignore_eos,
                              n=self.n, logit_bias=self._logit_bias())

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_Sampling):
    prompt: Text | TokenIds
    echo: StrictBool = False
    max_tokens: StrictInt | None = 16  # the API's documented default for completions


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")  # image_url, input_audio, ...: refused by type

    type: Text
    text: Text | None = None


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Text | list[ContentPart] | None = ""

    def text(self) -> str:
        if isinstance(self.content, list):  # content parts: text only (no images, audio)
            kinds = {p.type for p in self.content} - {"text"}
            if kinds:
                raise BadField("messages", f"messages: content parts of type "
                                           f"{sorted(kinds)} "
                                           f"are not supported by this server; send text")
            return "".join(p.text or "" for p in self.content)
        return self.content or ""


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = None

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        if self.max_tokens is None and self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        return super().sampling_params(default_max_tokens)


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}
