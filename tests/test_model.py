"""The plain model's own pieces."""

import torch

from fivefold.models.init import build_model
from fivefold.models.llama import RMSNorm
from fivefold.models.presets import preset


def test_rmsnorm_backward_matches_autograd_of_the_formula():
    """The hand-written backward (it saves only x and 1/rms) equals autograd's (fp32, 1e-6)."""
    torch.manual_seed(0)
    norm = RMSNorm(64, 1e-5)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(3, 5, 64, requires_grad=True)
    g = torch.randn(3, 5, 64)
    norm(x).backward(g)
    x_ref = x.detach().clone().requires_grad_()
    w_ref = norm.weight.detach().clone().requires_grad_()
    y_ref = w_ref * x_ref * torch.rsqrt(x_ref.pow(2).mean(-1, keepdim=True) + 1e-5)
    y_ref.backward(g)
    assert torch.allclose(norm(x), y_ref, rtol=0, atol=1e-6)
    assert float((x.grad - x_ref.grad).norm() / x_ref.grad.norm()) <= 1e-6
    assert float((norm.weight.grad - w_ref.grad).norm() / w_ref.grad.norm()) <= 1e-6


def test_initial_weights_depend_only_on_names_and_seed():
    cfg = preset("nano")
    a, b, c = build_model(cfg, 3), build_model(cfg, 3), build_model(cfg, 4)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), name
        if pa.ndim == 2:
            assert not torch.equal(pa, pc), name
    # A layer's weight does not depend on how many layers the model has.
    deeper = build_model(cfg.replace(num_layers=4), 3)
    assert torch.equal(deeper.layers[1].mlp.up_proj.weight, a.layers[1].mlp.up_proj.weight)


# Parameter totals as published for each model (the safetensors total of its Hugging Face
# checkpoint); a wrong width, depth, head count, vocabulary or tying changes them.
PUBLISHED_PARAMS = {
    "llama-3.2-1b": 1_235_814_400,
    "llama-3.2-3b": 3_212_749_824,
    "llama-3.1-8b": 8_030_261_248,
    "llama-3.1-70b": 70_553_706_496,
    "llama-3.1-405b": 405_853_388_800,
    "mistral-7b": 7_241_732_096,
    "qwen2.5-0.5b": 494_032_768,
    "qwen2.5-7b": 7_615_616_512,
    "smollm-1.7b": 1_711_376_384,
    "smollm2-135m": 134_515_008,
    "llama-2-7b": 6_738_415_616,
}


def test_presets_have_the_published_sizes():
    for name, total in PUBLISHED_PARAMS.items():
        assert preset(name).num_params() == total, name
    # What the totals do not see: attention layout, RoPE and norm settings from config.json.
    llama = preset("llama-3.1-8b")
    assert (llama.num_kv_heads, llama.dim_per_head, llama.rope_theta) == (8, 128, 500000.0)
    assert llama.rope_scaling == {"factor": 8.0, "low_freq_factor": 1.0,
                                  "high_freq_factor": 4.0,
                                  "original_max_position_embeddings": 8192}
    assert preset("llama-3.2-1b").rope_scaling["factor"] == 32.0
    qwen = preset("qwen2.5-7b")
    assert qwen.qkv_bias and qwen.norm_eps == 1e-6 and qwen.rope_theta == 1e6
    assert (qwen.num_kv_heads, qwen.max_seq_len, qwen.tie_embeddings) == (4, 131072, False)
    assert preset("mistral-7b").rope_theta == 10000.0 and preset("mistral-7b").num_kv_heads == 8
