"""The training and validation loaders: (input, target) windows, split by data-parallel rank.

Samples. A split (train: the first 1 − val_fraction of the token stream; val: the rest) is
cut into S = (split_tokens − 1) // seq_len aligned windows; window k holds the tokens
[k·seq_len, k·seq_len + seq_len + 1), its input the first seq_len, its target the last
seq_len (the input shifted by one). Windows overlap by one token, so no token is skipped
as a target; the split boundary falls inside the token stream, not at a document end.

Order. The loader counts `samples_consumed`, the number of sequences handed out so far over
all ranks. Global sample g is window perm_e[g mod S] of epoch e = g // S, where perm_e is a
permutation drawn from (seed, e): each epoch covers every window once, in an order that
differs per seed and per epoch. Validation is read in order (perm_e = identity), so after
`reset()` every evaluation sees the same batches. Nothing else is state: the position is one
integer, the same for every rank and every layout, which is what a checkpoint stores.

Ranks. Step t's global batch is samples g = t·gbs … t·gbs + gbs − 1, in that order. Data-
parallel rank r takes its contiguous share, samples t·gbs + r·gbs/dp … + (r+1)·gbs/dp − 1,
cut into gbs/(dp·mbs) micro-batches of mbs sequences:

    gbs = 8, mbs = 2    dp = 1:  rank 0: [g0 g1] [g2 g3] [g4 g5] [g6 g7]
                        dp = 2:  rank 0: [g0 g1] [g2 g3]   rank 1: [g4 g5] [g6 g7]

so rank r's micro-batch j is the dp=1 run's micro-batch r·gbs/(dp·mbs) + j, and the
micro-batch lists of all ranks, concatenated in rank order, equal the dp=1 list.
"""

from __future__ import annotations

import numpy as np
import torch

from fivefold.config import ConfigError
from fivefold.data.dataset import TokenDataset, default_corpus_tokens

__all__ = ["BatchLoader", "TokenDataset", "default_corpus_tokens", "split_bounds"]

IGNORE_INDEX = -100  # the cross-entropy ignore_index; this loader never masks a target


def split_bounds(num_tokens: int, val_fraction: float, split: str) -> tuple[int, int]:
    """[start, end) of a split in the token stream: val is the last val_fraction of it."""
    num_val = int(num_tokens * val_fraction)
    return (0, num_tokens - num_val) if split == "train" else (num_tokens - num_val, num_tokens)


class BatchLoader:
    def __init__(self, ds: TokenDataset, seq_len: int, gbs: int, mbs: int = 1, dp_rank: int = 0,
                 dp: int = 1, seed: int = 1234, split: str = "train", val_fraction: float = 0.0,
                 shuffle: bool | None = None):
        if split not in ("train", "val"):
            raise ConfigError(f"loader split '{split}' is not 'train' or 'val'")
        if seq_len <= 0 or gbs <= 0 or mbs <= 0 or dp <= 0:
            raise ConfigError(f"loader needs positive seq_len, gbs, mbs and dp; got {seq_len}, "
                              f"{gbs}, {mbs}, {dp}")
        if gbs % (dp * mbs):
            raise ConfigError(f"train.gbs = {gbs} is not divisible by parallel.mbs × parallel.dp ="
                              f" {dp * mbs}; make gbs a multiple of it")
        if not 0 <= dp_rank < dp:
            raise ConfigError(f"dp_rank {dp_rank} is outside 0..{dp - 1}")
        if not 0 <= val_fraction < 1:
            raise ConfigError(f"data.val_fraction = {val_fraction} must lie in [0, 1)")
        self.ds, self.seq_len, self.gbs, self.mbs = ds, seq_len, gbs, mbs
        self.dp_rank, self.dp, self.seed, self.split = dp_rank, dp, seed, split
        self.shuffle = split == "train" if shuffle is None else shuffle
        self.start, self.end = split_bounds(ds.num_tokens, val_fraction, split)
        self.num_samples = (self.end - self.start - 1) // seq_len  # windows per epoch
        if self.num_samples <= 0:
            self._too_small(val_fraction)
        self.samples_consumed = 0
        self._perm_epoch, self._perm = -1, None

    def _too_small(self, val_fraction: float):
        n = self.end - self.start
        if self.split == "val" and val_fraction == 0:
            raise ConfigError("data.val_fraction = 0 leaves no validation tokens; set "
                              "data.val_fraction > 0 or train.eval_every = 0")
        fix = ("raise data.val_fraction" if self.split == "val"
               else "give more text, lower train.seq_len or data.val_fraction")
        raise ConfigError(f"token file {self.ds.path} has {n} {self.split} tokens, fewer than "
                          f"train.seq_len + 1 = {self.seq_len + 1}; {fix}")

    # -- sizes -------------------------------------------------------------------------
    @property
    def num_microbatches(self) -> int:
        """Micro-batches per rank per step."""
        return self.gbs // (self.dp * self.mbs)

    @property
    def num_target_tokens(self) -> int:
        """Targets != IGNORE_INDEX in one global batch, over all ranks: the loss denominator.

        Exactly gbs·seq_len, because every window is full and no target is masked (documents
        are packed across EOS). A loader that pads or masks must count here instead.
        """
        return self.gbs * self.seq_len

    @property
    def step(self) -> int:
        return self.samples_consumed // self.gbs

    @property
    def epoch(self) -> float:
        return self.samples_consumed / self.num_samples

    # -- sampling ----------------------------------------------------------------------
    def window_index(self, sample: int) -> int:
        """The window (0..num_samples-1) that global sample number `sample` reads."""
        epoch, pos = divmod(sample, self.num_samples)
        if not self.shuffle:
            return pos
        if epoch != self._perm_epoch:  # one permutation held at a time: S int64s
            rng = np.random.Generator(np.random.PCG64([self.seed, epoch]))
            self._perm, self._perm_epoch = rng.permutation(self.num_samples), epoch
        return int(self._perm[pos])

    def _windows(self, first: int, count: int) -> np.ndarray:
        rows = np.empty((count, self.seq_len + 1), dtype=np.int64)
        for i in range(count):
            begin = self.start + self.window_index(first + i) * self.seq_len
            rows[i] = self.ds.tokens[begin:begin + self.seq_len + 1]
        return rows

    def next_batch(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's micro-batches of the next global batch: num_microbatches pairs of
        (input, target), each int64 of shape (mbs, seq_len). Advances every rank's shared
        position by gbs."""
        per_rank = self.gbs // self.dp
        rows = torch.from_numpy(
            self._windows(self.samples_consumed + self.dp_rank * per_rank, per_rank))
        inputs, targets = rows[:, :-1].contiguous(), rows[:, 1:].contiguous()
        self.samples_consumed += self.gbs
        return list(zip(inputs.split(self.mbs), targets.split(self.mbs)))

    def reset(self) -> None:
        """Back to the first batch (validation: the same batches at every evaluation)."""
        self.samples_consumed = 0

    # -- checkpoints -------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The position, plus what must match for it to mean the same batches on resume.
        Layout-independent: no dp, mbs or rank in it, so a run may resume with another."""
        return {"samples_consumed": self.samples_consumed, "seed": self.seed,
                "seq_len": self.seq_len, "split": self.split, "shuffle": self.shuffle,
                "start": self.start, "end": self.end}

    def load_state_dict(self, state: dict) -> None:
        if "samples_consumed" not in state:
            raise ConfigError(f"the checkpoint holds no {self.split} data-loader position "
                              f"(keys: {', '.join(state)}); resume from a fivefold checkpoint")
        for key in ("seed", "seq_len", "split", "shuffle", "start", "end"):
            if key in state and state[key] != getattr(self, key):
                raise ConfigError(
                    f"the checkpoint's {self.split} data position was saved with {key} = "
                    f"{state[key]!r}, this run has {getattr(self, key)!r}; resume with the same "
                    f"train.seed, train.seq_len, data.path and data.val_fraction")
        self.samples_consumed = int(state["samples_consumed"])
