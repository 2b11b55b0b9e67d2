"""The next token from a row of logits: greedy, temperature, top-k, top-p, seeded.

Sampling divides the logits by the temperature, keeps the `top_k` largest and then the
smallest set whose probability reaches `top_p` (nucleus sampling, Holtzman et al. 2020), and
draws from what is left with the caller's generator, so a run is reproducible from its seed.
`fivefold generate` (train/generate.py) and the serving engine (serve/engine.py) both draw
their tokens here, so a request gives the same tokens through either.
"""

from __future__ import annotations

import torch


def sample_token(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0,
                 top_p: float = 1.0, greedy: bool = False,
                 generator: torch.Generator | None = None) -> int:
    """One token id from a (vocab,) row of logits.

    greedy (or temperature 0) takes the argmax. top_k = 0 and top_p = 1 switch those filters
    off; tokens tied with the k-th largest logit are all kept.
    """
    if greedy or temperature == 0:
        return int(logits.argmax())
    logits = logits.detach().float().cpu() / temperature
    if 0 < top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(descending=True)
        probs = sorted_logits.softmax(-1)
        # Drop a token when the tokens ranked above it already hold at least top_p of the mass;
        # the most likely token is therefore always kept.
        drop = probs.cumsum(-1) - probs >= top_p
        drop[0] = False
        logits = logits.index_fill(0, order[drop], float("-inf"))
    probs = logits.softmax(-1)
    return int(torch.multinomial(probs, 1, generator=generator))
