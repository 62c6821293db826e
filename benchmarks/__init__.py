"""Benchmarks and the cost model of a training step (docs/cost_model.md); run with PYTHONPATH set to the repository."""
