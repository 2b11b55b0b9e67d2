"""The chunked head + cross-entropy (models/loss.py): the same loss and gradients as the
materialised logits, and a peak memory without them."""

import pytest
import torch
import torch.nn.functional as F

from fivefold.models import loss as loss_module
from fivefold.models.init import build_model
from fivefold.models.loss import chunked_linear_cross_entropy, cross_entropy_sum
from fivefold.models.presets import preset


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
def test_chunked_loss_matches_materialised_logits(monkeypatch, dtype, tol):
    """A Llama's summed loss and every gradient, chunked (7 token rows per chunk, so chunks
    do not divide the batch) and the same arithmetic on materialised logits (the pipeline's
    split backward) against logits + F.cross_entropy: fp32 within 1e-6 (loss) and 1e-5
    (gradients), bf16 within 1e-2; ignored targets (-100) included."""
    monkeypatch.setattr(loss_module, "LOGITS_CHUNK_ELEMENTS", 7 * 64)
    cfg = preset("nano")  # vocabulary 64, untied head
    model = build_model(cfg, seed=3, dtype=dtype)
    torch.manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (3, 10))
    targets = torch.randint(0, cfg.vocab_size, (3, 10))
    targets[1, 4:] = -100

    def run(kind: str):
        model.zero_grad()
        if kind == "chunked":
            loss = model(tokens, targets)
        elif kind == "from_logits":
            loss = cross_entropy_sum(model(tokens), targets)
        else:
            loss = F.cross_entropy(model(tokens).float().flatten(0, 1), targets.flatten(),
                                   ignore_index=-100, reduction="sum")
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    loss_p, grads_p = run("reference")
    grad_tol = 1e-5 if dtype == torch.float32 else tol
    for kind in ("chunked", "from_logits"):
        loss_c, grads_c = run(kind)
        assert abs(float(loss_c - loss_p)) / float(loss_p) <= tol, kind
        for name in grads_p:
            assert _rel(grads_c[name], grads_p[name]) <= grad_tol, (kind, name)
    loss_c = run("chunked")[0]
    # Without gradients (evaluation) the loss alone, equal to the one with them.
    with torch.no_grad():
        assert torch.equal(model(tokens, targets), loss_c)


def test_chunked_loss_peak_memory_at_a_128k_vocabulary():
    """Measured from the allocations (torch's MemTracker: every storage created and freed),
    on a 128,256-token vocabulary (Llama 3): the chunked loss's forward + backward peaks
    lower than the materialised logits' by more than the full fp32 logits' size."""
    from torch.distributed._tools.mem_tracker import MemTracker

    torch.manual_seed(0)
    tokens, hidden, vocab = 256, 64, 128256
    x = torch.randn(1, tokens, hidden, requires_grad=True)
    w = (torch.randn(vocab, hidden) * 0.02).requires_grad_()
    y = torch.randint(0, vocab, (1, tokens))

    def peak(fn) -> tuple[int, torch.Tensor]:
        tracker = MemTracker()
        with tracker:
            loss = fn()
            loss.backward()
        x.grad = w.grad = None
        return tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"], loss.detach()

    chunked, loss_c = peak(lambda: chunked_linear_cross_entropy(x, w, y))
    plain, loss_p = peak(lambda: F.cross_entropy((x @ w.t()).flatten(0, 1), y.flatten(),
                                                 reduction="sum"))
    logits_bytes = tokens * vocab * 4
    assert abs(float(loss_c - loss_p)) / float(loss_p) <= 1e-6
    assert plain - chunked >= logits_bytes, (plain, chunked, logits_bytes)


def test_planner_uses_the_engines_chunk_size():
    from fivefold.plan import activations

    assert activations.LOGITS_CHUNK_ELEMENTS == loss_module.LOGITS_CHUNK_ELEMENTS
