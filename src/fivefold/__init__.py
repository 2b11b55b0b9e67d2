"""fivefold: plan and run LLM training with data, tensor, pipeline, context and expert
parallelism."""

__version__ = "0.1.0"
