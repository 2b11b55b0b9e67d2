"""Post-training weight quantisation: quantised linear layers, model conversion, AWQ, and
quantised checkpoints (`fivefold quantize`)."""
