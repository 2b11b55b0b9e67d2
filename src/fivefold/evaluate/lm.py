"""The three questions lm-evaluation-harness asks of a language model, answered by a fivefold
model; text in, numbers or text out. No lm_eval import here: harness.py wraps this class in
lm_eval's `LM` interface (lm_eval/api/model.py of lm-evaluation-harness 0.4).

- loglikelihood(context, continuation) -> (log p(continuation | context), is_greedy): the
  pair is encoded as lm-eval's causal models encode it (trailing spaces of the context move
  to the continuation; the whole string is encoded and the context's token count split off,
  so a token that straddles the boundary is scored as the model would see it); an empty
  context becomes the prefix token. is_greedy: every continuation token is the argmax.
- loglikelihood_rolling(text) -> log p(text): each token scored exactly once, the first
  after the prefix token; a text longer than the model's context is cut into windows of
  max_length targets whose inputs are the max_length tokens before each target (the last
  window reaches back for a full context and scores only its new tokens), as lm-eval's
  rolling windows with context_len 1 do.
- generate_until(context, {"until", "max_gen_toks", ...}) -> the continuation, cut before
  the first stop string; greedy unless do_sample (then temperature, top_k, top_p, seed).

Texts are encoded without special tokens; the prefix token (the tokenizer's BOS where the
model has one, else its end-of-text) stands for "start of a document".
"""

from __future__ import annotations

import torch

from fivefold.config import ConfigError


def encode_plain(codec, text: str) -> list[int]:
    """Token ids of text without BOS/EOS (a TextCodec over an HF tokenizer.json adds them)."""
    from fivefold.train.generate import TextCodec

    if isinstance(codec, TextCodec) and codec._tok is not None:
        return codec._tok.encode(text, add_special_tokens=False).ids
    return codec.encode(text)  # fivefold's tokenizers add no special tokens


class FivefoldScorer:
    def __init__(self, model, codec, prefix_token_id: int, max_length: int | None = None):
        self.model, self.codec = model.eval(), codec
        self.prefix_token_id = prefix_token_id
        self.max_length = min(max_length or model.cfg.max_seq_len, model.cfg.max_seq_len)
        self.device = next(model.parameters()).device

    def encode(self, text: str) -> list[int]:
        return encode_plain(self.codec, text)

    def encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        if not context:
            return [self.prefix_token_id], self.encode(continuation)
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        whole = self.encode(context + continuation)
        split = len(self.encode(context))
        return whole[:split], whole[split:]

    @torch.no_grad()
    def _target_logprobs(self, inputs: list[int], targets: list[int]) -> tuple[torch.Tensor,
                                                                                torch.Tensor]:
        """log p of each target given the inputs up to it, and whether it was the argmax."""
        x = torch.tensor([inputs], device=self.device)
        logprobs = self.model(x)[0].float().log_softmax(-1)
        y = torch.tensor(targets, device=self.device)
        rows = logprobs[len(inputs) - len(targets):]
        return rows.gather(-1, y[:, None])[:, 0], rows.argmax(-1) == y

    def loglikelihood(self, context: str, continuation: str) -> tuple[float, bool]:
        context_ids, continuation_ids = self.encode_pair(context, continuation)
        if not continuation_ids:
            raise ConfigError(f"the continuation {continuation!r} encodes to no tokens; "
                              f"a loglikelihood needs at least one")
        if len(continuation_ids) > self.max_length:
            raise ConfigError(f"a continuation of {len(continuation_ids)} tokens exceeds the "
                              f"model's context of {self.max_length}")
        # Left-truncate: keep the last max_length inputs (the continuation's last token is
        # a target only).
        inputs = (context_ids + continuation_ids)[-(self.max_length + 1):][:-1]
        logprobs, greedy = self._target_logprobs(inputs, continuation_ids)
        return float(logprobs.double().sum()), bool(greedy.all())

    def loglikelihood_rolling(self, text: str) -> float:
        full = [self.prefix_token_id] + self.encode(text)
        total = 0.0
        for first in range(1, len(full), self.max_length):  # targets [first, last)
            last = min(first + self.max_length, len(full))
            start = max(0, last - 1 - self.max_length)
            logprobs, _ = self._target_logprobs(full[start:last - 1], full[first:last])
            total += float(logprobs.double().sum())
        return total

    def generate_until(self, context: str, kwargs: dict) -> str:
        from fivefold.train.generate import generate

        kwargs = dict(kwargs or {})
        until = kwargs.pop("until", None) or []
        until = [until] if isinstance(until, str) else list(until)
        max_new = int(kwargs.pop("max_gen_toks", 256))
        sample = bool(kwargs.pop("do_sample", False))
        temperature = float(kwargs.pop("temperature", 1.0 if sample else 0.0))
        ids = self.encode(context) or [self.prefix_token_id]
        max_new = max(1, min(max_new, self.max_length - 1))
        ids = ids[-(self.max_length - max_new):]  # left-truncate to leave room
        eos = getattr(self.codec, "eos_id", None)
        new = generate(self.model, ids, max_new, temperature=temperature,
                       top_k=int(kwargs.pop("top_k", 0) or 0),
                       top_p=float(kwargs.pop("top_p", 1.0) or 1.0),
                       greedy=not sample or temperature == 0, seed=int(kwargs.pop("seed", 0)),
                       eos_id=eos)
        stops = set() if eos is None else {eos} if isinstance(eos, int) else set(eos)
        if new and new[-1] in stops:
            new = new[:-1]
        text = self.codec.decode(new)
        for stop in until:
            if stop and stop in text:
                text = text[:text.index(stop)]
        return text
