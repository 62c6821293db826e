#!/usr/bin/env python
"""The shape of the code at a git revision: the largest functions, classes and files by lines, and how many
functions are over 60 lines. Files are read with `git show REV:path`, so two revisions compare without a checkout.

    python -m benchmarks.code_shape 95a8a36 HEAD        # before the restructure of issue 27, and now

Counted: the tracked .py files outside tests/ (the package, benchmarks/, and scripts/ and eval/ where a revision
has them). A function's or class's lines run from its `def`/`class` line (decorators excluded) to its last line,
docstring and nested definitions included; a method counts as a function.
"""

from __future__ import annotations

import argparse
import ast
import subprocess

LONG = 60  # lines: a function longer than this is counted
TOP = 15


def python_files(rev: str) -> list[str]:
    names = subprocess.run(["git", "ls-tree", "-r", "--name-only", rev], capture_output=True, text=True,
                           check=True).stdout.split()
    return [n for n in names if n.endswith(".py") and not n.startswith("tests/")]


def shape(rev: str) -> dict:
    """{'functions': [(lines, 'path:name')], 'classes': [...], 'files': [(lines, path)]}, each largest first."""
    out = {"functions": [], "classes": [], "files": []}
    for path in python_files(rev):
        source = subprocess.run(["git", "show", f"{rev}:{path}"], capture_output=True, text=True, check=True).stdout
        out["files"].append((len(source.splitlines()), path))
        for node in ast.walk(ast.parse(source, path)):
            kind = ("functions" if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                    else "classes" if isinstance(node, ast.ClassDef) else None)
            if kind:
                out[kind].append((node.end_lineno - node.lineno + 1, f"{path}:{node.name}"))
    return {k: sorted(v, key=lambda x: (-x[0], x[1])) for k, v in out.items()}


def report(rev: str) -> str:
    s = shape(rev)
    long = sum(1 for n, _ in s["functions"] if n > LONG)
    lines = [f"## {rev}: {len(s['files'])} files, {sum(n for n, _ in s['files'])} lines, "
             f"{len(s['functions'])} functions ({long} over {LONG} lines), {len(s['classes'])} classes", ""]
    for kind, label in (("functions", "function"), ("classes", "class"), ("files", "file")):
        lines += [f"| {label} | lines |", "| --- | ---: |"]
        lines += [f"| `{name}` | {n} |" for n, name in s[kind][:TOP]]
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("revs", nargs="+", help="git revisions (commits, branches, tags)")
    args = ap.parse_args(argv)
    print("\n".join(report(rev) for rev in args.revs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
