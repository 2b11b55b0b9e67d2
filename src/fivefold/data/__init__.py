"""The data pipeline: text → token file → (input, target) micro-batches.

- `tokenizer.py`  byte-level tokens (no files) or a Hugging Face `tokenizers` BPE.
- `prepare.py`    `fivefold prepare`: .txt/.jsonl/.parquet → one flat token file + metadata.
- `dataset.py`    `TokenDataset`: the memory-mapped token file, validated on open; the
                  bundled corpus (`corpus/`, public-domain Shakespeare) cached as tokens.
- `loader.py`     `BatchLoader`: seeded windows, split by data-parallel rank, resumable.

Nothing here imports torch except `loader.py`, so preparing data needs no torch.
"""
