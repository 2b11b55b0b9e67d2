"""Between a parameter's local piece and its logical (full, unsplit) tensor.

Checkpoints and Hugging Face weights speak in logical tensors; each rank holds a piece:
a tensor-parallel slice (described by `param._tp_slice = (dim, start, stop)` of the logical
tensor; local rows past stop-start are padding) or the whole tensor. ZeRO's flat shards are
the optimizer's business: its `param_states()` already returns tensors of the parameter's
local shape.
"""

from __future__ import annotations

import torch

from fivefold.parallel import comm


def local_piece(param: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """This rank's piece of the logical tensor `full`, shaped like `param` (padding zeroed)."""
    spec = getattr(param, "_tp_slice", None)
    if spec is None:
        return full
    dim, start, stop = spec
    piece = full.narrow(dim, start, stop - start)
    if piece.shape[dim] == param.shape[dim]:
        return piece
    padded = torch.zeros(param.shape, dtype=full.dtype, device=full.device)
    padded.narrow(dim, 0, stop - start).copy_(piece)
    return padded


def full_tensor(param: torch.Tensor, local: torch.Tensor, dims) -> torch.Tensor:
    """The logical tensor whose piece on this rank is `local` (gathered over tp if split)."""
    spec = getattr(param, "_tp_slice", None)
    if spec is None:
        return local
    dim, start, stop = spec
    group = dims["tp"]
    pieces = torch.empty((group.size, *local.shape), dtype=local.dtype, device=local.device)
    comm.all_gather(pieces.view(-1), local.contiguous().view(-1), group)
    bounds = torch.tensor([start, stop], device=local.device)
    all_bounds = torch.empty(group.size * 2, dtype=bounds.dtype, device=local.device)
    comm.all_gather(all_bounds, bounds, group)
    full_len = int(all_bounds.max())
    shape = list(local.shape)
    shape[dim] = full_len
    full = torch.empty(shape, dtype=local.dtype, device=local.device)
    for r in range(group.size):
        s, e = int(all_bounds[2 * r]), int(all_bounds[2 * r + 1])
        full.narrow(dim, s, e - s).copy_(pieces[r].narrow(dim, 0, e - s))
    return full
