"""Evaluation metrics as plug-ins: the extension point for what a run measures besides its built-in validation loss,
sample grids and FD (evaluation.py; FD predates this interface).

A metric is one class: a `Config` dataclass whose keys live under `eval.<name>` (default, type, rule, doc and resume
rule declared there, like every key: config/fields.py) and `measure`, which returns numbers. Registering it
(`register_metric(cls)`; for a metric of the package, its module's name in PACKAGE_METRICS) is all the rest needs:
the evaluation loop runs it every `eval.<name>.every_n_steps` steps (and at the last), metrics.jsonl gets
`<name>/<key>`, the checkpoint and summary.json its best value (by `better`), summary.json its last values, the study
report a column, `--help` and tab completion its keys, and the resume policy its rules. docs/extending.md, "A new
metric".
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass
from typing import Any, Callable

from dit_train.config.fields import int_at_least

BUILT_IN_PARTS = ("val", "fd", "samples")  # evaluation.py's own parts: a metric may not take their names


@dataclass(kw_only=True)  # keyword-only: a subclass may add keys without defaults
class MetricConfig:
    """The keys every metric has; a metric's Config subclasses it."""
    every_n_steps: int = int_at_least(0, default=0, resume=True,
                                      doc="measure every N training steps, and at the last (0 = never)")


@dataclass
class MetricContext:
    """What a metric may use at one measurement. Every rank calls measure (the model calls are collective under
    FSDP2); the numbers rank 0 returns are the ones logged."""
    ema_model: Any
    step: int
    run_cfg: Any  # the composed run config
    val_batches: list  # the fixed held-out (images, labels) batches of the validation loss, on the host
    sampler: Callable  # sampler(steps, cfg_scale) -> sample(labels, generator, context=None): decoded images
    device: Any
    rank: int
    world_size: int


class Metric:
    """Subclass with `name`, `Config` and `measure`; `better` names which of two values of `measure()[primary]`
    is the best so far ('lower', 'higher', or None: no best is kept)."""
    name: str = ""
    Config: type = MetricConfig
    better: str | None = "lower"
    primary: str = "value"

    def __init__(self, cfg) -> None:
        self.cfg = cfg  # the checked eval.<name> node (a dict of its Config's keys)

    def measure(self, context: MetricContext) -> dict[str, float]:
        raise NotImplementedError

    def is_better(self, value: float, best: float | None) -> bool:
        if self.better is None or not math.isfinite(value):
            return False
        return best is None or (value < best if self.better == "lower" else value > best)


METRICS: list[type[Metric]] = []  # the registered metrics, in the order they run (after FD, before the grid)


def register_metric(cls: type[Metric]) -> type[Metric]:
    """Add a metric (usable as a class decorator); its keys join the eval node of every config composed after."""
    if not cls.name.isidentifier() or cls.name in BUILT_IN_PARTS or cls.name in {m.name for m in METRICS}:
        raise ValueError(f"metric name {cls.name!r}: needs an identifier not used by another metric or by "
                         f"{', '.join(BUILT_IN_PARTS)}")
    if not issubclass(cls.Config, MetricConfig):
        raise TypeError(f"{cls.__name__}.Config must subclass dit_train.evaluation.metric.MetricConfig")
    METRICS.append(cls)
    from dit_train.config.store import register

    register()
    return cls


def unregister_metric(cls: type[Metric]) -> None:
    METRICS.remove(cls)
    from dit_train.config.store import register

    register()


def active_metrics(eval_cfg: dict) -> list[Metric]:
    """The registered metrics the checked eval config turns on."""
    return [m(eval_cfg[m.name]) for m in METRICS if eval_cfg[m.name]["every_n_steps"]]


# The package's own metrics: a new one is its file (docs/extending.md's example as it is, @register_metric
# included) and its module's name here. Imported last, once register_metric exists: an import placed above
# METRICS, as an entry of that list needed, stopped the page's file in a circular ImportError.
PACKAGE_METRICS: tuple[str, ...] = ()
for _module in PACKAGE_METRICS:
    importlib.import_module(_module)
