"""Every default the README and docs/ state for a config key (`key` (default X), `key`, default X, `key` (X by
default)) is the key's default in the composed config: docs/reliability.md said parallel.timeout_minutes defaults
to 30 (it is 10) and docs/algorithms.md that train.num_workers defaults to 0 (it is auto)."""

import glob
import os
import re

import yaml
from omegaconf import OmegaConf

from conftest import ROOT, compose

KEY = r"`((?:model|optimizer|data|eval|logger|flow|train|parallel|vae)\.[a-z_.]+)`"
STATED = [re.compile(KEY + r"(?: \(|, )default ([^\s),;:]+)"), re.compile(KEY + r" \(([^\s)]+) by default")]


def stated_defaults():
    for path in [os.path.join(ROOT, "README.md"), *sorted(glob.glob(os.path.join(ROOT, "docs", "**", "*.md"),
                                                                    recursive=True))]:
        text = " ".join(open(path).read().split())  # a statement may wrap
        for pattern in STATED:
            for m in pattern.finditer(text):
                yield os.path.relpath(path, ROOT), m.group(1), m.group(2)


def test_every_stated_default_is_the_configs():
    configs = [compose(["run_dir=/tmp/unused", *o]) for o in ([], ["optimizer=periodic_rowwise"])]
    found = list(stated_defaults())
    assert len(found) >= 4, found
    wrong = []
    for path, key, value in found:
        actual = [OmegaConf.select(c, key, default="<absent>") for c in configs]
        if yaml.safe_load(value) not in actual:
            wrong.append(f"{path}: {key} stated {value}, is {actual[0]}")
    assert not wrong, wrong
