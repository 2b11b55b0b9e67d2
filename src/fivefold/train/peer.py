"""The Hugging Face `transformers` peer of `fivefold bench --peer hf`.

The same model shape (`AutoModelForCausalLM.from_config` of the config fivefold exports),
the same initial weights and batches, SDPA attention, and the loop a `transformers` user
writes: forward with labels (the library's loss: fp32 logits, cross-entropy summed over the
batch's target tokens), backward, gradient clipping, `torch.optim.AdamW` with torch's
default implementation for the device and the same decay groups, betas, eps and learning
rate schedule. bf16 runs as the `transformers` Trainer runs it (`bf16=True`): fp32 weights
under `torch.autocast`; fivefold keeps bf16 weights with fp32 master copies — the same
arithmetic in the matmuls, different bookkeeping.
"""

from __future__ import annotations

import contextlib
import time

import torch

from fivefold.config import ConfigError
from fivefold.train.step_record import StepRecord, sync


class HFRunner:
    name = "transformers"

    def __init__(self, cfg, trainer):
        try:
            import transformers
        except ImportError:
            raise ConfigError("--peer hf needs the transformers package; pip install "
                              "transformers, or drop --peer") from None
        from fivefold.data.loader import BatchLoader
        from fivefold.models.hf import ours_to_hf
        from fivefold.models.hf_config import hf_config_from_model
        from fivefold.train.optim import decays

        self.cfg, self.device = cfg, trainer.device
        self.precision = trainer.precision
        if self.precision == "fp16":
            raise ConfigError("--peer hf compares fp32 or bf16 runs; set train.precision to "
                              "fp32 or bf16")
        spec = hf_config_from_model(trainer.model_cfg)
        spec.pop("architectures")
        hf_config = transformers.AutoConfig.for_model(**spec)
        self.model = transformers.AutoModelForCausalLM.from_config(
            hf_config, attn_implementation="sdpa", dtype=torch.float32).to(self.device)
        # The starting weights of fivefold's run (its fp32 master copies under bf16).
        states = trainer.optimizer.param_states()
        weights = {ours_to_hf(name): states[name]["master"].float()
                   for name in states}
        missing, unexpected = self.model.load_state_dict(weights, strict=False)
        missing = [k for k in missing if not (cfg.model.resolve().tie_embeddings
                                              and k == "lm_head.weight")]
        if missing or unexpected:
            raise RuntimeError(f"weights do not map onto transformers' Llama: missing "
                               f"{missing}, unexpected {unexpected}")
        named = list(self.model.named_parameters())
        tr = cfg.train
        groups = [{"params": [p for n, p in named if decays(n, p)],
                   "weight_decay": tr.weight_decay},
                  {"params": [p for n, p in named if not decays(n, p)], "weight_decay": 0.0}]
        self.optimizer = torch.optim.AdamW(groups, lr=tr.lr, betas=(tr.beta1, tr.beta2),
                                           eps=tr.eps)
        par = cfg.parallel
        self.loader = BatchLoader(trainer.data, split="train", seq_len=tr.seq_len, gbs=tr.gbs,
                                  mbs=par.mbs, dp_rank=0, dp=1, seed=tr.seed,
                                  val_fraction=cfg.data.val_fraction)
        self.step_index = 0

    def tracked(self) -> tuple[list, list]:
        return [self.model], [self.optimizer]

    def _autocast(self):
        if self.precision == "bf16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def step(self) -> StepRecord:
        from fivefold.train.optim import lr_at

        tr = self.cfg.train
        sync(self.device)
        start, cpu_start = time.perf_counter(), time.process_time()
        micro_batches = self.loader.next_batch()
        num_tokens = self.loader.num_target_tokens
        self.optimizer.zero_grad(set_to_none=True)
        total, forward = 0.0, 0.0
        for inputs, targets in micro_batches:
            inputs, targets = inputs.to(self.device), targets.to(self.device)
            t0 = time.perf_counter()
            with self._autocast():
                # Targets are already shifted: `shift_labels` takes them as they are.
                loss = self.model(input_ids=inputs, labels=targets, shift_labels=targets,
                                  num_items_in_batch=num_tokens).loss
            sync(self.device)
            forward += time.perf_counter() - t0
            loss.backward()
            total += float(loss.detach())
        sync(self.device)
        t1 = time.perf_counter()
        if tr.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), tr.grad_clip)
        lr = lr_at(self.step_index, tr)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        sync(self.device)
        end = time.perf_counter()
        self.step_index += 1
        parts = {"forward": forward, "optimizer": end - t1, "grad_sync_wait": 0.0}
        parts["backward"] = max(end - start - sum(parts.values()), 0.0)
        return StepRecord(total, end - start, parts, time.process_time() - cpu_start)
