"""`python -m dit_train --help`: the composed config with each key's one-line doc after it. A key's doc is its
inline comment in the yaml that declares it (conf/config.yaml, the chosen option of each group and the shared files
it includes; the first declaration wins), continued by comment lines aligned under it, else the first sentence of
the comment lines right above it; a key without either shows what its schema accepts. conf/config.yaml's hydra.help.template calls documented_config through the `documented_config`
resolver (dit_train/__init__.py)."""

from __future__ import annotations

import os
import re
import typing
from dataclasses import fields, is_dataclass

from omegaconf import OmegaConf

from dit_train.config.fields import accepted
from dit_train.config.files import CONF_DIR, option_files
from dit_train.config.validate import optimizer_schemas
from dit_train.config.schema import (DATA_SCHEMAS, EvalConfig, FlowConfig, LoggerConfig, ModelConfig, ParallelConfig, RunConfig,
                     TrainConfig, VaeConfig)

KEY_LINE = re.compile(r"^(?P<indent> *)(?P<key>[A-Za-z_]\w*):(?P<rest>.*)$")
SENTENCE_END = re.compile(r"(?<=[.!?])\s")
DOC_COLUMN = 36  # docs start here, or two spaces after a longer line
SCHEMAS = {"": RunConfig, "train": TrainConfig, "flow": FlowConfig, "parallel": ParallelConfig, "vae": VaeConfig,
           "eval": EvalConfig, "logger": LoggerConfig, "model": ModelConfig}


def _comment(rest: str) -> tuple[int, str] | None:
    """(offset, text) of the comment in what follows `key:`: a '#' after whitespace, outside quotes."""
    quote = None
    for i, ch in enumerate(rest):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or rest[i - 1].isspace()):
            return i, rest[i + 1:].strip()
    return None


def yaml_docs(path: str, package: str) -> dict[str, str]:
    """Dotted key (under `package`, unless the file is `# @package _global_`) -> its inline comment, or the first
    sentence of the comment block right above it."""
    with open(path) as f:
        lines = f.read().splitlines()
    if lines and lines[0].replace(" ", "") == "#@package_global_":
        package = ""
    docs: dict[str, str] = {}
    stack: list[tuple[int, str]] = []
    last = None  # (key, column of its '#'): comment lines aligned there continue its doc
    above: list[str] = []  # the comment lines right above the current line
    for line in lines:
        stripped = line.lstrip()
        if stripped.startswith("#") and last and len(line) - len(stripped) == last[1]:
            docs[last[0]] += " " + stripped[1:].strip()
            continue
        last = None
        if stripped.startswith("#") and not stripped.startswith("# @package"):
            above.append(stripped[1:].strip())
            continue
        block, above = " ".join(above), []
        m = KEY_LINE.match(line)
        if m is None:
            continue
        indent = len(m["indent"])
        while stack and stack[-1][0] >= indent:
            stack.pop()
        stack.append((indent, m["key"]))
        key = ".".join(([package] if package else []) + [k for _, k in stack])
        comment = _comment(m["rest"])
        if comment and comment[1]:
            docs[key] = comment[1]
            last = (key, line.index(m["rest"]) + comment[0])
        elif block:
            docs[key] = SENTENCE_END.split(block, maxsplit=1)[0]
    return docs


def _schema_docs(prefix: str, schema, out: dict[str, str]) -> None:
    hints = typing.get_type_hints(schema)
    for f in fields(schema):
        path = f"{prefix}.{f.name}" if prefix else f.name
        if is_dataclass(hints[f.name]):
            _schema_docs(path, hints[f.name], out)
        elif hints[f.name] is not typing.Any or "rule" in f.metadata:  # RunConfig's groups: Any, no rule
            out[path] = accepted(f, hints[f.name])


def key_docs(cfg) -> dict[str, str]:
    """Dotted key -> one-line doc for the composed config `cfg` (with its hydra node: the groups' choices)."""
    choices = OmegaConf.to_container(cfg.hydra.runtime.choices)
    docs = yaml_docs(os.path.join(CONF_DIR, "config.yaml"), "")
    # experiments and launchers set other groups' values: their comments are about those values, so they come last
    groups = sorted((g for g, o in choices.items() if o and not g.startswith("hydra/")),
                    key=lambda g: g in ("experiment", "launcher"))
    for group in groups:
        for path in option_files(group, choices[group]):
            for k, doc in yaml_docs(path, group).items():
                docs.setdefault(k, doc)
    schemas = {**SCHEMAS, "data": DATA_SCHEMAS.get(cfg.data.get("name")),
               "optimizer": optimizer_schemas().get(cfg.optimizer.get("name"))}
    accepted: dict[str, str] = {}
    for prefix, schema in schemas.items():
        if schema is not None:
            _schema_docs(prefix, schema, accepted)
    declared = {f"{prefix}.{f.name}": f.metadata["doc"] for prefix, schema in schemas.items() if schema is not None
                for f in fields(schema) if "doc" in f.metadata}  # a doc declared with its key (fields.key) wins
    return {**accepted, **docs, **declared}


def annotate(text: str, docs: dict[str, str]) -> str:
    """OmegaConf.to_yaml's text with `# doc` after each key that has one."""
    out: list[str] = []
    stack: list[tuple[int, str]] = []
    for line in text.splitlines():
        m = KEY_LINE.match(line)
        if m is not None:
            indent = len(m["indent"])
            while stack and stack[-1][0] >= indent:
                stack.pop()
            stack.append((indent, m["key"]))
            doc = docs.get(".".join(k for _, k in stack))
            if doc:
                line = f"{line.ljust(DOC_COLUMN - 2)}  # {doc}"
        out.append(line)
    return "\n".join(out)


def documented_config(root) -> str:
    """The config part of the --help text for the composed config `root` (hydra node included), with '$'
    doubled: Hydra reads the help template as a string.Template."""
    job = OmegaConf.to_container(root, resolve=False)
    job.pop("hydra", None)
    text = annotate(OmegaConf.to_yaml(job), key_docs(root))
    return text.replace("$", "$$")
