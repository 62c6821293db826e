"""Which schema declares each node of a composed run config: the groups' by their chosen option (optimizer and data
by `name`), the sections' and the top level's by name. The validator's checks, --help's docs and the resume policy
all start here."""

from __future__ import annotations

from dataclasses import field, make_dataclass
from functools import lru_cache
from typing import get_origin

from .fields import walk
from .optimizers import optimizer_names, optimizer_schema
from .schema import DATA_SCHEMAS, SECTIONS, EvalConfig, LoggerConfig, ModelConfig, RunConfig


def eval_schema():
    """EvalConfig with one node per registered metric (dit_train/evaluation/metric.py): eval.<metric name>.<key>."""
    from dit_train.evaluation.metric import METRICS

    return _eval_with(tuple(METRICS))


@lru_cache(maxsize=None)
def _eval_with(metrics: tuple):
    if not metrics:
        return EvalConfig
    nodes = [(m.name, m.Config, field(default_factory=m.Config)) for m in metrics]
    return make_dataclass("EvalConfig", nodes, bases=(EvalConfig,))


def fixed() -> dict:
    """Node prefix -> schema of the nodes that do not depend on a chosen option's name."""
    return {"": RunConfig, **SECTIONS, "eval": eval_schema(), "logger": LoggerConfig, "model": ModelConfig}


def run_schemas(cfg) -> dict:
    """Node prefix ('' for the top level) -> the schema of that node in the run config `cfg` (a mapping with
    data.name and optimizer.name); a name without a schema is left out (the validator refuses it)."""
    named = {"data": DATA_SCHEMAS.get(_name(cfg, "data")), "optimizer": optimizer_schema(_name(cfg, "optimizer"))}
    return {**fixed(), **{k: v for k, v in named.items() if v is not None}}


def _name(cfg, group: str):
    node = cfg.get(group) if hasattr(cfg, "get") else None
    return node.get("name") if hasattr(node, "get") else None


def every_key():
    """(dotted key, field, type) of every key of every schema, every optimizer and dataset included."""
    every = [*fixed().items(), *(("data", s) for s in DATA_SCHEMAS.values()),
             *(("optimizer", optimizer_schema(n)) for n in optimizer_names())]
    for prefix, schema in every:
        yield from walk(schema, f"{prefix}." if prefix else "")


def recorded_before() -> dict:
    """Keys added after runs were recorded -> the value that reproduces what those runs did."""
    return {path: f.metadata["recorded_before"] for path, f, _ in every_key() if "recorded_before" in f.metadata}


def may_change_on_resume() -> tuple[str, ...]:
    """fnmatch patterns of the dotted keys a resumed run may change: every key declared with resume=True in any
    schema (a free-form node such as `study` with everything under it)."""
    patterns = set()
    for path, f, tp in every_key():
        if f.metadata.get("resume"):
            patterns.add(path)
            if dict in (get_origin(a) for a in getattr(tp, "__args__", ())):
                patterns.add(f"{path}.*")
    return tuple(sorted(patterns))
