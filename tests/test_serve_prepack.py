"""Prepacked (oneDNN) linears for serving fp32 on a CPU (serve/prepack.py).

Oracle: the same model with torch's `F.linear`. oneDNN sums in another order than the BLAS,
so logits are compared within 1e-5 of the largest logit (fp32; measured ~3e-7 here), and
greedy tokens exactly on models with init_std 0.1 (no near-ties, as in test_serve_engine).
"""

import pytest
import torch
from torch import nn

from fivefold.models.init import build_model
from fivefold.models.presets import ModelConfig
from fivefold.serve.engine import Engine
from fivefold.serve.prepack import PackedLinear, can_prepack, prepack_linears
from fivefold.serve.sampling_params import SamplingParams

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.skipif(not torch.backends.mkldnn.is_available(),
                                 reason="this torch build has no oneDNN")]

CFG = ModelConfig(name="packed", vocab_size=256, hidden_size=64, intermediate_size=128,
                  num_layers=2, num_heads=4, num_kv_heads=2, max_seq_len=256, init_std=0.1)


@pytest.mark.parametrize("tied", [True, False])
def test_copy_packs_every_linear_and_the_head_and_leaves_the_model_alone(tied):
    model = build_model(CFG.replace(tie_embeddings=tied), seed=3).eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    linears = [n for n, m in model.named_modules() if type(m) is nn.Linear]
    assert can_prepack(model)
    served, count = prepack_linears(model)
    # 7 per block, and the head (its own linear or the embedding's weight)
    assert count == 7 * CFG.num_layers + 1 == len(linears) + tied
    assert all(type(m) is nn.Linear for n, m in model.named_modules() if n in linears)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    packed = [m for m in served.modules() if isinstance(m, PackedLinear)]
    assert len(packed) == count and isinstance(served.packed_head, PackedLinear)
    # an untied lm_head stays a plain linear beside its packed copy, for output_weight()
    assert (served.lm_head is None) == tied
    # nothing copied: the copy's embedding and norms are the model's tensors
    assert served.embed_tokens.weight is model.embed_tokens.weight
    assert served.norm.weight is model.norm.weight
    tokens = torch.randint(0, CFG.vocab_size, (2, 50), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        want, got = model(tokens), served(tokens)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * want.abs().max().item())


def test_engine_with_prepacked_linears_gives_the_same_greedy_tokens():
    model = build_model(CFG, seed=3).eval()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, CFG.vocab_size, (int(n),), generator=g).tolist()
               for n in torch.randint(1, 120, (10,), generator=g)]
    params = [SamplingParams(max_tokens=24, temperature=0.0) for _ in prompts]
    plain = Engine(model, num_blocks=96)
    packed = Engine(model, num_blocks=96, prepack=True)
    assert plain.num_prepacked == 0 and packed.num_prepacked == 7 * CFG.num_layers + 1
    assert ([o.token_ids for o in packed.generate(prompts, params)]
            == [o.token_ids for o in plain.generate(prompts, params)])


def test_lora_model_packs_around_its_adapters():
    from fivefold.finetune.inject import apply_lora
    from fivefold.finetune.lora import LoraLinear

    model = build_model(CFG, seed=3).eval()
    apply_lora(model, 4, 8.0, "q_proj,v_proj")
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1)
    served, _ = prepack_linears(model)
    lora = [m for m in served.modules() if isinstance(m, LoraLinear)]
    assert len(lora) == 2 * CFG.num_layers
    assert all(isinstance(m.base_layer, PackedLinear) for m in lora)
    tokens = torch.randint(0, CFG.vocab_size, (1, 40), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        want, got = model(tokens), served(tokens)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * want.abs().max().item())


def test_bf16_and_quantised_layers_stay_as_they_are():
    bf16 = build_model(CFG, seed=3).eval().to(torch.bfloat16)
    assert not can_prepack(bf16)
    assert Engine(bf16, num_blocks=32, prepack=True).num_prepacked == 0
    from fivefold.quant.convert import QuantSpec, quantize_
    from fivefold.quant.linear import QuantLinear

    model = build_model(CFG, seed=3).eval()
    quantize_(model, QuantSpec("int8", group_size=32))
    served, count = prepack_linears(model)
    assert count == 1  # only the head: every block linear is an Int8Linear
    assert sum(isinstance(m, QuantLinear) for m in served.modules()) == 7 * CFG.num_layers


def test_auto_packs_only_where_the_probe_finds_onednn_faster(monkeypatch):
    import fivefold.serve.engine as engine_module
    from fivefold.serve.prepack import LinearProbe, probe_linears

    model = build_model(CFG, seed=4).eval()
    probe = probe_linears(model, budget_s=0.05)
    # every distinct shape of the model: q/o 64x64, k/v 32x64, gate/up 128x64, down
    # 64x128, head 256x64, timed by both paths
    assert probe.rows == 16 and probe.packed_ms > 0 and probe.sgemm_ms > 0
    assert probe.prepack == (probe.packed_ms < probe.sgemm_ms)
    for faster in (True, False):
        monkeypatch.setattr(engine_module, "probe_linears",
                            lambda _model, f=faster: LinearProbe(f, 1.0, 2.0, 16))
        engine = Engine(model, num_blocks=32, prepack="auto")
        assert (engine.num_prepacked == 7 * CFG.num_layers + 1) == faster
        assert engine.linear_probe.prepack == faster
        assert "oneDNN" in engine.linear_probe.describe()
    assert Engine(model, num_blocks=32, prepack=True).linear_probe is None  # forced: no probe
