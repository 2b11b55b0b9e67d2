"""Between a parameter's local piece and its logical (full, unsplit) tensor.

Checkpoints and Hugging Face weights speak in logical tensors; each rank holds a piece:
a tensor-parallel slice (described by `param._tp_slice = (dim, start, stop)` of the logical
tensor; local rows past stop-start are padding) or the whole tensor. A ZeRO rank owns flat
ranges of its local tensors: `logical_parts` describes such a range as boxes of the logical
tensor, which is how sharded checkpoints name what each rank writes and reads.

Expert weights are stacked ([E, ...]) and, under expert parallelism, each rank holds a
contiguous block of experts (`param._ep_slice = (0, start, stop)`). Checkpoints keep one
logical tensor per expert, `NAME[j]` for global expert j, so each rank writes and reads only
its own experts and a run saved at ep 4 resumes at ep 1 or ep 2 (`logical_entries`,
`per_expert_parts`).
"""

from __future__ import annotations

import math

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


# --- a flat range of a local tensor as boxes of the logical tensor (sharded checkpoints) ---
def flat_boxes(shape, lo: int, hi: int) -> list[tuple[tuple[int, ...], tuple[int, ...], int]]:
    """The flat range [lo, hi) of a row-major tensor of `shape` as boxes: (offsets, sizes,
    flat start). A partial first row, a block of whole rows, a partial last row, recursively;
    each box is itself a contiguous flat range, so it is a view of the flat data."""
    if hi <= lo:
        return []
    if len(shape) <= 1:
        return [((lo,) if shape else (), (hi - lo,) if shape else (), lo)]
    inner = math.prod(shape[1:])
    first, last = lo // inner, hi // inner

    def in_row(row: int, a: int, b: int):
        return [((row, *off), (1, *size), row * inner + start)
                for off, size, start in flat_boxes(shape[1:], a, b)]

    if first == last:
        return in_row(first, lo - first * inner, hi - first * inner)
    boxes = []
    if lo % inner:
        boxes += in_row(first, lo % inner, inner)
        first += 1
    if last > first:
        boxes.append(((first, *[0] * (len(shape) - 1)), (last - first, *shape[1:]),
                      first * inner))
    if hi % inner:
        boxes += in_row(last, 0, hi % inner)
    return boxes


def logical_parts(param: torch.Tensor, lo: int, hi: int,
                  flat: torch.Tensor) -> list[tuple[tuple[int, ...], torch.Tensor]]:
    """The elements [lo, hi) of `param`'s flattened local tensor, held in the 1-D `flat`, as
    (offsets in the logical tensor, view of `flat`) boxes. A tensor-parallel slice shifts the
    box along its dim; tensor-parallel padding (past stop - start) is left out."""
    spec = getattr(param, "_tp_slice", None)
    parts = []
    for offsets, sizes, start in flat_boxes(tuple(param.shape), lo, hi):
        view = flat[start - lo:start - lo + math.prod(sizes)].view(sizes)
        if spec is not None:
            dim, begin, stop = spec
            keep = min(sizes[dim], stop - begin - offsets[dim])
            if keep <= 0:
                continue  # all padding
            view = view.narrow(dim, 0, keep)
            offsets = (*offsets[:dim], offsets[dim] + begin, *offsets[dim + 1:])
        parts.append((offsets, view))
    return parts


def per_expert_parts(name: str, param: torch.Tensor,
                     parts: list[tuple[tuple[int, ...], torch.Tensor]]) -> dict[str, list]:
    """Boxes of a stacked expert weight ([E_local, ...], from `logical_parts`) as boxes of the
    per-expert logical tensors `NAME[j]`: one box per expert row."""
    first = expert_range(param).start
    out: dict[str, list] = {}
    for offsets, view in parts:
        for i in range(view.shape[0]):
            key = expert_key(name, first + offsets[0] + i)
            out.setdefault(key, []).append((tuple(offsets[1:]), view[i]))
    return out
