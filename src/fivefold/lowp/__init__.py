"""Low-precision training: FP8 linear layers (linear.py), FP8 expert GEMMs (experts.py) and
the swap that puts them into a model (convert.py). The number formats themselves live in
fivefold.numerics."""
