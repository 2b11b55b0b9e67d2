"""A request as the scheduler sees it: token ids, how many have K/V in the cache, a status.

There are no prefill and decode phases (vLLM v1's model): a request holds `num_tokens`
tokens (prompt + output so far) of which `num_computed_tokens` have keys and values in the
cache; each step the scheduler gives it some of the difference (the whole prompt, a chunk of
it, or the one newest token), and the step that reaches `num_tokens` samples the next token.
Preemption by recomputation just sets `num_computed_tokens` back to 0.

`RequestStatus` is an ordered IntEnum: everything above PREEMPTED is finished, and each
finished status maps to the OpenAI `finish_reason` it reports.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from fivefold.serve.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3  # EOS, a stop token id or a stop string
    FINISHED_LENGTH = 4  # max_tokens, or the model's context is full
    FINISHED_ABORTED = 5  # the client left, or the server is shutting down
    FINISHED_ERROR = 6  # its step or its sampling raised; the server answers 500

    @property
    def finished(self) -> bool:
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> str | None:
        return {RequestStatus.FINISHED_STOPPED: "stop", RequestStatus.FINISHED_LENGTH: "length",
                RequestStatus.FINISHED_ABORTED: "abort",
                RequestStatus.FINISHED_ERROR: "error"}.get(self)


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = field(default_factory=time.perf_counter)
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_preemptions: int = 0
    # What a stop string left of the text; None: the text is the decoded output.
    stop_text: str | None = None
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    error: str | None = None  # why it ended with FINISHED_ERROR

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_token(self, token: int, now: float) -> None:
        self.output_token_ids.append(token)
        if self.first_token_time is None:
            self.first_token_time = now
        self.token_times.append(now)
