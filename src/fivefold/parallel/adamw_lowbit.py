"""AdamW with 8-bit or 4-bit moments (`train.optimizer = adamw8bit | adamw4bit`).

The update is AdamW's (Loshchilov & Hutter 2019), computed in fp32 from the dequantised
moments; the new moments are quantised back (numerics/optim_states.py) and the weight step
uses their fp32 values before quantisation, as torchao's `single_param_adam` does:

    p ← p − lr·λ·p
    m ← lerp(deq(m), g, 1 − β1)        v ← lerp(deq(v), g², 1 − β2)      (then re-quantised)
    p ← p − lr · (m / (1 − β1^t)) / (sqrt(v) / sqrt(1 − β2^t) + ε)

Elementwise, so a piece is updated alone: under ZeRO the flat layout puts every shard
boundary on a quantisation block boundary (`FlatLayout(align=…)`), so each rank quantises
whole blocks of the logical tensor, the same blocks as one device, and the sharded run is
bit-identical to the single-process one. Tensors below `MIN_QUANTISED` values, or not a
whole number of blocks, keep fp32 moments (as torchao).
"""

from __future__ import annotations

import torch

from fivefold.numerics.optim_states import QuantState, block_size, quantisable
from fivefold.parallel.optim_base import PieceOptimizer, derived, piece_view


class AdamWLowBit(PieceOptimizer):
    SHAPED_KEYS = ("exp_avg", "exp_avg_sq")  # what shaped_states may return

    def __init__(self, masters, infos, tr, bits: int, assembler=None):
        super().__init__(masters, infos, tr, assembler)
        self.bits = bits
        self.quantised = {id(m): quantisable(self._logical_numel(i), bits)
                          for m, i in zip(masters, infos)}
        self.derived = {}
        for m, info in zip(masters, infos):
            if self.quantised[id(m)]:  # checks the layout keeps the blocks whole
                self.derived[id(m)] = (derived(info, block_size(bits), "quantisation blocks"),
                                       derived(info, 2, "4-bit code pairs") if bits == 4
                                       else None)
            self.reset_state(m)

    @staticmethod
    def _logical_numel(info) -> int:
        n = 1
        for s in info.logical_shape:
            n *= s
        return n

    def reset_state(self, master: torch.Tensor) -> None:
        n = master.numel()
        if self.quantised[id(master)]:
            self.state[master] = {
                "exp_avg": QuantState.zeros(n, self.bits, True, master.device),
                "exp_avg_sq": QuantState.zeros(n, self.bits, False, master.device)}
        else:
            self.state[master] = {"exp_avg": torch.zeros(n, device=master.device),
                                  "exp_avg_sq": torch.zeros(n, device=master.device)}

    def state_tensors(self) -> list[torch.Tensor]:
        out = []
        for st in self.state.values():
            for s in st.values():
                out += [s.codes, s.scale] if isinstance(s, QuantState) else [s]
        return out

    SKIPS_ON_DEVICE = True  # every new value is selected against the old (`kept`)

    @torch.no_grad()
    def step(self, closure=None):
        step_t = self.begin_step()
        beta1, beta2, eps = self.tr.beta1, self.tr.beta2, self.tr.eps
        if not isinstance(step_t, torch.Tensor):
            step_t = torch.tensor(step_t)
        for group in self.param_groups:
            lr = torch.tensor(self.group_lr(group), dtype=torch.float32)
            wd = group["weight_decay"]
            for m in group["params"]:
                g = self.grad(m)
                if g is None:
                    continue
                st = self.state[m]
                p, g = m.view(-1), g.view(-1).float()
                # torchao single_param_adam's operations, in its order (bit-equal when eager)
                p_f32 = p - lr * wd * p
                bc1, bc2 = 1 - beta1 ** step_t, 1 - beta2 ** step_t
                avg = _read(st["exp_avg"]).lerp(g, 1 - beta1)
                avg_sq = _read(st["exp_avg_sq"]).lerp(g.square(), 1 - beta2)
                self._write(st["exp_avg"], avg)
                self._write(st["exp_avg_sq"], avg_sq)
                denom = (avg_sq.sqrt() / bc2.sqrt()) + eps
                p.copy_(self.kept(p_f32 - lr * (avg / bc1) / denom, p))
                del g, avg, avg_sq, denom, p_f32  # this piece's temporaries, before the next

    def _write(self, state, values: torch.Tensor) -> None:
        """Store a new moment, unless the step is skipped on the device: then the old codes
        and scales (or fp32 values) stay, selected, not re-quantised."""
        if self.skip is None:
            return _write(state, values)
        if isinstance(state, QuantState):
            codes, scale = state.quantized(values)
            state.codes.copy_(self.kept(codes, state.codes))
            state.scale.copy_(self.kept(scale, state.scale))
        else:
            state.copy_(self.kept(values, state))

    # --- checkpoints ----------------------------------------------------------------------
    def checkpoint_views(self, master, load, convert_from=None) -> dict:
        st, info = self.state[master], self.info_of[id(master)]
        if not self.quantised[id(master)]:
            return {"exp_avg": st["exp_avg"], "exp_avg_sq": st["exp_avg_sq"]}
        if load and convert_from == "adamw":  # fp32 moments, quantised by `loaded`
            temp = {k: torch.zeros(master.numel()) for k in ("exp_avg", "exp_avg_sq")}
            self.converting[id(master)] = temp
            return temp
        scales, pairs = self.derived[id(master)]
        out = {}
        for key in ("exp_avg", "exp_avg_sq"):
            q = st[key]
            out[f"{key}_codes"] = (q.codes if pairs is None
                                   else piece_view(pairs, info, q.codes))
            out[f"{key}_scale"] = piece_view(scales, info, q.scale)
        return out

    def loaded(self, step: int) -> None:
        for m in self.masters:
            temp = self.converting.get(id(m))
            if temp is not None and step > 0:
                for key, values in temp.items():
                    self.state[m][key].quantize_(values.to(m.device))
        super().loaded(step)

    def shaped_states(self, master) -> dict[str, torch.Tensor]:
        shape = self.info_of[id(master)].param.shape
        if master.numel() != shape.numel():
            shape = (master.numel(),)
        return {k: _read(s).view(shape).clone() for k, s in self.state[master].items()}


def _read(state) -> torch.Tensor:
    return state.dequantize() if isinstance(state, QuantState) else state.float()


def _write(state, values: torch.Tensor) -> None:
    if isinstance(state, QuantState):
        state.quantize_(values)
    else:
        state.copy_(values)
