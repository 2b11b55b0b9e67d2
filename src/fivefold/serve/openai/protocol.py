"""Request bodies of the OpenAI API, as pydantic models, and the error body.

The fields are the ones the official client sends (openai-python 3.x, `completions.create`
and `chat.completions.create`); `top_k` and `ignore_eos` are vLLM's extensions. Fields the
engine does not implement are accepted at their neutral value and refused otherwise, so a
request never silently gets something other than it asked for. Unknown field names are
ignored (the client adds new ones over time); a known field of the wrong type is a 400.
"""

from __future__ import annotations

import time
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from fivefold.errors import ConfigError
from fivefold.serve.sampling_params import SamplingParams


def error_body(message: str, param: str | None = None, kind: str = "invalid_request_error",
               code: int = 400) -> dict:
    """OpenAI's error object: {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    n: int = Field(1, ge=1, le=16)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | bool | None = None
    user: str | None = None

    def refuse_unsupported(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise ConfigError(f"{name} is not supported by this server; leave it at 0")
        if self.logprobs:
            raise ConfigError("logprobs are not supported by this server; leave them unset")

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        self.refuse_unsupported()
        max_tokens = default_max_tokens if self.max_tokens is None else self.max_tokens
        return SamplingParams(max_tokens=max_tokens, temperature=self.temperature,
                              top_k=self.top_k, top_p=self.top_p, seed=self.seed,
                              stop=tuple([self.stop] if isinstance(self.stop, str)
                                         else self.stop or ()), ignore_eos=self.ignore_eos,
                              n=self.n)


class CompletionRequest(_Sampling):
    prompt: str | list[int]
    echo: bool = False
    max_tokens: int | None = 16  # the API's documented default for completions


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict] | None = ""

    def text(self) -> str:
        if isinstance(self.content, list):  # content parts: keep the text ones
            return "".join(p.get("text", "") for p in self.content if p.get("type") == "text")
        return self.content or ""


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        if self.max_tokens is None and self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        return super().sampling_params(default_max_tokens)


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}
