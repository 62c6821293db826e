#!/usr/bin/env python
"""For every key of the run config, the files that declare it, and the largest count: how many places a change to
one key has to touch.

    python -m benchmarks.count_key_declarations [CHECKOUT]      # default: this checkout

A file declares a key when it holds, for that key:
  default    a yaml that sets it as a default (conf/config.yaml, a shared conf/_*.yaml, */default.yaml, an option of
             the optimizer or data group: nothing else gives those keys a value), or a dataclass field / keyword
             parameter with a default in Python
  type       a dataclass field (a schema, or a library config such as the DiT's)
  doc        a yaml comment on the key (inline, or the block right above it) in any yaml, presets included
  rule       a dotted key or pattern in a string collection (`"optimizer.bucket_mb"`, `"logger.*"`: resume lists)
  whitelist  a collection of key names (`("ns_steps", "mud_passes", ...)`): keys copied by name
A preset that only sets a value (model/dit_s.yaml's depth, an experiment's train.steps) declares nothing, and a
yaml's header comment documents the file, not its first key. Python declarations are matched to a config node by
their names: a dataclass, a string collection or a function's keyword parameters (three or more) counts for the
node (train, optimizer, model.launch, ...) that holds most of its names, and only if at least half of its names
are that node's keys. The keys are those of the composed run config for every optimizer and data option (hydra's
own node left out), composed by the checkout itself.
"""

from __future__ import annotations

import argparse
import ast
import fnmatch
import json
import os
import re
import subprocess
import sys
from collections import defaultdict

COMPOSE = r"""
import json, os, sys
import dit_train  # registers whatever the checkout registers
from dit_train.config import group_options
from hydra import compose, initialize_config_dir
conf = os.path.join(os.path.dirname(dit_train.__file__), "conf")
keys = set()
def flat(node, prefix=""):
    for k, v in node.items():
        if isinstance(v, dict) and v and not prefix + k == "study":
            flat(v, f"{prefix}{k}.")
        else:
            keys.add(prefix + k)
from omegaconf import OmegaConf
with initialize_config_dir(config_dir=conf, version_base="1.3"):
    for group in ("optimizer", "data"):
        for option in group_options(group):
            cfg = compose(config_name="config", overrides=[f"{group}={option}", "run_dir=/x"])
            flat(OmegaConf.to_container(cfg, resolve=False))
print(json.dumps(sorted(keys)))
"""
KEY_LINE = re.compile(r"^(?P<indent> *)(?P<key>[A-Za-z_]\w*):(?P<rest>.*)$")
DEFAULT_GROUPS = ("optimizer", "data")  # groups whose option files were their keys' only defaults


def run_keys(root: str) -> list[str]:
    out = subprocess.run([sys.executable, "-c", COMPOSE], cwd="/tmp", capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": root})
    return [k for k in json.loads(out.stdout) if not k.startswith("hydra.")]


def nodes_of(keys: list[str]) -> dict[str, set[str]]:
    """node ('' for the top level) -> the names under it: its keys and its child nodes (a schema of the top level
    names the groups too); only keys are counted."""
    nodes: dict[str, set[str]] = defaultdict(set)
    for k in keys:
        parts = k.split(".")
        for i in range(len(parts)):
            nodes[".".join(parts[:i])].add(parts[i])
    return nodes


def best_node(names: set[str], nodes: dict[str, set[str]], least: int = 2) -> str | None:
    """The node most of `names` belong to, if at least half of them (and `least` or more) do."""
    if len(names) < least:
        return None
    node, hits = max(((n, len(names & leaves)) for n, leaves in nodes.items()), key=lambda x: x[1])
    return node if hits >= least and 2 * hits >= len(names) else None


# ---- yaml --------------------------------------------------------------------------------------------------------
def yaml_package(path: str, conf: str) -> tuple[str, bool]:
    """(package of the file's keys, whether the values it sets are defaults)."""
    rel = os.path.relpath(path, conf)
    with open(path) as f:
        first = f.readline()
    group = os.path.dirname(rel)
    if first.replace(" ", "").strip() == "#@package_global_":
        return "", rel == "config.yaml"
    if not group:  # config.yaml, or a shared file at the root included @_here_ into its group: _<group>_*.yaml
        if rel == "config.yaml":
            return "", True
        return rel[1:].split("_")[0], True
    return group, group in DEFAULT_GROUPS or os.path.basename(rel) == "default.yaml"


def yaml_declarations(path: str, conf: str, keys: set[str]) -> dict[str, set[str]]:
    """key -> kinds ('default', 'doc') that the yaml declares."""
    package, are_defaults = yaml_package(path, conf)
    found: dict[str, set[str]] = defaultdict(set)
    stack: list[tuple[int, str]] = []
    above, header = False, True  # the comment block before the first line is the file's header, not a key's doc
    for line in open(path).read().splitlines():
        stripped = line.lstrip()
        if stripped.startswith("#"):
            above = above or not header
            continue
        header = False
        m = KEY_LINE.match(line)
        if m is None:
            above = False
            continue
        indent = len(m["indent"])
        while stack and stack[-1][0] >= indent:
            stack.pop()
        stack.append((indent, m["key"]))
        key = ".".join(([package] if package else []) + [k for _, k in stack])
        if key in keys:
            if are_defaults and m["rest"].strip():
                found[key].add("default")
            if " #" in m["rest"] or above:
                found[key].add("doc")
        above = False
    return found


# ---- python ------------------------------------------------------------------------------------------------------
def _strings(node) -> list[str] | None:
    elts = node.keys if isinstance(node, ast.Dict) else getattr(node, "elts", None)
    if not elts or not all(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in elts):
        return None
    return [e.value for e in elts]


def _is_dataclass(cls: ast.ClassDef) -> bool:
    return any("dataclass" in ast.unparse(d) for d in cls.decorator_list)


def python_declarations(path: str, keys: list[str], nodes: dict[str, set[str]]) -> dict[str, set[str]]:
    tree = ast.parse(open(path).read())
    found: dict[str, set[str]] = defaultdict(set)
    classes = {c.name: c for c in ast.walk(tree) if isinstance(c, ast.ClassDef) and _is_dataclass(c)}

    def fields(cls: ast.ClassDef) -> list[ast.AnnAssign]:
        return [s for s in cls.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)]

    def all_names(cls: ast.ClassDef) -> set[str]:
        inherited = set().union(*(all_names(classes[b.id]) for b in cls.bases
                                  if isinstance(b, ast.Name) and b.id in classes))
        return inherited | {f.target.id for f in fields(cls)}

    for cls in classes.values():
        node = best_node(all_names(cls), nodes)
        for f in fields(cls) if node is not None else []:
            key = f"{node}.{f.target.id}" if node else f.target.id
            if key in keys:
                found[key].add("type")
                if f.value is not None and (not isinstance(f.value, ast.Call) or any(
                        k.arg in ("default", "default_factory") for k in f.value.keywords)):
                    found[key].add("default")
    for expr in ast.walk(tree):
        names = _strings(expr) if isinstance(expr, (ast.Tuple, ast.List, ast.Set, ast.Dict)) else None
        if names:
            dotted = [k for k in keys if any(fnmatch.fnmatchcase(k, p) for p in names if "." in p)]
            for k in dotted:
                found[k].add("rule")
            node = best_node(set(names), nodes)
            for n in names if node is not None else []:
                if (f"{node}.{n}" if node else n) in keys:
                    found[f"{node}.{n}" if node else n].add("whitelist")
        if isinstance(expr, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = expr.args.args + expr.args.kwonlyargs
            with_default = [a.arg for a in expr.args.args[len(expr.args.args) - len(expr.args.defaults):]]
            with_default += [a.arg for a, d in zip(expr.args.kwonlyargs, expr.args.kw_defaults) if d is not None]
            node = best_node({a.arg for a in args} - {"self"}, nodes, least=3)
            for n in with_default if node is not None else []:
                if (f"{node}.{n}" if node else n) in keys:
                    found[f"{node}.{n}" if node else n].add("default")
    return found


def count(root: str) -> dict[str, dict[str, set[str]]]:
    """key -> file -> kinds."""
    keys = run_keys(root)
    nodes = nodes_of(keys)
    out: dict[str, dict[str, set[str]]] = {k: {} for k in keys}
    package = os.path.join(root, "dit_train")
    conf = os.path.join(package, "conf")
    for folder, _, files in os.walk(package):
        for name in files:
            path = os.path.join(folder, name)
            if name.endswith(".yaml") and path.startswith(conf):
                found = yaml_declarations(path, conf, set(keys))
            elif name.endswith(".py"):
                found = python_declarations(path, keys, nodes)
            else:
                continue
            for key, kinds in found.items():
                if key in out:
                    out[key][os.path.relpath(path, root)] = kinds
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkout", nargs="?", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    ap.add_argument("--files", action="store_true", help="name the files of each key")
    args = ap.parse_args()
    table = count(os.path.abspath(args.checkout))
    width = max(map(len, table))
    print(f"{'key':<{width}}  files  kinds")
    for key in sorted(table, key=lambda k: (-len(table[k]), k)):
        files = table[key]
        kinds = ",".join(sorted(set().union(*files.values()))) if files else "-"
        line = f"{key:<{width}}  {len(files):>5}  {kinds}"
        if args.files:
            line += "  " + " ".join(sorted(files))
        print(line)
    counts = [len(f) for f in table.values()]
    top = max(counts)
    print(f"\nkeys: {len(counts)}  max files per key: {top} ({sum(c == top for c in counts)} keys)  "
          f"mean: {sum(counts) / len(counts):.2f}  keys in more than one file: {sum(c > 1 for c in counts)}")


if __name__ == "__main__":
    main()
