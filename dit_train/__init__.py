"""dit_train: a rectified-flow DiT trainer for comparing matrix optimizers."""

from omegaconf import OmegaConf

from dit_train.runs.names import run_suffix, submission_id

__version__ = "0.1.0"


def _documented_config(*, _root_) -> str:
    from dit_train.config.help_text import documented_config

    return documented_config(_root_)


# used by hydra.run.dir / hydra.sweep.dir and hydra.help.template in conf/config.yaml, and by conf/launcher/slurm.yaml;
# registered wherever the package is imported
OmegaConf.register_new_resolver("run_suffix", run_suffix, replace=True)
OmegaConf.register_new_resolver("submission_id", submission_id, replace=True)
OmegaConf.register_new_resolver("documented_config", _documented_config, replace=True)


def _register_schemas() -> None:
    from dit_train.config.store import register  # the schemas' defaults, which conf/config.yaml's defaults list names

    register()


_register_schemas()
