"""Trace one real training step (or any callable) on the meta device.

The engine's own `Trainer` is built and stepped with its device set to `meta`: every device
tensor has a shape and no data, so an 8B-shaped model costs no memory, and every
`device.type != "cpu"` branch takes the path it takes on a GPU (a "cuda" device, even a fake
one, needs a CUDA build of torch). Host tensors stay real: the data are the config's real
batches, and host code that reads its tensors runs as it does in training.

Covered: one rank (parallel.dp·tp·pp·cp = 1), eager (train.compile off: compiled code does
not run on meta). `.item()` on the device gives 0 for integers and booleans, 1.0 for floats
(counter.py): a step that branches on a value takes the branch of a finite, clean step.
"""

from __future__ import annotations

import copy
import dataclasses
from contextlib import ExitStack, contextmanager

from fivefold.config import ConfigError
from fivefold.trace.counter import OpCounter
from fivefold.trace.gpu_paths import SM90, gpu_attention, gpu_fp8, gpu_optimizer
from fivefold.trace.parts import PartTracker
from fivefold.trace.record import StepTrace
from fivefold.trace.roofline import DEFAULT_LAUNCH_US, DEFAULT_VIEW_US, device_for, simulate

# What a traced step does not need (as `fivefold bench`'s defaults): no checkpoints, no
# validation, no log files.
TRACE_DEFAULTS = ["--train.eval_every", "0", "--checkpoint.every", "0", "--checkpoint.resume",
                  "never", "--log.progress", "false", "--log.tensorboard", "false"]
COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "all_to_all",
               "batch_p2p", "barrier")


def load_config(path=None, overrides: list[str] | None = None):
    """A training config as `fivefold train` reads it, with TRACE_DEFAULTS first."""
    from fivefold import config

    return config.load(path, [*TRACE_DEFAULTS, *(overrides or [])])


def _compiles(value) -> bool:
    return value is True or str(value).lower() in ("true", "on", "1", "yes")


def check_traceable(cfg, gpu: str, launch_us: float = DEFAULT_LAUNCH_US,
                    view_us: float = DEFAULT_VIEW_US):
    """Bad input, refused in one line before anything runs: a layout beyond one rank, a
    compiled step, an unknown GPU, a config whose planned memory does not fit the GPU."""
    par = cfg.parallel
    world = par.dp * par.tp * par.pp * par.cp
    if world != 1:
        raise ConfigError(f"trace covers one rank; parallel.dp·tp·pp·cp = {world}: set "
                          f"--parallel.dp 1 --parallel.tp 1 --parallel.pp 1 --parallel.cp 1")
    if _compiles(getattr(cfg.train, "compile", False)):
        raise ConfigError("trace runs the eager step (compiled code does not run on the meta "
                          "device); drop train.compile or set --train.compile false")
    dev, hw, assume = device_for(gpu, launch_us, view_us=view_us)
    if cfg.train.precision == "auto":  # what 'auto' resolves to on a GPU
        cfg.train.precision = "bf16" if hw.bf16_tflops > 0 else "fp32"
    return dev, hw, assume


def planner_view(cfg, model_cfg, precision: str, hw, assume) -> dict:
    """The planner's prediction for the config on `hw`: step time by part, memory fit."""
    from fivefold.plan.evaluate import plan_layout
    from fivefold.plan.inputs import training_plan_inputs

    work, layout = training_plan_inputs(cfg, hw, assume)
    work = dataclasses.replace(work, model=model_cfg, precision=precision)
    plan = plan_layout(work, layout, hw, assume)
    return {"step_time_s": plan.time.total, "parts_s": plan.time.parts(),
            "fits": plan.fits, "memory": plan.why,
            "peak_allocated_bytes": plan.peak_allocated}


@contextmanager
def _patched(obj, name: str, value):
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


def _no_values(cfg, name, shape, seed, experts=None):
    """`models/init.py` draws every initial value on the host (an 8B model's would be GBs
    and a minute here); the meta device holds no values, so the trace draws none."""
    import torch

    shape = tuple(shape)
    if experts is not None:
        shape = (len(experts), *shape[1:])
    return torch.empty(shape, device="meta")


def _in_phase(tracker: PartTracker, name: str, fn):
    def wrapped(*args, **kwargs):
        with tracker.phase(name):
            return fn(*args, **kwargs)
    return wrapped


def trace_step(cfg=None, gpu: str = "h100", steps: int = 2, launch_us: float = DEFAULT_LAUNCH_US,
               progress=None, planner: bool = True, view_us: float = DEFAULT_VIEW_US
               ) -> StepTrace:
    """Run `steps` real training steps of `cfg` on the meta device; trace the last one.

    cfg: a Config (copied, with TRACE_DEFAULTS' checkpoint and validation settings), a list
    of `--section.key VALUE` overrides of the default config, or None (the default config).
    The second step is the first with the optimizer's states in place: the steady state.
    `progress(text)` hears of each stage. The planner's prediction (`planner_view`) goes
    beside the trace unless planner=False; a config that does not fit `gpu` is refused
    (ConfigError)."""
    import torch

    say = progress or (lambda text: None)
    if cfg is None or isinstance(cfg, list):
        cfg = load_config(None, cfg)
    else:
        cfg = copy.deepcopy(cfg)
        cfg.checkpoint.resume, cfg.checkpoint.every, cfg.train.eval_every = "never", 0, 0
    dev, hw, assume = check_traceable(cfg, gpu, launch_us, view_us)
    from fivefold.train import trainer as trainer_mod

    model_cfg = cfg.model.resolve()
    plan = planner_view(cfg, model_cfg, cfg.train.precision, hw, assume) if planner else None
    if plan is not None and not plan["fits"]:
        raise ConfigError(f"the config does not fit one {dev.name} ({plan['memory']}): lower "
                          f"train.seq_len, parallel.mbs or model.num_layers, or pick a larger "
                          f"--gpu")
    tracker = PartTracker()
    counter = OpCounter(tracker.current, "meta")
    counter.enabled = False
    kept, first = [], None
    with ExitStack() as stack:
        stack.enter_context(gpu_attention())
        stack.enter_context(gpu_optimizer())
        stack.enter_context(gpu_fp8(dev.name.startswith(SM90)))
        from fivefold.models import init as init_mod
        from fivefold.models import loss as loss_mod

        # the fused loss sizes its chunks by the traced GPU's memory (models/loss_chunks.py;
        # an older engine traced by bench/train/trace_revision.py has no such setting)
        if hasattr(loss_mod, "META_DEVICE_MEMORY"):
            stack.enter_context(_patched(loss_mod, "META_DEVICE_MEMORY",
                                         dev.memory_gib * 2**30))

        stack.enter_context(_patched(init_mod, "init_value", _no_values))
        stack.enter_context(_patched(trainer_mod, "pick_device",
                                     lambda spec: torch.device("meta")))
        say(f"building {model_cfg.num_layers} layer(s) of hidden {model_cfg.hidden_size} on "
            f"the meta device")
        tr = trainer_mod.Trainer(cfg, quiet=True)
        stack.callback(tr.close)
        opt = tr.optimizer
        for method, phase in (("step", "optimizer"), ("zero_grad", "zero_grad"),
                              ("finish_grad_sync", "grad_sync")):
            if hasattr(opt, method):
                stack.enter_context(_patched(opt, method,
                                             _in_phase(tracker, phase, getattr(opt, method))))
        from fivefold.parallel import comm

        for op in COLLECTIVES:
            if hasattr(comm, op):
                stack.enter_context(_patched(comm, op, _in_phase(
                    tracker, f"collective.{op}", getattr(comm, op))))
        tracker.attach([("", c) for c in tr.model.chunks])
        stack.callback(tracker.detach)
        stack.enter_context(counter)
        for i in range(steps):
            counter.events = []
            counter.enabled = True
            try:
                tr.train_step()
            finally:
                counter.enabled = False
            kept = counter.events
            n = sum(1 for e in kept if e.kind == "kernel")
            say(f"step {i + 1}/{steps}: {n} kernels")
            if i == 0 and steps > 1:
                one = StepTrace.from_events(kept)
                first = {"kernels": one.kernels, "syncs": one.syncs,
                         "syncs_by_kind": one.syncs_by_kind(), "bytes": one.bytes}
    timeline = simulate(kept, dev)
    setup = {"model": cfg.model.preset or "custom", "num_layers": model_cfg.num_layers,
             "hidden_size": model_cfg.hidden_size, "vocab_size": model_cfg.vocab_size,
             "seq_len": cfg.train.seq_len, "gbs": cfg.train.gbs, "mbs": cfg.parallel.mbs,
             "precision": cfg.train.precision, "recompute": cfg.train.recompute,
             "steps_run": steps, "launch_us": launch_us, "view_us": view_us,
             "device": "meta"}
    return StepTrace.from_events(kept, gpu=dev.name, timeline=timeline, planner=plan,
                                 setup=setup, first_step=first)


def trace_callable(fn, *args, gpu: str | None = "h100", modules=None,
                   launch_us: float = DEFAULT_LAUNCH_US, view_us: float = DEFAULT_VIEW_US,
                   **kwargs) -> StepTrace:
    """Trace `fn(*args, **kwargs)` under the same counters as a step.

    Tensors on the meta device stand for the GPU's (make them with device="meta", or
    inside `fn`); ops on host tensors are host work, not kernels. `modules`: (name, module)
    pairs whose forward and backward ops are attributed to parts by `parts.part_name`;
    everything else is the part "step". With a GPU name, the roofline timeline too."""
    tracker = PartTracker()
    if modules:
        tracker.attach(list(modules))
    counter = OpCounter(tracker.current, "meta")
    try:
        with gpu_attention(), counter:
            fn(*args, **kwargs)
    finally:
        tracker.detach()
    timeline = None
    if gpu is not None:
        dev, _, _ = device_for(gpu, launch_us, view_us=view_us)
        timeline = simulate(counter.events, dev)
        gpu = dev.name
    return StepTrace.from_events(counter.events, gpu=gpu, timeline=timeline)
