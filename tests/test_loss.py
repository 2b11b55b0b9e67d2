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


@pytest.mark.parametrize("dtype,tol,rows", [(torch.float32, 1e-6, 7), (torch.bfloat16, 1e-2, 7),
                                            (torch.bfloat16, 1e-2, 20)],
                         ids=["fp32", "bf16", "bf16-spare-buffer"])
def test_chunked_loss_matches_materialised_logits(monkeypatch, dtype, tol, rows):
    """A Llama's summed loss and every gradient, chunked (7 or 20 token rows per chunk of the
    30, so chunks do not divide the batch) and the same arithmetic on materialised logits (the
    pipeline's split backward) against logits + F.cross_entropy: fp32 within 1e-6 (loss) and
    1e-5 (gradients), bf16 within 1e-2; ignored targets (-100) included. In bf16 a chunk's
    share of the weight gradient (V·h = 64·32 values) is written into the fp32 logits buffer
    when that holds it (2·rows·V bf16 values: from 16 rows on), else into a fresh tensor:
    20 rows reach the first path, 7 the second, and the test sees which one ran."""
    monkeypatch.setattr(loss_module, "LOGITS_CHUNK_ELEMENTS", rows * 64)
    cfg = preset("nano")  # vocabulary 64, hidden 32, untied head
    spare_writes = []
    real_mm = torch.mm

    def mm(a, b, *, out=None):  # a weight-gradient share written into a borrowed buffer
        if out is not None and out.dtype != torch.float32 and tuple(out.shape) == (64, 32):
            spare_writes.append(out.untyped_storage().nbytes())
        return real_mm(a, b) if out is None else real_mm(a, b, out=out)

    monkeypatch.setattr(torch, "mm", mm)
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
    # One chunked run with gradients: 2 chunks at 20 rows, each into the fp32 rows·V buffer.
    expected = [4 * rows * 64] * 2 if dtype == torch.bfloat16 and 2 * rows >= 32 else []
    assert spare_writes == expected
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
