"""Parallel dimensions: each one a transformation of the plain model, in its own module."""
