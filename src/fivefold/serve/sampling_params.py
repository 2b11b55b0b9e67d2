"""Per-request sampling settings, checked once when the request arrives (torch-free).

Names follow vLLM's `SamplingParams` and the OpenAI API: `max_tokens`, `temperature` (0 means
greedy), `top_k` (0 switches it off), `top_p` (1 switches it off), `seed`, `stop` (strings
that end the output and are cut from it), `stop_token_ids`, `ignore_eos`, `n` (completions
of one prompt: the prompt is computed once and its blocks shared, copy-on-write; choice i
draws with seed + i), `logit_bias` ((token id, bias) pairs added to the logits before
sampling, greedy included). A bad value raises `ConfigError` with one line naming the field
and the fix; the HTTP layer turns that into a 400 response. What can be checked is checked
here, so no request reaches the engine's loop with a value that would make it fail there: a
seed outside int64 (what the OpenAI API allows; torch's generator takes at most 2^64 - 1,
and choice i draws with seed + i), a temperature that is not a finite number.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from fivefold.errors import ConfigError

# Below this temperature sampling is greedy: logits / 1e-40 overflow to inf and softmax gives
# NaN. vLLM's _SAMPLING_EPS is the same 1e-5 (vllm/sampling_params.py).
GREEDY_BELOW = 1e-5
SEED_RANGE = (-(2**63), 2**63 - 1)  # int64, as the OpenAI API's `seed`
LOGIT_BIAS_RANGE = (-100.0, 100.0)  # the OpenAI API's range


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    n: int = 1
    logit_bias: tuple[tuple[int, float], ...] = field(default_factory=tuple)
    # Not a sampling setting but the request's too: the LoRA adapter that serves it (by its
    # --lora name; None: the base model). serve/lora_batch.py applies it per sequence.
    adapter: str | None = None

    def __post_init__(self) -> None:
        # Lists from JSON become tuples, so a SamplingParams stays hashable and immutable.
        object.__setattr__(self, "stop", tuple([self.stop] if isinstance(self.stop, str)
                                               else self.stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        object.__setattr__(self, "logit_bias", tuple((int(t), float(b)) for t, b in bias or ()))
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ConfigError(f"max_tokens = {self.max_tokens!r} must be an integer >= 1")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ConfigError(f"temperature = {self.temperature} must be a number >= 0 "
                              f"(0 is greedy)")
        if self.seed is not None and not (
                isinstance(self.seed, int) and SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]):
            raise ConfigError(f"seed = {self.seed!r} must be an integer in [-2^63, 2^63 - 1]")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ConfigError(f"top_k = {self.top_k!r} must be an integer >= 0 (0: off)")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p = {self.top_p} must lie in (0, 1] (1: off)")
        if not isinstance(self.n, int) or self.n < 1:
            raise ConfigError(f"n = {self.n!r} must be an integer >= 1")
        for token, bias in self.logit_bias:
            if token < 0 or not LOGIT_BIAS_RANGE[0] <= bias <= LOGIT_BIAS_RANGE[1]:
                raise ConfigError(f"logit_bias {{{token}: {bias}}}: token ids are >= 0 and "
                                  f"biases lie in [-100, 100]")
        if any(not s for s in self.stop):
            raise ConfigError("stop holds an empty string; give non-empty stop strings")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @classmethod
    def greedy_params(cls, max_tokens: int, **kwargs) -> SamplingParams:
        return cls(max_tokens=max_tokens, temperature=0.0, **kwargs)
