"""What answers the server's requests: one engine, a tensor-parallel world, or replicas.

    --tp N    rank 0 (this process) runs HTTP and the scheduler; ranks 1..N-1 hold the other
              shards (serve/tp_worker.py). serve spawns them, or, under `fivefold launch
              --nproc-per-node N serve ...`, torchrun started them and each rank runs this
              same command: rank 0 serves, the others work.
    --pp N    pipeline stages, each a run of layers (serve/pp_worker.py); with --tp M each
              stage is M tensor-parallel ranks, N·M in all
    --dp N    N engine replicas behind one endpoint (serve/dp_router.py)
    --lora name=DIR (repeatable)  adapters on the base, chosen per request by its `model`
              (serve/lora_batch.py)

`start(args)` returns the `Backend` for rank 0, or None on a worker rank once rank 0 has
stopped it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from fivefold.errors import ConfigError


@dataclass
class Backend:
    loop: object  # EngineLoop or DPRouter
    codec: object
    num_blocks: int  # per replica
    max_model_len: int
    adapters: list[str] = field(default_factory=list)
    close: Callable[[], None] = lambda: None
    kv_dtype: str = ""  # what the KV cache stores, as torch names it
    notes: list[str] = field(default_factory=list)  # one line each, printed at start-up


def _notes(engine) -> list[str]:
    """The start-up lines an engine has to say (which linears the probe picked)."""
    probe = getattr(engine, "linear_probe", None)
    return [] if probe is None else [probe.describe()]


def check_parallel_args(args) -> None:
    for key in ("tp", "dp"):
        if getattr(args, key) < 1:
            raise ConfigError(f"--{key} {getattr(args, key)} must be >= 1")
    if args.tp > 1 and args.dp > 1:
        raise ConfigError("--tp and --dp together are not supported yet; use one of them")
    if args.tp > 1 and args.lora:
        raise ConfigError("--lora with --tp is not supported yet (adapters are not sharded); "
                          "serve adapters with --tp 1, or --dp for more throughput")
    for spec in args.lora:
        name, _, directory = spec.partition("=")
        if not name or not directory:
            raise ConfigError(f"--lora {spec}: write name=DIR (a PEFT adapter directory or a "
                              f"fivefold LoRA checkpoint)")
    pp = getattr(args, "pp", 1)
    if getattr(args, "async_scheduling", "auto") == "on" and (args.tp > 1 or pp > 1
                                                              or args.lora):
        raise ConfigError("--async-scheduling on runs one engine's own steps: not with --tp, "
                          "--pp or --lora (their steps run synchronously); use auto or off")
    if pp != 1:  # the model's layer count is checked once it is loaded (serve/pp_worker.py)
        from fivefold.serve.pp_worker import check_pp

        check_pp(pp, args.tp, args.dp)
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched > 1 and pp > 1 and launched != pp * args.tp:
        layout = f"--pp {pp}" + (f" --tp {args.tp}" if args.tp > 1 else "")
        raise ConfigError(f"launched {launched} processes but {layout} needs {pp * args.tp}; "
                          f"serve under `fivefold launch --nproc-per-node {pp * args.tp}` or "
                          f"change {layout}")
    if launched > 1 and pp == 1 and launched != args.tp:
        raise ConfigError(f"launched {launched} processes but --tp {args.tp}; serve under "
                          f"`fivefold launch --nproc-per-node {args.tp}` or change --tp")


def engine_kwargs(args, codec) -> dict:
    eos = codec.eos_id
    eos_ids = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    return dict(block_size=args.block_size, max_num_seqs=args.max_num_seqs,
                kv_cache_bytes=None if args.kv_cache_gib is None
                else int(args.kv_cache_gib * 2**30),
                max_num_batched_tokens=args.max_num_batched_tokens,
                chunked_prefill=args.chunked_prefill,
                enable_prefix_caching=not args.no_prefix_caching, eos_token_ids=eos_ids,
                max_model_len=args.max_model_len, detokenize=codec.decode,
                prepack=False if args.no_prepack else "auto",
                kv_cache_dtype=args.kv_cache_dtype,
                cuda_graphs=not getattr(args, "enforce_eager", False),
                async_scheduling=getattr(args, "async_scheduling", "auto"))


def _backend_name(args) -> str:
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return "nccl" if device == "cuda" else "gloo"


def _check_gpus(args, ranks: int) -> None:
    """The ranks serve spawns on CUDA take a GPU each (NCCL refuses two ranks on one)."""
    visible = torch.cuda.device_count() if _backend_name(args) == "nccl" else ranks
    if ranks > visible:
        layout = " ".join(f"--{k} {getattr(args, k)}" for k in ("pp", "tp")
                          if getattr(args, k, 1) > 1)
        raise ConfigError(f"{layout} runs {ranks} ranks, one on each GPU, and {visible} "
                          f"{'is' if visible == 1 else 'are'} visible; lower it, or serve on "
                          f"the CPU with --device cpu")


def _tp_rank_model(args, rank: int, loaded=None):
    """Load the model on one rank (unless `loaded` gives it) and keep this rank's shard."""
    from fivefold.serve.tp_worker import check_tp, shard_model, threads_per_rank, tp_groups
    from fivefold.train.generate import load_for_generation

    torch.set_num_threads(threads_per_rank(args.tp))
    if _backend_name(args) == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    model, codec = loaded or load_for_generation(args)
    check_tp(model.cfg, args.tp)
    groups = tp_groups(args.tp)
    return shard_model(model, groups), codec, groups


def _tp_worker(rank: int, args) -> None:
    import signal

    from fivefold.serve.tp_worker import run_worker

    # Ctrl-C reaches the whole process group and a supervisor's SIGTERM may too: a worker
    # leaves when rank 0, which drains its requests first, says stop (or its link closes).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        model, _, groups = _tp_rank_model(args, rank)
    except ConfigError:
        raise SystemExit(2) from None  # rank 0 checks the same and says it in one line
    run_worker(model, groups)


def _start_tp(args) -> Backend | None:
    import torch.distributed as dist

    from fivefold.serve.openai.serving import EngineLoop
    from fivefold.serve.tp_worker import check_tp, driver_engine, start_world
    from fivefold.train.generate import load_for_generation

    procs, loaded = [], None
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # under fivefold launch / torchrun
        from fivefold.parallel.mesh import init_distributed

        rank, _ = init_distributed(_backend_name(args))
        if rank != 0:
            _tp_worker(rank, args)
            dist.destroy_process_group()
            return None
    else:  # load and check here first: a bad input is one line before any rank starts
        loaded = load_for_generation(args)
        check_tp(loaded[0].cfg, args.tp)
        _check_gpus(args, args.tp)
        procs = start_world(args.tp, _backend_name(args), _tp_worker, (args,))
    model, codec, groups = _tp_rank_model(args, 0, loaded)
    engine = driver_engine(model, groups, **engine_kwargs(args, codec))

    def close():
        try:
            engine.runner.close()
        except RuntimeError:  # a worker is gone already; nothing to tell it
            pass
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():  # out of step: waiting in a collective rank 0 left
                proc.kill()
                proc.join(timeout=5)
        dist.destroy_process_group()

    return Backend(EngineLoop(engine), codec, engine.num_blocks, engine.max_model_len,
                   close=close, kv_dtype=str(engine.cache.k.dtype), notes=_notes(engine))


def _start_pp(args):
    """`fivefold serve --pp N [--tp M]`: rank 0's Backend (the other N·M − 1 ranks spawned
    here), or None on a worker rank under `fivefold launch`."""
    import torch.distributed as dist

    from fivefold.serve.lora_batch import check_adapters
    from fivefold.serve.openai.serving import EngineLoop
    from fivefold.serve.pp_worker import (
        _worker,
        check_pp,
        driver_engine,
        load_adapters,
        stage_model,
    )
    from fivefold.serve.tp_worker import check_tp, start_world, threads_per_rank
    from fivefold.train.generate import load_for_generation

    procs, loaded, adapters, world = [], None, None, args.pp * args.tp
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # under fivefold launch / torchrun
        from fivefold.parallel.mesh import init_distributed

        rank, _ = init_distributed(_backend_name(args))
        if rank != 0:
            _worker(rank, args)
            dist.destroy_process_group()
            return None
    else:  # load and check here first: a bad input is one line before any rank starts
        loaded = load_for_generation(args)
        check_pp(args.pp, args.tp, args.dp, loaded[0].cfg.num_layers)
        if args.tp > 1:
            check_tp(loaded[0].cfg, args.tp)
        if args.lora:  # each adapter read and fitted to the model before any rank starts
            adapters = load_adapters(args)
            check_adapters(loaded[0], adapters)
        _check_gpus(args, world)
        procs = start_world(world, _backend_name(args), _worker, (args,))
    torch.set_num_threads(threads_per_rank(world))
    model, codec, groups, staged = stage_model(args, loaded, adapters)
    engine = driver_engine(model, args.pp, groups, staged, **engine_kwargs(args, codec))

    def close():
        try:
            engine.runner.close()  # the stop message, unless the ranks are out of step
        except RuntimeError:  # a worker is gone already
            pass
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():  # out of step: waiting for what rank 0 never sends
                proc.kill()
                proc.join(timeout=5)
        dist.destroy_process_group()

    return Backend(EngineLoop(engine), codec, engine.num_blocks, engine.max_model_len,
                   adapters=list(staged.names) if staged else [], close=close,
                   kv_dtype=str(engine.cache.k.dtype), notes=_notes(engine))


def start(args) -> Backend | None:
    check_parallel_args(args)
    if getattr(args, "pp", 1) > 1:  # pipeline stages (serve/pp_worker.py)
        return _start_pp(args)
    if args.tp > 1:
        return _start_tp(args)
    from fivefold.serve.engine import Engine
    from fivefold.serve.openai.serving import EngineLoop
    from fivefold.train.generate import load_for_generation

    model, codec = load_for_generation(args)
    adapter_set = None
    if args.lora:
        from fivefold.serve.lora_batch import apply_adapters, load_adapter

        adapters = [load_adapter(*spec.split("=", 1)) for spec in args.lora]
        adapter_set = apply_adapters(model, adapters)
    engines = []
    for replica in range(args.dp):
        replica_model = model
        if args.dp > 1 and next(model.parameters()).is_cuda:
            if torch.cuda.device_count() < args.dp:
                raise ConfigError(f"--dp {args.dp} on CUDA puts one replica on each GPU, and "
                                  f"{torch.cuda.device_count()} are visible; lower --dp")
            replica_model = model if replica == 0 else _copy_to(model, f"cuda:{replica}")
        engine = Engine(replica_model, **engine_kwargs(args, codec))
        if adapter_set is not None:
            from fivefold.serve.lora_batch import attach

            attach(engine, adapter_set)
        engines.append(engine)
    loops = [EngineLoop(e) for e in engines]
    if args.dp == 1:
        loop = loops[0]
    else:
        from fivefold.serve.dp_router import DPRouter

        loop = DPRouter(loops)
    return Backend(loop, codec, engines[0].num_blocks, engines[0].max_model_len,
                   adapters=list(adapter_set.names) if adapter_set else [],
                   kv_dtype=str(engines[0].cache.k.dtype), notes=_notes(engines[0]))


def _copy_to(model, device: str):
    import copy

    return copy.deepcopy(model).to(device)
