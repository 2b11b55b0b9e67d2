"""A tiny Hugging Face Llama with a real tokenizer, made locally for the evaluation tests:
the bundled corpus's 2048-token BPE as a transformers tokenizer, weights drawn far from
their initial values so that a wrong mapping or a wrong token moves every number."""

from pathlib import Path

import torch

from fivefold.data.tokenizer import BUILTIN

EOT = "<|endoftext|>"


def make_hf_dir(directory: Path, max_positions: int = 64):
    """(directory, tokenizer, model) of a 2-layer LlamaForCausalLM over the corpus BPE."""
    import transformers

    tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(BUILTIN["corpus-bpe"]),
                                               eos_token=EOT, bos_token=EOT)
    eot = tok.eos_token_id
    config = transformers.LlamaConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
        bos_token_id=eot, eos_token_id=eot)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.rand(p.shape, generator=gen) + 0.5 if "norm" in name
                    else torch.randn(p.shape, generator=gen) * 0.1)
    model.save_pretrained(directory)
    tok.save_pretrained(directory)
    return directory, tok, model
