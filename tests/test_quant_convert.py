"""quantize_ over a model, AWQ's fold and search, and the quantised checkpoint round trip.

Tolerances: a fold (W·s with the producer divided by s) keeps the float model's logits
within 1e-5 relative; a saved and reloaded quantised model gives bit-identical logits.
"""

import copy

import pytest
import torch

from fivefold.models.init import build_model
from fivefold.models.presets import ModelConfig
from fivefold.quant.awq import apply_awq, fold_scale, layer_groups
from fivefold.quant.convert import QuantSpec, quantize_
from fivefold.quant.io import load_quantized, save_quantized, size_report, tensor_bytes
from fivefold.quant.linear import Int4Linear, QuantLinear

CFG = ModelConfig(name="q", vocab_size=256, hidden_size=128, intermediate_size=256,
                  num_layers=2, num_heads=4, num_kv_heads=4, max_seq_len=128, init_std=0.05)

pytestmark = pytest.mark.usefixtures("one_thread")


def salient_model(cfg=CFG):
    """A model with three input channels whose activations are 8-32x the rest, the property
    of trained LLMs that AWQ relies on (AWQ §3.1)."""
    model = build_model(cfg, seed=1).eval()
    with torch.no_grad():
        model.embed_tokens.weight[:, [3, 50, 77]] *= 8.0
        for layer in model.layers:
            layer.input_layernorm.weight[[3, 50, 77]] *= 4.0
    return model


def logits(model, tokens):
    with torch.no_grad():
        return model(tokens)


def output_error(model, reference, tokens):
    return float((logits(model, tokens) - reference).pow(2).mean())


def test_every_linear_but_the_head_is_replaced():
    cfg = CFG.replace(tie_embeddings=False)
    model = build_model(cfg, seed=1)
    names = quantize_(model, "int8")
    assert len(names) == 2 * 7            # q k v o gate up down per layer
    assert type(model.lm_head) is torch.nn.Linear and "lm_head" not in names
    model = build_model(cfg, seed=1)
    assert "lm_head" in quantize_(model, QuantSpec("nf4", include_head=True))
    assert isinstance(model.lm_head, QuantLinear)


# Relative logit error on this random model with outlier channels (measured 0.015, 0.23,
# 0.19, 0.26): a sanity bound; the oracle is the emulated model.
@pytest.mark.parametrize("method, bound", [("int8", 0.03), ("int4", 0.35), ("nf4", 0.35),
                                           ("mxfp4", 0.4)])
def test_quantised_model_is_the_float_model_with_dequantised_weights(method, bound):
    model = salient_model()
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    reference = logits(model, tokens)
    quantised = copy.deepcopy(model)
    quantize_(quantised, method)
    # the same model with each linear's weight set to its dequantised copy, in float
    emulated = copy.deepcopy(model)
    for name, module in quantised.named_modules():
        if isinstance(module, QuantLinear):
            emulated.get_submodule(name).weight.data.copy_(module.dequantize())
    assert torch.allclose(logits(quantised, tokens), logits(emulated, tokens), rtol=0,
                          atol=1e-5)
    relative = (logits(quantised, tokens) - reference).norm() / reference.norm()
    assert float(relative) < bound


def test_group_size_must_divide_every_input_dimension():
    model = build_model(CFG, seed=1)
    with pytest.raises(ValueError, match="layers.0.self_attn.q_proj: int4 group size 96"):
        quantize_(model, QuantSpec("int4", group_size=96))
    assert all(type(m) is not Int4Linear for m in model.modules())    # nothing changed


def test_fold_leaves_the_float_function_unchanged():
    model = salient_model()
    tokens = torch.randint(0, 256, (2, 32))
    reference = logits(model, tokens)
    torch.manual_seed(5)
    for layer in model.layers:
        for group in layer_groups(layer):
            linears = [layer.get_submodule(n) for n in group.linears]
            s = torch.rand(linears[0].in_features) * 3 + 0.2
            fold_scale(layer.get_submodule(group.prev), linears, s)
    assert len(layer_groups(model.layers[0])) == 4
    assert (logits(model, tokens) - reference).abs().max() <= 1e-5 * reference.abs().max()


def test_grouped_query_attention_ties_the_v_to_o_scale():
    # v_proj's output is narrower than o_proj's input: the group stays, with one scale per
    # v channel repeated over the query heads that read it (test_quant_awq.py checks the fold)
    model = build_model(CFG.replace(num_kv_heads=2), seed=1)
    groups = layer_groups(model.layers[0])
    assert [g.prev for g in groups] == ["input_layernorm", "self_attn.v_proj",
                                        "post_attention_layernorm", "mlp.up_proj"]
    assert groups[1].repeat == CFG.num_heads // 2


def test_awq_beats_round_to_nearest_on_salient_channels():
    model = salient_model()
    calib = torch.randint(0, 256, (16, 64), generator=torch.Generator().manual_seed(1))
    held_out = torch.randint(0, 256, (8, 64), generator=torch.Generator().manual_seed(2))
    reference = logits(model, held_out)
    rtn = copy.deepcopy(model)
    quantize_(rtn, "int4")
    awq = copy.deepcopy(model)
    report = apply_awq(awq, calib, group_size=128)
    quantize_(awq, "awq")
    # alpha = 0 (RTN) is on the grid, so the chosen scale is never worse on the calibration
    # data; and some group picks a real scale
    assert all(g.error_awq <= g.error_rtn for g in report.groups)
    assert any(g.alpha > 0 for g in report.groups)
    rtn_error = output_error(rtn, reference, held_out)
    awq_error = output_error(awq, reference, held_out)
    assert awq_error < 0.5 * rtn_error        # on held-out tokens too (measured: ~0.33x)


def expected_bytes(method, rows, cols):
    """Each format's storage for a (rows, cols) weight, from its definition."""
    n = rows * cols
    if method == "int8":
        return n + 4 * rows                      # codes + an fp32 scale per row
    if method == "int4":                         # symmetric, groups of 64: no zero points
        return n // 2 + 4 * n // 64
    if method == "nf4":                          # codes, int8 per 64, fp32 per 64·256, mean,
        blocks = -(-n // 64)                     # and the 16-entry code table
        scaler_blocks = -(-blocks // 256)
        return n // 2 + 256 * scaler_blocks + 4 * scaler_blocks + 4 + 64
    return n // 2 + n // 32                      # mxfp4: codes + an E8M0 byte per 32


def header_bytes(directory):
    """safetensors: 8 bytes of header length, then the JSON header, then the tensors."""
    with open(directory / "model.safetensors", "rb") as f:
        return 8 + int.from_bytes(f.read(8), "little")


def test_checkpoint_round_trip_and_size(tmp_path):
    model = salient_model()
    float_bytes = tensor_bytes(model.state_dict().values())
    tokens = torch.randint(0, 256, (2, 16))
    for method in ("int8", "int4", "nf4", "mxfp4"):
        quantised = copy.deepcopy(model)
        spec = QuantSpec(method, group_size=64, symmetric=method == "int4")
        quantize_(quantised, spec)
        report = size_report(float_bytes, 4, quantised)
        out = save_quantized(quantised, CFG, spec, tmp_path / method, "byte",
                             {"test": True}, report)
        loaded, cfg, tokenizer = load_quantized(out)
        assert cfg == CFG and tokenizer == "byte"
        assert torch.equal(logits(loaded, tokens), logits(quantised, tokens))
        assert report["linear_bytes_after"] == sum(
            expected_bytes(method, m.out_features, m.in_features)
            for m in quantised.modules() if isinstance(m, QuantLinear))
        assert report["model_bytes_after"] == (tmp_path / method / "model.safetensors"
                                               ).stat().st_size - header_bytes(out)
        # bf16 casts the float parts only; the packed format is unchanged
        assert torch.equal(loaded.bfloat16().layers[0].mlp.up_proj.dequantize(),
                           quantised.layers[0].mlp.up_proj.dequantize())
