"""The config layer: the schemas, each key's one declaration (schema.py, optimizers.py, with fields.py's key()),
which schema declares which node (schemas.py), their registration with Hydra (store.py), the options of each group
(files.py), the one validator of their values (validate.py) and the command-line check that runs before Hydra
(command_line.py). Every config error is a ConfigError whose one-line message reads `key=value is not valid: ...`.
"""

from dit_train.config.command_line import check_command_line, check_group_overrides, remove_stray_hydra_dir
from dit_train.config.errors import ConfigError
from dit_train.config.files import CONF_DIR, group_options, load_option
from dit_train.config.validate import (check_data, check_eval, check_architecture, check_optimizer, check_parallel, plain,
                       validate)

__all__ = ["CONF_DIR", "ConfigError", "check_command_line", "check_data", "check_eval",
           "check_group_overrides", "check_architecture", "check_optimizer", "check_parallel",
           "group_options", "load_option", "plain", "remove_stray_hydra_dir", "validate"]
