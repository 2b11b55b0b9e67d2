"""Plain PyTorch models. They know nothing of parallelism."""
