"""dit_train: a rectified-flow DiT trainer for comparing matrix optimizers."""

from omegaconf import OmegaConf

from .run_names import run_suffix

__version__ = "0.1.0"

# used by hydra.run.dir / hydra.sweep.dir in conf/config.yaml; registered wherever the package is imported
OmegaConf.register_new_resolver("run_suffix", run_suffix, replace=True)
