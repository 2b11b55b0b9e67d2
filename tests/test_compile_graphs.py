"""How many graphs `train.compile` makes, and that it makes no more after the first step.

Full recomputation (`--train.recompute full`): the checkpoint wrapper sets the replay tape, a
`ContextVar` dynamo cannot trace; compiling the block's call graph-broke there (torch 2.13:
0 graphs, 4 breaks over 3 steps of 2 blocks, the blocks eager). The block's own forward is
compiled inside the checkpoint instead (parallel/recompute.py `compile_inside`): one graph
shared by the blocks, no break, and the losses and gradient norms bit-equal to the compiled
run without recomputation (the same compiled forward runs again in backward)."""

import pytest
import torch
from common import small_config
from torch._dynamo.utils import counters

from fivefold.train.trainer import Trainer

pytestmark = pytest.mark.usefixtures("one_thread")


def _run(tmp_path, *overrides, steps=3):
    """Per step: (loss, grad_norm, graphs compiled so far, graph breaks so far)."""
    torch._dynamo.reset()
    counters.clear()
    trainer = Trainer(small_config(tmp_path, "--train.compile", "true", *overrides), quiet=True)
    out = []
    try:
        for _ in range(steps):
            m = trainer.train_step()
            out.append((m["loss"], m["grad_norm"], counters["stats"]["unique_graphs"],
                        sum(counters["graph_break"].values())))
        blocks = list(trainer.model.chunks[0].layers)
        checkpointed = [hasattr(b.__dict__.get("forward"), "checkpointed_forward")
                        for b in blocks]
    finally:
        trainer.close()
        torch._dynamo.reset()
    return out, checkpointed


def test_full_recompute_compiles_one_graph_with_the_same_losses(tmp_path):
    full, checkpointed = _run(tmp_path / "full", "--train.recompute", "full")
    assert [(g, b) for _, _, g, b in full] == [(1, 0)] * 3, full  # none after step 1 either
    assert checkpointed == [True, True]  # still recomputed: the wrapper stays
    plain, checkpointed = _run(tmp_path / "plain")
    assert checkpointed == [False, False]
    assert [(g, b) for _, _, g, b in plain] == [(1, 0)] * 3, plain
    assert [(loss, norm) for loss, norm, _, _ in full] == \
        [(loss, norm) for loss, norm, _, _ in plain]
