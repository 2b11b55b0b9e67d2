"""The trainer: it orchestrates; the parallel modules do the work.

One step:
    micro-batches of this rank  ->  forward/backward of each (loss / tokens of the global batch)
    -> gradient reduction finishes (DP/ZeRO)  ->  clip + optimizer step  ->  metrics

The loss of each micro-batch is its summed token cross-entropy divided by the number of
target tokens in the whole global batch, so accumulation and data parallelism add up to the
same gradient as one big batch, and every data-parallel reduction is a plain sum.
"""

from __future__ import annotations

import os

import torch

from fivefold.config import Config, ConfigError, corpus_tokenizer, resolve_mbs
from fivefold.config.train import resolve_compile
from fivefold.finetune.attach import (
    add_adapters,
    base_tensors,
    describe,
    finish_adapters,
    frozen_state,
    lora_enabled,
)
from fivefold.lowp.delayed import delayed_modules, end_step
from fivefold.models.init import build_meta
from fivefold.parallel import comm, peak
from fivefold.parallel.apply import ParallelModel, parallelize
from fivefold.parallel.mesh import ParallelDims
from fivefold.parallel.watchdog import Watchdog
from fivefold.train import checkpoint as ckpt
from fivefold.train import checkpoint_parts as parts
from fivefold.train.checkpoint_parts import NonFiniteError  # noqa: F401  (re-exported)
from fivefold.train.lifecycle import ledger_paused
from fivefold.train.metrics import (
    Throughput,
    device_peak_flops,
    flops_per_token,
    memory_bytes,
    memory_reserved_bytes,
)
from fivefold.train.optim import MasterWeightOptimizer, lr_at
from fivefold.train.precision import DTYPES, LossScaler, resolve_precision
from fivefold.train.rundir import check_budget_fits
from fivefold.train.step_metrics import StepBook, StepMetrics


def pick_device(spec: str) -> torch.device:
    if spec == "cuda" or (spec == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ConfigError("train.device = 'cuda' but no GPU is visible; use 'cpu' or 'auto'")
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def build_optimizer(model: ParallelModel, dims: ParallelDims, cfg: Config, scaler, watchdog):
    named = model.named_parameters()
    if dims["ep"].size > 1:  # experts over edp, dense weights over dp×cp
        from fivefold.parallel.expert_optim import build_expert_parallel_optimizer

        return build_expert_parallel_optimizer(model, named, dims, cfg, scaler, watchdog)
    if dims["dp_cp"].size > 1 or cfg.parallel.zero > 0:
        from fivefold.parallel.zero import build_data_parallel_optimizer

        return build_data_parallel_optimizer(model, named, dims, cfg, scaler, watchdog)
    return MasterWeightOptimizer(named, cfg.train, dims, scaler, cfg.optim)


class Trainer:
    def __init__(self, cfg: Config, dims: ParallelDims | None = None, quiet: bool = False):
        self.cfg, self.dims = cfg, dims or ParallelDims.single()
        resolve_mbs(cfg)  # a config built in code (not through validate) may still say auto
        tr = cfg.train
        self.device = pick_device(tr.device)
        tr.compile = resolve_compile(tr.compile, self.device.type)  # from here on a bool
        check_budget_fits(cfg, self.device)
        self.precision = resolve_precision(tr.precision, self.device)
        self.dtype = DTYPES[self.precision]
        self.model_cfg = cfg.model.resolve()
        if cfg.parallel.grad_sync == "auto":  # the planner's choice for this GPU
            from fivefold.plan.inputs import resolve_config_grad_sync

            resolve_config_grad_sync(cfg, torch.cuda.get_device_name(self.device)
                                     if self.device.type == "cuda" else None)
        self.is_logger = self.dims.rank == 0 and not quiet
        if tr.deterministic:
            # cuBLAS is deterministic only with a fixed workspace (CUDA docs, "Reproducibility";
            # torch raises without it). Read when the first cuBLAS handle is made, after this.
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True)
        torch.manual_seed(tr.seed)

        self.data = self._open_data()
        plain = build_meta(self.model_cfg)
        self.lora = lora_enabled(cfg)
        if self.lora:  # adapters first: a model transformation before the parallel ones
            add_adapters(plain, cfg.lora)
        self.recompute_policies = None
        if cfg.train.recompute == "auto":  # per-layer choices under the budget (plan/)
            from fivefold.plan.recompute_auto import config_plan

            self.recompute_policies = config_plan(cfg, self.precision)
        self.model = parallelize(plain, self.dims, cfg, self.device, self.dtype,
                                 recompute_policies=self.recompute_policies)
        if self.is_logger and self.model.fp8_line:
            print(self.model.fp8_line, flush=True)
        # delayed FP8 scaling: the linears whose amax records end_step folds each step
        self.fp8_delayed = [m for chunk in self.model.chunks for m in delayed_modules(chunk)]
        if cfg.model.hf_path:
            self._load_hf_weights()
        elif cfg.model.init_from:
            self._load_init_weights()
        if self.lora:  # adapter values, lora.init_from, the quantised base (finetune/)
            finish_adapters(self.model.chunks, self.model.named_parameters(), cfg,
                            self.model_cfg)
            self.lora_summary = describe(self.model.chunks, cfg.lora, self.dims)
        self.scaler = LossScaler(enabled=self.precision == "fp16")
        # Every rank beats a heartbeat; while a step runs, a silent peer ends the run within
        # parallel.timeout_s with its rank named (parallel/watchdog.py).
        self.watchdog = Watchdog(cfg.parallel.timeout_s)
        self.optimizer = None
        try:  # a failure from here on must still stop the watchdog thread (see close)
            self._finish_init(cfg)
        except BaseException:
            self.close()
            raise

    def _finish_init(self, cfg: Config) -> None:
        self.optimizer = build_optimizer(self.model, self.dims, cfg, self.scaler, self.watchdog)
        peak.mark_head(self.model.chunks)  # saved tensors of the head and loss: logits_loss
        self.pipeline = None
        if cfg.parallel.pp > 1:
            from fivefold.parallel.pipeline.runtime import PipelineRunner

            self.pipeline = PipelineRunner(self.model, self.dims, cfg, self.optimizer)
        self.moe = None
        if self.model_cfg.num_experts:
            from fivefold.train.moe_stats import MoEStats

            self.moe = MoEStats(self.model.chunks, self.model_cfg, self.dims, ledger_paused)
        self.step = 0
        self.throughput = Throughput(flops_per_token(self.model_cfg, cfg.train.seq_len),
                                     device_peak_flops(self.device, cfg.log.peak_tflops),
                                     self.dims.world_size)
        self.resumed_from = None
        self.resumed_meta: dict | None = None  # the meta.json of the checkpoint resumed from
        self.book = StepBook(self.throughput, cfg.train.max_bad_steps,
                             counts_bad=not self.scaler.enabled, on_bad_run=self._bad_run)
        self.resume(cfg.checkpoint.dir, cfg.checkpoint.resume)

    # --- set-up -----------------------------------------------------------------------
    def _open_data(self):
        from fivefold.data.loader import BatchLoader, TokenDataset, default_corpus_tokens

        d, tr, par = self.cfg.data, self.cfg.train, self.cfg.parallel
        spec = corpus_tokenizer(d.tokenizer, self.model_cfg.vocab_size)
        path = d.path or default_corpus_tokens(spec)
        ds = TokenDataset.open(path)
        if ds.vocab_size > self.model_cfg.vocab_size:
            other = "" if d.path or spec == "byte" else \
                " or data.tokenizer = byte (256 tokens) for the bundled corpus"
            raise ConfigError(
                f"the tokenizer of {path} has {ds.vocab_size} tokens but model.vocab_size = "
                f"{self.model_cfg.vocab_size}; set model.vocab_size >= {ds.vocab_size}{other}")
        self.tokenizer_spec = ds.tokenizer_spec
        dp_rank = self.dims.dp_rank
        common = dict(seq_len=tr.seq_len, gbs=tr.gbs, mbs=par.mbs, dp_rank=dp_rank, dp=par.dp,
                      seed=tr.seed, val_fraction=d.val_fraction)
        self.loader = BatchLoader(ds, split="train", **common)
        self.val_loader = BatchLoader(ds, split="val", **common) if d.val_fraction > 0 else None
        return ds

    def _load_hf_weights(self) -> None:
        """Checked like `load_hf`; each rank reads only its slices (models/hf_slices.py)."""
        from fivefold.models.hf_slices import load_hf_slices

        named = self.model.named_parameters(frozen=True)
        load_hf_slices(self.cfg.model.hf_path, base_tensors(named) if self.lora else named,
                       self.model_cfg)

    def _load_init_weights(self) -> None:
        """model.init_from: a fivefold checkpoint's weights (a LoRA run's with its adapters
        merged), this rank's slice of each; the optimizer, built next, starts afresh."""
        from fivefold.finetune.attach import load_for_inference
        from fivefold.finetune.inject import merge_and_unload
        from fivefold.parallel.shards import local_piece

        source, _, _, lora = load_for_inference(self.cfg.model.init_from)
        if lora:
            source = merge_and_unload(source)
        full = dict(source.named_parameters())
        named = self.model.named_parameters(frozen=True)
        with torch.no_grad():
            for name, p in base_tensors(named) if self.lora else named:
                p.copy_(local_piece(p, full[name].detach()).to(p.dtype))
            for chunk in self.model.chunks:  # the routers' aux-loss-free biases route too
                for name, bias in chunk.named_buffers():
                    if name.endswith("router.expert_bias"):
                        bias.copy_(source.get_buffer(name))

    # --- one step ---------------------------------------------------------------------
    def shard_sequences(self, micro_batches):
        """Under context parallelism, this cp rank's tokens of every sequence."""
        if self.dims.cp == 1:
            return micro_batches
        from fivefold.parallel.context import shard_batch

        return shard_batch(micro_batches, self.cfg.parallel.cp_layout, self.dims["cp"])

    def _amax_max(self, records: torch.Tensor) -> None:
        """Delayed FP8 scaling's records: one all_reduce(max) over this pipeline stage's
        ranks (`stage`: every rank without pp): dp and cp ranks saw other tokens of the same
        tensors, tp ranks other slices of them (Transformer Engine's amax reduction group);
        other stages hold other layers, with records of their own (lowp/delayed.py)."""
        group = self.dims["stage"]
        if group.size > 1:
            comm.all_reduce(records, group, op="max")

    def forward_backward(self, micro_batches, num_tokens: int) -> torch.Tensor:
        """Run every micro-batch; returns this rank's summed loss (0 off the last stage)."""
        if self.pipeline is not None:
            return self.pipeline.run(micro_batches, num_tokens, self.scaler.scale)
        model = self.model.chunks[0]
        total = torch.zeros((), device=self.device)
        for i, (inputs, targets) in enumerate(micro_batches):
            self.optimizer.prepare_backward(final_microbatch=i == len(micro_batches) - 1)
            with peak.saving():
                # non_blocking: the host goes on queueing; the copy waits on the stream
                loss_sum = model(inputs.to(self.device, non_blocking=True),
                                 targets.to(self.device, non_blocking=True))
            peak.sample("end of forward")
            (loss_sum * self.scaler.loss_factor(num_tokens)).backward()
            total += loss_sum.detach()
        return total

    def peak_sources(self) -> dict[str, peak.Source]:
        """Everything this rank holds, by planner item, for a `peak.PeakTracker` around a
        step: the optimizer's model states and buffers, then the saved activations."""
        params = [p for _, p in self.model.named_parameters(frozen=True)]
        sources = {**self.optimizer.peak_sources(), **peak.activation_sources(params)}
        if self.lora:  # the frozen (maybe quantised) base is model state the optimizer lacks
            trainable = sources["params"]
            # ZeRO-3's gathered frozen blocks are comm buffers (the optimizer names them)
            sharded = getattr(self.optimizer, "frozen", None)
            gathered = {t.untyped_storage()._cdata for t in sharded.full} if sharded else set()
            sources["params"] = lambda: [*trainable(), *(
                t for t in frozen_state(self.model.chunks)
                if t.untyped_storage()._cdata not in gathered)]
        return sources

    def global_loss_sum(self, local_sum: torch.Tensor) -> torch.Tensor:
        """The loss summed over the global batch's target tokens, on every rank (a 0-d fp32
        tensor on the device: nothing waits for it)."""
        with ledger_paused(self.dims):
            total = local_sum.detach().clone().float()
            comm.all_reduce(total, self.dims["dp_cp"])
            if self.pipeline is not None:  # from the pp rank of the last stage
                comm.broadcast(total, self.pipeline.loss_pp_rank, self.dims["pp"])
        return total

    def global_loss(self, local_sum: torch.Tensor, num_tokens: int) -> float:
        """Mean loss per target token of the global batch, known on every rank."""
        return float(self.global_loss_sum(local_sum)) / num_tokens

    TRACKED_STEPS = 2  # the second step is the first with Adam's moments: the steady peak

    def train_step(self) -> dict:
        """One optimizer step. Its record's `peak_allocated_bytes` is what the planner's
        `peak ... allocated` predicts and train.memory_budget_gib bounds: on CUDA the
        allocator's peak; on a CPU, for a run that logs, the peak of the storages this rank
        holds (parallel/peak.py), counted over the first TRACKED_STEPS steps, whose shapes
        every later step repeats. `memory_bytes` stays the CUDA peak or the process RSS."""
        if self.device.type == "cuda":
            rec = self._train_step()
            rec["peak_allocated_bytes"] = rec["memory_bytes"]
            return rec
        if self.is_logger and self.step < self.TRACKED_STEPS and not peak.active():
            with peak.PeakTracker(self.peak_sources()) as tracker:
                rec = self._train_step()
            self.tracked_peak = max(getattr(self, "tracked_peak", 0), tracker.peak)
        else:
            rec = self._train_step()
        rec["peak_allocated_bytes"] = getattr(self, "tracked_peak", None)
        return rec

    def _train_step(self) -> StepMetrics:
        """One step, queued without waiting for the device: its loss, norm and skip flag
        stay tensors in the record until it is read (train/step_metrics.py)."""
        self.book.begin()
        self.model.train()
        self.dims.ledger.reset()
        micro_batches = self.loader.next_batch()
        num_tokens = self.loader.num_target_tokens  # of the global batch, before any cp split
        micro_batches = self.shard_sequences(micro_batches)
        self.watchdog.arm()
        self.optimizer.zero_grad()
        if self.moe is not None:
            self.moe.begin_step(self.scaler.scale, self.cfg.train.gbs)
        loss_sum = self.forward_backward(micro_batches, num_tokens)
        # the step's amax records, max over the ranks that saw other tokens (lowp/delayed.py)
        end_step(self.fp8_delayed, self._amax_max)
        self.optimizer.finish_grad_sync()
        lr = lr_at(self.step, self.cfg.train)
        stats = self.optimizer.step(lr, loss=loss_sum)
        moe_rows = self.moe.finish_step() if self.moe is not None else None
        total = self.global_loss_sum(loss_sum)
        self.watchdog.disarm()
        self.step += 1
        tokens = self.cfg.train.gbs * self.cfg.train.seq_len
        norm, skipped, scale = stats.values()
        return self.book.add(
            {"kind": "train", "step": self.step, "loss": None, "lr": lr, "grad_norm": None,
             "skipped": None, "bad": None, "loss_scale": None, "tokens": tokens,
             "tokens_per_s": None, "step_time_s": None, "mfu": None,
             "memory_bytes": memory_bytes(self.device),
             **({"memory_reserved_bytes": memory_reserved_bytes(self.device)}
                if self.device.type == "cuda" else {})},
            {"loss_sum": total, "grad_norm": norm, "skipped": skipped, "loss_scale": scale},
            num_tokens, tokens, later=self._moe_metrics(moe_rows))

    def _moe_metrics(self, rows) -> dict:
        """The MoE metrics of the step, made from its rows when the record is read."""
        if rows is None:
            return {}
        gbs, moe = self.cfg.train.gbs, self.moe
        return {moe.METRIC_KEYS: (rows, lambda host: moe.metrics(host, gbs))}

    def settle(self, check: bool = True) -> list[StepMetrics]:
        """Read the records of the steps not read yet (one wait for the device) and return
        them; raises BadStepsError when they hold `train.max_bad_steps` bad steps in a row
        (with check=False, the next `settle` or `book.check_bad_steps()` does)."""
        return self.book.settle(check)

    @property
    def bad_steps(self) -> int:
        """Non-finite steps in a row, as of the last record read."""
        return self.book.bad_steps

    def _bad_run(self, first: int, last: int) -> None:
        from fivefold.train.lifecycle import BadStepsError

        done = ckpt.resolve(self.cfg.checkpoint.dir, "auto")
        raise BadStepsError(
            f"steps {first}-{last} had a non-finite loss or gradient (train.max_bad_steps = "
            f"{self.cfg.train.max_bad_steps} in a row); stopping without saving. The last good "
            f"checkpoint is {done or 'none (nothing was saved)'}: lower train.lr, or check the "
            f"data")

    @torch.no_grad()
    def evaluate(self) -> dict:
        """Validation loss and perplexity over `train.eval_batches` held-out global batches."""
        import math

        self.model.train(False)
        self.val_loader.reset()
        total, count = 0.0, 0
        for _ in range(self.cfg.train.eval_batches):
            micro_batches = self.val_loader.next_batch()
            num_tokens = self.val_loader.num_target_tokens
            micro_batches = self.shard_sequences(micro_batches)
            if self.pipeline is not None:
                local = self.pipeline.forward_only(micro_batches)
            else:
                local = sum(self.model.chunks[0](x.to(self.device), y.to(self.device))
                            for x, y in micro_batches)
            total += self.global_loss(torch.as_tensor(local, device=self.device), 1)
            count += num_tokens
        loss = total / count
        return {"kind": "val", "step": self.step, "val_loss": loss,
                "val_perplexity": math.exp(min(loss, 50.0))}

    # --- checkpoints: train/checkpoint_parts.py ----------------------------------------
    def logical_tensors(self) -> dict[str, torch.Tensor]:
        return parts.logical_tensors(self)

    def checkpoint_parts(self, load: bool = False, convert_from: str | None = None
                         ) -> dict[str, ckpt.Chunked]:
        return parts.checkpoint_parts(self, load, convert_from)

    def trainer_state(self) -> dict:
        return parts.trainer_state(self)

    def nonfinite_tensors(self, tensors: dict[str, ckpt.Chunked]) -> int:
        return parts.nonfinite_tensors(self, tensors)

    def save_checkpoint(self) -> None:
        parts.save_checkpoint(self)

    def resume(self, root: str, mode: str) -> None:
        """Load the first of `ckpt.candidates` that loads (train/recovery.py)."""
        from fivefold.train.recovery import resume

        resume(self, root, mode)

    def load_checkpoint(self, path) -> str | None:
        return parts.load_checkpoint(self, path)

    # --- the end -----------------------------------------------------------------------
    def close(self) -> None:
        """Stop the watchdog thread (joined) and detach the optimizer's hooks. Idempotent;
        every exit path of a run calls it before the process group is destroyed."""
        if getattr(self, "_closed", False):
            return
        self._closed = True
        self.watchdog.close()
        close = getattr(self.optimizer, "close", None)
        if close is not None:
            close()

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
