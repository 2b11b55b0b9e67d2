"""Training: the trainer, optimizer, precision, checkpoints, metrics and generation."""
