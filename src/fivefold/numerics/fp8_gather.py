"""ZeRO-3's FP8 gather packed and unpacked (parallel.fp8_allgather, parallel/zero3_fp8.py):
the eager torch ops (the CPU's path) and one fused kernel each (a GPU's), byte for byte the
same messages, codes and dequantised weights.

A unit's gather is a list of pieces per rank, rows (source, destination, elements, k): k >= 0
a run of weight k's elements (cast to E4M3 with its multiplier m_k = mult[k]; dequantised
with scale[k] = 1 / m_k), k = -1 a run of other parameters (norms, padding) that travels as
raw bytes of the dtype (B bytes an element). Offsets count elements in the shard and in the
unit's buffers and bytes in the messages.

    path    pack (a rank's 1/dp, per weight element)     unpack (every element)
    eager   zero the message (1); to fp32 (B + 4),        code copied out (2); to fp32 (5);
            times m (8), clamped (8), to e4m3 (5),        times the scale (8); to the dtype
            copied into the message (2): B + 28           (4 + B); into `full` (2B): 19 + 3B
    fused   x read, its code written: B + 1               the code read, written to the byte
            (`fp8_gather_pack`)                           buffer and its value to `full`: 2 + B
                                                          (`fp8_gather_unpack`)

Each fused op is one Triton kernel (numerics/fp8_gather_triton.py) over all of a unit's
pieces, registered as a torch custom op so that a trace (fivefold.trace) sees one op with
its bytes. The unpack writes its two buffers without reading them (trace/counter.py
WRITE_ONLY_ARGS). The fused pack leaves the message's tail, beyond this rank's pieces, as it
was allocated (the eager one zeroes it): no rank reads it (the ranks' messages are padded
to the longest rank's, parallel/zero3_fp8.py).

Where the ops run: a GPU with Triton (and any device under TRITON_INTERPRET=1, for the
tests) launches the kernel; a GPU without Triton runs the eager ops inside the op (reading
its table to the host: a sync, on such a GPU only); on meta (a trace) the fake
implementations give the outputs.
"""

from __future__ import annotations

import torch

from fivefold.numerics.formats import E4M3
from fivefold.numerics.kernel_support import triton_usable

try:
    import triton

    from fivefold.numerics import fp8_gather_triton as kernels
except ImportError:  # pragma: no cover - depends on the installation
    triton = None

BLOCK = 1024  # elements per program
FIELDS = 5  # a table row: (first block, source, destination, elements, k)


# ---- the eager path ----------------------------------------------------------------------

def pack_eager(local: torch.Tensor, rows: list, mult: torch.Tensor, message: int
               ) -> torch.Tensor:
    """A rank's message (`message` bytes, zero beyond its pieces) of its shard `local`:
    rows (element in local, byte in the message, elements, k), numerics.fp8.quantize's
    tensorwise cast with the whole weight's multiplier (saturating: a delayed scale may lie
    below the piece's amax)."""
    send = torch.zeros(message, dtype=torch.uint8, device=local.device)
    es = local.element_size()
    for src, dst, n, k in rows:
        x = local[src:src + n]
        if k < 0:
            send[dst:dst + n * es] = x.view(torch.uint8)
        else:
            q = (x.float() * mult[k]).clamp(-E4M3.max, E4M3.max).to(E4M3.dtype)
            send[dst:dst + n] = q.view(torch.uint8)
    return send


def unpack_eager(out: torch.Tensor, rows: list, scales: torch.Tensor, codes: torch.Tensor,
                 full: torch.Tensor) -> None:
    """The gathered messages `out` into the unit's byte buffer `codes` (uint8) and its
    `full` buffer: rows (byte in out, element in the unit, elements, k)."""
    es = full.element_size()
    for src, dst, n, k in rows:
        if k < 0:
            full[dst:dst + n] = out[src:src + n * es].view(full.dtype)
        else:
            piece = codes[dst:dst + n]
            piece.copy_(out[src:src + n])
            full[dst:dst + n] = (piece.view(E4M3.dtype).float() * scales[k]).to(full.dtype)


# ---- the fused path's tables -------------------------------------------------------------

def table(rows: list, es: int, raw_bytes_at: int, device: torch.device
          ) -> tuple[torch.Tensor, int]:
    """(the kernels' int64 table (P, 5), blocks: the launch's programs) of `rows`; a raw
    piece's byte offset (field `raw_bytes_at`: 1 the source, 2 the destination) becomes
    an offset in elements of the dtype (`es` bytes)."""
    out, blocks = [], 0
    for src, dst, n, k in rows:
        fields = [blocks, src, dst, n, k]
        if k < 0:
            if fields[raw_bytes_at] % es:
                raise ValueError(f"a raw piece at byte {fields[raw_bytes_at]} is not aligned "
                                 f"to its {es}-byte dtype")
            fields[raw_bytes_at] //= es
        out.append(fields)
        blocks += -(-n // BLOCK)
    return torch.tensor(out, dtype=torch.int64).reshape(-1, FIELDS).to(device), blocks


def _rows(table: torch.Tensor, es: int, raw_bytes_at: int) -> list:
    """The eager path's rows of a kernel table (its inverse)."""
    rows = []
    for _, src, dst, n, k in table.tolist():
        fields = [0, src, dst, n, k]
        if k < 0:
            fields[raw_bytes_at] *= es
        rows.append(tuple(fields[1:]))
    return rows


def _block_of_table(t: torch.Tensor) -> int:
    return triton.next_power_of_2(max(1, t.shape[0]))


# ---- the fused ops -----------------------------------------------------------------------

@torch.library.custom_op("fivefold::fp8_gather_pack", mutates_args=())
def fp8_gather_pack(local: torch.Tensor, table: torch.Tensor, blocks: int,
                    mult: torch.Tensor, message: int) -> torch.Tensor:
    """A rank's message (uint8, `message` bytes) of its shard `local`: each FP8 piece's
    codes, each raw piece's bytes (`table`: `table(rows, es, 2, ...)`), one kernel."""
    if not triton_usable(local.device):
        return pack_eager(local, _rows(table, local.element_size(), 2), mult, message)
    send = torch.empty(message, dtype=torch.uint8, device=local.device)
    if blocks:
        kernels.gather_pack_kernel[(blocks,)](
            local, table, table.shape[0], mult, send, send.view(local.dtype),
            FMAX=E4M3.max, MBITS=E4M3.mantissa_bits, BIAS=2 ** (E4M3.exponent_bits - 1) - 1,
            PB=_block_of_table(table), BLOCK=BLOCK)
    return send


@fp8_gather_pack.register_fake
def _(local, table, blocks, mult, message):
    return local.new_empty((message,), dtype=torch.uint8)


@torch.library.custom_op("fivefold::fp8_gather_unpack", mutates_args=("codes", "full"))
def fp8_gather_unpack(out: torch.Tensor, table: torch.Tensor, blocks: int,
                      scales: torch.Tensor, codes: torch.Tensor, full: torch.Tensor) -> None:
    """The gathered messages `out` (uint8) into the unit's byte buffer `codes` (uint8) and
    its `full` buffer, every rank's pieces (`table`: `table(rows, es, 1, ...)`), one
    kernel."""
    if not triton_usable(out.device):
        unpack_eager(out, _rows(table, full.element_size(), 1), scales, codes, full)
        return
    if blocks:
        kernels.gather_unpack_kernel[(blocks,)](
            out, out.view(full.dtype), table, table.shape[0], scales, codes, full,
            PB=_block_of_table(table), BLOCK=BLOCK)


@fp8_gather_unpack.register_fake
def _(out, table, blocks, scales, codes, full):
    return None
