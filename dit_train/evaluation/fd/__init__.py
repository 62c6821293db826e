"""Fréchet distances (FD-DINO, FID) for dit_train: feature extractors (features.py, named in encoders.py), exact FD
from streaming float64 statistics (frechet.py), cached reference statistics (reference.py, reference_stats.py) and
the in-training evaluator (evaluator.py); the evaluation job (job.py). See docs/algorithms.md §9."""
