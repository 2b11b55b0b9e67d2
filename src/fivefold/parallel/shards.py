"""Between a parameter's local piece and its logical (full, unsplit) tensor.

Checkpoints and Hugging Face weights speak in logical tensors; each rank holds a piece:
a tensor-parallel slice (described by `param._tp_slice = (dim, start, stop)` of the logical
tensor; local rows past stop-start are padding) or the whole tensor. ZeRO's flat shards are
the optimizer's business: its `param_states()` already returns tensors of the parameter's
local shape.

Expert weights are stacked ([E, ...]) and, under expert parallelism, each rank holds a
contiguous block of experts (`param._ep_slice = (0, start, stop)`). Checkpoints keep one
logical tensor per expert, `NAME[j]` for global expert j, so each rank writes and reads only
its own experts and a run saved at ep 4 resumes at ep 1 or ep 2 (`logical_entries`,
`from_entries`).
"""

from __future__ import annotations

import torch

from fivefold.parallel import comm


def local_piece(param: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """This rank's piece of the logical tensor `full`, shaped like `param` (padding zeroed)."""
    ep_slice = getattr(param, "_ep_slice", None)
    if ep_slice is not None and full.shape[0] != param.shape[0]:
        _, start, stop = ep_slice
        full = full.narrow(0, start, stop - start)
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


def expert_key(name: str, expert: int) -> str:
    return f"{name}[{expert}]"


def expert_range(param: torch.Tensor) -> range:
    """The global ids of the experts whose weights `param` (stacked, [E_local, ...]) holds."""
    _, start, stop = getattr(param, "_ep_slice", (0, 0, param.shape[0]))
    return range(start, stop)


def logical_entries(name: str, param: torch.Tensor, local: torch.Tensor, dims,
                    expert: bool) -> dict[str, torch.Tensor]:
    """The logical tensors behind this rank's `local` value of `param`: one (gathered over
    tp), or for stacked expert weights one per expert this rank holds."""
    full = full_tensor(param, local, dims)
    if not expert:
        return {name: full}
    return {expert_key(name, j): full[i].clone() for i, j in enumerate(expert_range(param))}


def from_entries(name: str, param: torch.Tensor, tensors: dict[str, torch.Tensor],
                 expert: bool) -> torch.Tensor:
    """This rank's local value of `param` from the logical tensors of `logical_entries`."""
    if not expert:
        return local_piece(param, tensors[name])
    stacked = torch.stack([tensors[expert_key(name, j)] for j in expert_range(param)])
    return local_piece(param, stacked)
