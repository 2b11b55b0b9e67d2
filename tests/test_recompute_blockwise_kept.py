"""recompute = auto keeping a projection under the blockwise FP8 recipe's emulated kernel
(a CPU's: 128-wide K slices, numerics/fp8.py `blockwise_mm`): the selective checkpoint
keeps the projection's output, one bf16 (tokens, out) tensor, as it does for the
tensorwise recipe and for bf16, not each K slice's fp32 partial (K/128 tensors of twice
the bytes each: 2·K/128 times what the planner counts, `op_table`'s tokens·out·B). The
kernel is one op (`fivefold::fp8_blockwise_emulated_mm`), which the policy keeps.
Recomputation changes no arithmetic: the gradients equal no recomputation's bit for bit.
"""

import dataclasses

import pytest
import torch

from fivefold.lowp.convert import convert_to_fp8
from fivefold.lowp.linear import FP8Recipe
from fivefold.models.llama import Block
from fivefold.models.presets import preset
from fivefold.parallel import recompute
from fivefold.plan.recompute_plan import LayerChoice

CFG = dataclasses.replace(preset("tiny"), hidden_size=512, intermediate_size=1024,
                          num_heads=8, num_kv_heads=4)
BATCH, SEQ = 2, 64
OUT = {"q": 512, "k": 256, "v": 256, "o": 512, "gate": 1024, "up": 1024, "down": 512}


def _run(kept, monkeypatch):
    cached = []
    original = recompute._cached_outputs

    def record(storage):
        out = original(storage)
        cached.extend(out)
        return out

    monkeypatch.setattr(recompute, "_cached_outputs", record)
    torch.manual_seed(0)
    block = Block(CFG).to(torch.bfloat16)
    recipe = FP8Recipe.from_name("blockwise")
    assert recipe.kernel == "emulated"
    convert_to_fp8(block, recipe)
    if kept is not None:
        recompute.apply_layer_policies(block, [LayerChoice("keep", kept)])
    torch.manual_seed(1)
    x = torch.randn(BATCH, SEQ, CFG.hidden_size, dtype=torch.bfloat16, requires_grad=True)
    angle = torch.rand(SEQ, CFG.dim_per_head)
    block(x, angle.cos().bfloat16(), angle.sin().bfloat16()).square().sum().backward()
    grads = [x.grad] + [p.grad for p in block.parameters()]
    return cached, grads


@pytest.mark.parametrize("kept", (frozenset({"q"}), frozenset({"down"}), frozenset(OUT)))
def test_a_kept_blockwise_projection_keeps_its_output_alone(kept, monkeypatch):
    cached, grads = _run(kept, monkeypatch)
    shapes = sorted((tuple(t.shape), t.dtype) for t in cached)
    assert shapes == sorted(((BATCH * SEQ, OUT[op]), torch.bfloat16) for op in kept), shapes
    _, plain = _run(None, monkeypatch)
    assert all(torch.equal(a, b) for a, b in zip(grads, plain, strict=True))
