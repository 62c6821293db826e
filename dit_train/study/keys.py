"""The keys of an experiment's `study:` node (dit-study's grid), declared once, as the run config's keys are
(dit_train/config/schema.py): each key's type, default and range, in the words of its one-line error. The trainer
takes `study:` as a free-form node; dit-study checks it against StudyConfig at start-up, before it writes anything,
so a misspelled key or a bad value is one line, exit 2 (it was ignored but recorded, rounded to an integer, a
TypeError traceback, or an empty scan that waited forever with exit 0)."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, Dict, List, Optional

from dit_train.config.errors import ConfigError, invalid
from dit_train.config.fields import check_fields, int_at_least, key

COMMON_RULES = ("lowest_selected",)  # study.common_lr's named rules (a number is the other form)


def positive(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def distinct(values) -> bool:
    """A non-empty list without repeats (a repeated seed or lr is one run listed twice)."""
    return len(values) > 0 and len(set(values)) == len(values)


def lr_grid(values) -> bool:
    return isinstance(values, list) and all(positive(v) for v in values) and distinct(values)


def tuned_lr(value) -> bool:
    """One optimizer's study.lr: a positive number, or (periodic_rowwise) a mapping of K to one."""
    if isinstance(value, dict):
        return len(value) > 0 and all(isinstance(k, int) and not isinstance(k, bool) and positive(v)
                                      for k, v in value.items())
    return positive(value)


@dataclass(kw_only=True)
class StudyConfig:
    name: str = key("expected a non-empty name (the default --sweep-dir is sweeps/<name>)", lambda v: bool(v.strip()),
                    doc="the study's name: its default sweep folder and wandb group")
    notes: str = key(default="", doc="free text for the report (not part of the design)")
    models: List[str] = key("expected a non-empty list of distinct model presets, e.g. [dit_s]", distinct,
                            doc="model presets (conf/model/)")
    optimizers: List[str] = key("expected a non-empty list of distinct optimizer names, e.g. [adamw, muon]", distinct,
                                doc="optimizers (conf/optimizer/)")
    K: Optional[List[int]] = key("null or a non-empty list of distinct integers >= 1",
                                 lambda v: distinct(v) and min(v) >= 1, default=None,
                                 doc="periodic_rowwise's refresh periods (required with it)")
    rownorm_scale: Optional[List[str]] = key("null or a non-empty list of distinct RowNorm scales, e.g. [spectral]",
                                             distinct, default=None,
                                             doc="the RowNorm optimizers' scales, each its own variant")
    axes: Optional[Dict[str, Any]] = key(
        "null or a mapping of config keys to non-empty lists of values, e.g. {model.qk_norm: [true, false]}",
        lambda v: len(v) > 0 and all(isinstance(x, list) and len(x) > 0 for x in v.values()), default=None,
        doc="any other config key as a grid axis: each combination of values is its own variant")
    seeds: List[int] = key("expected a non-empty list of distinct integer seeds, e.g. [0, 1]", distinct,
                           doc="the evaluation seeds (with selection_seeds; else the first selects the lr)")
    selection_seeds: Optional[List[int]] = key("null or a non-empty list of distinct integer seeds, e.g. [20, 21]",
                                               distinct, default=None,
                                               doc="the seeds that choose each variant's lr (never evaluated)")
    lr: Any = key("null, a non-empty list of distinct positive numbers (every optimizer at each), or a mapping of "
                  "optimizer to a positive number (periodic_rowwise's may map K to one)",
                  lambda v: v is None or lr_grid(v) or isinstance(v, dict) and len(v) > 0
                  and all(tuned_lr(x) for x in v.values()), default=None,
                  doc="a scan over every optimizer, or each optimizer's tuned value")
    lr_scan: Optional[Dict[str, Any]] = key(
        "null or a mapping of optimizer to a non-empty list of distinct positive numbers, e.g. "
        "{adamw: [1.0e-3, 2.0e-3]}", lambda v: len(v) > 0 and all(lr_grid(x) for x in v.values()), default=None,
        doc="each optimizer's scan; the selection seeds choose a value, then the evaluation seeds run at it")
    lr_scan_extend: int = int_at_least(0, default=0,
                                       doc="values a scan may grow by beyond each end where its best value lies")
    common_lr: Any = key(f"null, a positive number or {' or '.join(COMMON_RULES)}",
                         lambda v: v is None or v in COMMON_RULES or positive(v), default=None,
                         doc="a third phase: the evaluation seeds of every variant at one shared lr")


STUDY_KEYS = tuple(f.name for f in fields(StudyConfig))


def check_study(study: dict) -> None:
    """ConfigError (one line: the key, its value, what is valid) for a `study:` node dit-study cannot run as
    written: a key StudyConfig does not declare, a value of the wrong type or range, a missing required key."""
    if not isinstance(study, dict):
        raise invalid("study", study, "expected a mapping of the keys " + ", ".join(STUDY_KEYS))
    check_fields("study", StudyConfig, study)
    if "periodic_rowwise" in study["optimizers"] and study.get("K") is None:
        raise ConfigError("study.K is missing: study.optimizers names periodic_rowwise, which runs at each of "
                          "study.K (a non-empty list of integers >= 1, e.g. [3])")
