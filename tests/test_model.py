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
