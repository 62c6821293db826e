"""The schemas registered with Hydra's ConfigStore: each optimizer and dataset schema is the option
`optimizer=<name>` / `data=<name>`, EvalConfig (with the registered metrics' nodes, dit_train/evaluation/metric.py) and
LoggerConfig the option `default` of their group, and the top-level keys with their sections (train, flow,
parallel, vae) the node `_run_defaults` that conf/config.yaml lists before `_self_`. The yamls under conf/ are
presets on top of these (eval/ci.yaml extends `default`).

The nodes are the schemas' defaults as plain values, not OmegaConf-typed nodes: a typed node would convert
`train.progress=yes` to true and `train.steps='3'` to 3 while composing, and the validator (fields.check_fields)
could no longer refuse them."""

from __future__ import annotations

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from .fields import defaults
from .optimizers import optimizer_names, optimizer_schema
from .schema import DATA_SCHEMAS, SECTIONS, LoggerConfig, RunConfig
from .schemas import eval_schema

RUN_DEFAULTS = "_run_defaults"  # a config at the conf root, not a group: neither --help nor completion offers it
# groups whose options are schemas (their folders under conf/ hold presets only, if any)
SCHEMA_OPTIONS = {"optimizer": lambda: {n: optimizer_schema(n) for n in optimizer_names()},
                  "data": lambda: dict(DATA_SCHEMAS), "eval": lambda: {"default": eval_schema()},
                  "logger": lambda: {"default": LoggerConfig}}


def run_defaults() -> dict:
    """seed, run_dir and the sections, in that order (the order of the composed config)."""
    top = {k: v for k, v in defaults(RunConfig).items() if v not in ("???", None)}
    return {**top, **{name: defaults(schema) for name, schema in SECTIONS.items()}}


def schema_options(group: str) -> dict:
    """option name -> schema of the group's options that are schemas ({} for a group of presets only)."""
    return SCHEMA_OPTIONS[group]() if group in SCHEMA_OPTIONS else {}


def register() -> None:
    """Store every schema's defaults with Hydra (again after a schema was added: a registered name is replaced)."""
    store = ConfigStore.instance()
    store.store(name=RUN_DEFAULTS, node=OmegaConf.create(run_defaults()))
    for group in SCHEMA_OPTIONS:
        for name, schema in schema_options(group).items():
            store.store(group=group, name=name, node=OmegaConf.create(defaults(schema)))
