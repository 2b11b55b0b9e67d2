"""What the trainer does for mixture-of-experts layers around each step.

Before the micro-batches: every MoE layer learns d(objective)/d(its aux losses), which is
loss_scale / (sequences in the global batch) (see models/moe.py), and clears its counts.

After the optimizer step: one all-reduce over dp×cp of [tokens per expert | balance, z]
for this rank's MoE layers gives the GLOBAL batch's numbers, kept on the device: the step's
record turns them into metrics when it is read (train/step_metrics.py), so the step does
not wait for the device to copy them to the host. Expert parallelism carves its
ranks out of dp×cp, so the same reduction covers it; tp ranks hold identical copies. With
`model.expert_bias_rate` > 0 the global counts update each layer's expert bias
(aux-loss-free balancing), so this all-reduce is part of the step and in the ledger; without
it the reduction only feeds the metrics and is left out of the ledger, as the loss's is.
The metrics of layers on other pipeline stages then arrive by a sum over pp (metrics only).
"""

from __future__ import annotations

import re

import torch

from fivefold.models.moe import MoE, update_expert_bias
from fivefold.parallel import comm

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.mlp$")


def moe_layers_by_index(chunks) -> dict[int, MoE]:
    """This rank's MoE blocks keyed by their layer index in the unsplit model."""
    out = {}
    for chunk in chunks:
        for name, module in chunk.named_modules():
            match = _LAYER.search(name)
            if match and isinstance(module, MoE):
                out[int(match.group(1))] = module
    return out


class MoEStats:
    def __init__(self, chunks, model_cfg, dims, paused_ledger):
        self.layers = moe_layers_by_index(chunks)
        self.cfg, self.dims, self.paused = model_cfg, dims, paused_ledger
        self.all_layers = [i for i in range(model_cfg.num_layers) if model_cfg.is_moe_layer(i)]

    def begin_step(self, loss_scale: float, global_sequences: int) -> None:
        for layer in self.layers.values():
            layer.reset_stats()
            layer.aux_grad_scale = loss_scale / global_sequences

    def set_eval(self) -> None:
        for layer in self.layers.values():
            layer.aux_grad_scale = None

    METRIC_KEYS = ("moe_aux_loss", "moe_balance_loss", "moe_z_loss", "moe_imbalance",
                   "moe_tokens_min", "moe_tokens_max", "moe_max_over_mean")

    def finish_step(self) -> torch.Tensor:
        """Global counts (and the bias update), on the device: the rows [tokens per expert |
        balance, z] of every MoE layer of the model, summed over the global batch. Nothing
        here waits for the device; `metrics(rows.cpu(), ...)` makes the step's MoE metrics
        when its record is read (train/step_metrics.py, at the logging cadence)."""
        e = self.cfg.num_experts
        rows = torch.zeros(len(self.all_layers), e + 2, device=self._device())
        for slot, index in enumerate(self.all_layers):
            if index in self.layers:
                layer = self.layers[index]
                rows[slot, :e] = layer.tokens_per_expert.float()
                rows[slot, e:] = layer.aux_sums[:2].float()
        owned = [slot for slot, index in enumerate(self.all_layers) if index in self.layers]
        whole = owned == list(range(len(self.all_layers)))
        local = rows if whole else rows[owned]
        if owned and self.cfg.expert_bias_rate > 0:
            comm.all_reduce(local, self.dims["dp_cp"])
        elif owned:
            with self.paused(self.dims):
                comm.all_reduce(local, self.dims["dp_cp"])
        if owned and not whole:
            rows[owned] = local
        if owned and self.cfg.expert_bias_rate > 0:
            layers = [self.layers[self.all_layers[s]] for s in owned]
            update_expert_bias(layers, local[:, :e], self.cfg.expert_bias_rate)
        with self.paused(self.dims):
            if self.dims.pp > 1:
                comm.all_reduce(rows, self.dims["pp"])
        return rows

    def _device(self):
        layer = next(iter(self.layers.values()), None)
        return layer.tokens_per_expert.device if layer is not None else torch.device("cpu")

    def metrics(self, rows: torch.Tensor, global_sequences: int) -> dict:
        """The MoE metrics (METRIC_KEYS) of a step from its rows (`finish_step`), on the host."""
        e, c = self.cfg.num_experts, self.cfg
        counts = rows[:, :e]
        balance = rows[:, e] / global_sequences
        z = rows[:, e + 1] / global_sequences
        imbalance = counts.amax(1) / counts.mean(1).clamp_min(1e-12)
        return {
            "moe_aux_loss": float((c.aux_loss_coeff * balance + c.z_loss_coeff * z).sum()),
            "moe_balance_loss": float(balance.mean()),
            "moe_z_loss": float(z.mean()),
            "moe_imbalance": float(imbalance.max()),
            "moe_tokens_min": counts.amin(1).int().tolist(),
            "moe_tokens_max": counts.amax(1).int().tolist(),
            "moe_max_over_mean": [round(float(v), 4) for v in imbalance],
        }

    def expert_biases(self) -> dict[str, torch.Tensor]:
        return {f"layers.{i}.mlp.router.expert_bias": m.router.expert_bias
                for i, m in self.layers.items()}
