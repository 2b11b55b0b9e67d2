"""Many LoRA adapters on one base (serve/lora_batch.py): requests for three adapters and the
base, mixed in the same steps, each give the greedy tokens of that adapter's merged model
(finetune's merge_and_unload); the same prompt under two adapters shares no cached block."""

import copy

import pytest
import torch

from fivefold.finetune.inject import apply_lora, merge_and_unload
from fivefold.finetune.io import adapter_config, save_peft
from fivefold.models.init import build_model
from fivefold.models.presets import ModelConfig
from fivefold.serve.engine import Engine
from fivefold.serve.lora_batch import apply_adapters, attach, load_adapter
from fivefold.serve.sampling_params import SamplingParams

CFG = ModelConfig(name="serve-lora", vocab_size=256, hidden_size=64, intermediate_size=128,
                  num_layers=2, num_heads=4, num_kv_heads=2, max_seq_len=256, init_std=0.1)
# (name, rank, alpha, targets, rslora): ranks, scalings and targets all differ
ADAPTERS = [("alpha", 4, 8, "q_proj,v_proj", False),
            ("beta", 8, 16, "all-linear", False),
            ("gamma", 2, 4, "k_proj,o_proj,down_proj", True)]

pytestmark = pytest.mark.usefixtures("one_thread")


def make_adapter(base, directory, seed, rank, alpha, targets, rslora):
    """A PEFT directory whose B is not zero (a trained-looking adapter), and the merged model."""
    model = copy.deepcopy(base)
    apply_lora(model, rank, alpha, targets, rslora=rslora)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
                tensors[name] = p.detach().clone()
    save_peft(directory, tensors, adapter_config(rank, alpha, targets, rslora=rslora))
    return merge_and_unload(model).eval()


def greedy(model, prompts, max_tokens, adapter=None, **kw):
    params = SamplingParams(max_tokens=max_tokens, temperature=0, adapter=adapter)
    return [o.token_ids for o in Engine(model, num_blocks=128, **kw).generate(
        prompts, [params] * len(prompts))]


@pytest.mark.parametrize("prepack", [False, True])
def test_mixed_adapters_equal_merged_models(tmp_path, prepack):
    base = build_model(CFG, seed=2).eval()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (int(n),), generator=g).tolist()
               for n in torch.randint(3, 40, (5,), generator=g)]
    expected, adapters = {None: greedy(base, prompts, 12)}, []
    for seed, (name, rank, alpha, targets, rslora) in enumerate(ADAPTERS):
        merged = make_adapter(base, tmp_path / name, seed, rank, alpha, targets, rslora)
        expected[name] = greedy(merged, prompts, 12)
        adapters.append(load_adapter(name, str(tmp_path / name)))
    assert len({str(v) for v in expected.values()}) == 4  # each adapter changes the output
    served = copy.deepcopy(base)
    adapter_set = apply_adapters(served, adapters)
    engine = Engine(served, num_blocks=128, prepack=prepack)
    attach(engine, adapter_set)
    mixed = {}
    seen = []
    begin = adapter_set.begin_step
    adapter_set.begin_step = lambda out, d: (
        seen.append(len({r.params.adapter for r, _ in out.scheduled})), begin(out, d))[1]
    # round robin: consecutive requests name different adapters, so rows interleave
    order = [(name, i) for i in range(len(prompts)) for name in expected]
    ids = [engine.add_request(prompts[i], SamplingParams(max_tokens=12, temperature=0,
                                                         adapter=name)) for name, i in order]
    outputs = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                outputs[o.request_id] = o.token_ids
    for (name, i), rid in zip(order, ids, strict=True):
        mixed.setdefault(name, {})[i] = outputs[rid]
    assert max(seen) == 4  # the base and three adapters in one step
    for name, want in expected.items():
        assert [mixed[name][i] for i in range(len(prompts))] == want, name
    with pytest.raises(Exception, match="not served here"):
        engine.add_request([1, 2], SamplingParams(adapter="delta"))
