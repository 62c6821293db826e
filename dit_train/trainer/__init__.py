"""The training run: build, the loop, its state, preemption and the dry run."""
