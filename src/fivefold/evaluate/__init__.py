"""Evaluation of a trained model: perplexity, task generation scored with BLEU and ROUGE,
and an lm-evaluation-harness adapter. The planner's estimate of a layout lives elsewhere
(plan/evaluate.py); this package measures a model."""
