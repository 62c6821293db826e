"""Fréchet distances (FD-DINO, FID) for dit_train: feature extractors, exact FD from streaming float64 statistics,
cached reference statistics and the in-training evaluator. See docs/algorithms.md §9."""

from dit_train.evaluation.fd.evaluator import FDEvaluator, generation_labels
from dit_train.evaluation.fd.features import (FeatureExtractor, MissingWeightsError, available_extractors, build_extractor,
                       inception_weights_path)
from dit_train.evaluation.fd.frechet import (GaussianStats, RankDeficientWarning, StreamingStats, fd_from_stats, frechet_distance,
                      stats_from_features, trace_sqrt_product)
from dit_train.evaluation.fd.reference import ReferenceStats, load_or_compute_reference, load_reference, save_reference

__all__ = [
    "FDEvaluator", "generation_labels",
    "FeatureExtractor", "MissingWeightsError", "available_extractors", "build_extractor", "inception_weights_path",
    "GaussianStats", "RankDeficientWarning", "StreamingStats", "fd_from_stats", "frechet_distance",
    "stats_from_features", "trace_sqrt_product",
    "ReferenceStats", "load_or_compute_reference", "load_reference", "save_reference",
]
