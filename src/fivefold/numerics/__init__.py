"""Number formats in one place: constants (formats.py), amax -> scale (scaling.py), and one
quantise/dequantise pair per format family (fp8.py; the others beside it), each over a
small dataclass holding the data, its scales and its format.

This package imports only torch and holds no nn.Module: training (lowp/), quantisation,
fine-tuning, serving and the planner's bytes per element all build on it.
"""
