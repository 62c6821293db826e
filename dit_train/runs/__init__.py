"""The run folder: checkpoints, the resume policy, lock, provenance, names and files written atomically."""
