"""dit_train: a rectified-flow Diffusion Transformer trainer for comparing matrix optimizers."""

__version__ = "0.1.0"
