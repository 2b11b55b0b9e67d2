"""lm-evaluation-harness over fivefold checkpoints: the model class "fivefold".

Importing this module registers `FivefoldLM` with lm_eval's model registry (lm_eval 0.4:
`lm_eval.api.registry.register_model`), so after `import fivefold.evaluate.harness`

    lm_eval.simple_evaluate(model="fivefold", model_args="checkpoint=runs/default/checkpoints",
                            tasks=[...])

runs any lm-eval task on a fivefold checkpoint (or `hf=DIR`), and `fivefold eval --lm-eval
TASKS` does the same from the command line. The answers come from evaluate/lm.py; this file
only adapts lm_eval's request objects (`Instance.args`) to it. lm_eval is the optional extra
`fivefold[eval]`; without it importing this module is one line naming the extra.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

from fivefold.evaluate.lm import FivefoldScorer, encode_plain
from fivefold.extras import require

require("lm_eval", "eval", "the lm-evaluation-harness adapter")
from lm_eval.api.model import LM  # noqa: E402 (after the one-line check above)
from lm_eval.api.registry import register_model  # noqa: E402


def prefix_token(codec, hf_dir: str | None) -> int:
    """BOS where the model has one (an HF config's bos_token_id), else the end-of-text id."""
    if hf_dir:
        config = Path(hf_dir) / "config.json"
        bos = json.loads(config.read_text()).get("bos_token_id") if config.is_file() else None
        if isinstance(bos, int):
            return bos
    eos = getattr(codec, "eos_id", None)
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    if eos is None:
        eos = (encode_plain(codec, "\n") or [0])[0]
    return int(eos)


@register_model("fivefold")
class FivefoldLM(LM):
    """lm_eval's LM over a fivefold model: `checkpoint=C` or `hf=DIR` (model_args), with
    optional `max_length`, `device` (auto, cpu, cuda), `dtype` (fp32, bf16, auto) and
    `tokenizer` (with hf=DIR lacking a tokenizer.json: byte, corpus-bpe or a file)."""

    def __init__(self, checkpoint: str | None = None, hf: str | None = None,
                 device: str = "cpu", dtype: str = "fp32", max_length: int | None = None,
                 tokenizer: str | None = None,
                 **_ignored):  # lm_eval also passes batch_size and max_batch_size
        super().__init__()
        from fivefold.config import ConfigError
        from fivefold.evaluate.loading import load_model

        if bool(checkpoint) == bool(hf):
            raise ConfigError("the fivefold lm-eval model needs exactly one of checkpoint=DIR "
                              "or hf=DIR in model_args")
        model, codec = load_model(SimpleNamespace(checkpoint=checkpoint, hf=hf,
                                                  device=device or "cpu", dtype=dtype,
                                                  tokenizer=tokenizer))
        self.scorer = FivefoldScorer(model, codec, prefix_token(codec, hf),
                                     int(max_length) if max_length else None)

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        return [self.scorer.loglikelihood(*request.args) for request in requests]

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        return [self.scorer.loglikelihood_rolling(request.args[0]) for request in requests]

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        return [self.scorer.generate_until(*request.args) for request in requests]


def task_manager(tasks: list[str], include_path: str | None = None):
    """lm_eval's TaskManager for `tasks` (lm_eval's own task names, or, with include_path,
    only the task files found there: lm_eval's thousands of built-in ones are not indexed
    then), after checking that every task is known."""
    from lm_eval.tasks import TaskManager

    from fivefold.config import ConfigError

    manager = (TaskManager(include_path=include_path, include_defaults=False) if include_path
               else TaskManager())
    unknown = [task for task in tasks if task not in manager.all_tasks]
    if unknown or not tasks:
        where = f"in {include_path}" if include_path else "in lm_eval"
        raise ConfigError(f"--lm-eval task '{unknown[0] if unknown else ''}' is not a task "
                          f"{where}; known: {', '.join(manager.all_tasks[:8])}"
                          f"{', ...' if len(manager.all_tasks) > 8 else ''}")
    return manager


def run_tasks(lm: LM, tasks: list[str], include_path: str | None = None,
              limit: int | None = None, manager=None) -> dict:
    """lm_eval.simple_evaluate of `lm` on `tasks`: {task: {metric: value}}."""
    import lm_eval

    manager = manager or task_manager(tasks, include_path)
    out = lm_eval.simple_evaluate(model=lm, tasks=tasks, task_manager=manager, limit=limit,
                                  log_samples=False, bootstrap_iters=0)
    return {task: {k: v for k, v in metrics.items() if isinstance(v, int | float)}
            for task, metrics in out["results"].items()}
