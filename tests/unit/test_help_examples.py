"""The example command lines in a console script's --help (its module docstring, argparse's description) keep their
line breaks: a lone backslash at the end of a docstring line is Python's line continuation, so
`dit-encode-latents --help` printed `--out /data/latents         --image-size 256 --flip` as one line."""

import ast
import importlib.util
import os
import re
import tomllib

from conftest import ROOT


def console_script_modules():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        scripts = tomllib.load(f)["project"]["scripts"]
    return sorted({target.split(":")[0] for target in scripts.values()})


def test_no_docstring_line_of_a_command_is_joined_to_the_next():
    joined = []
    for module in console_script_modules():
        path = importlib.util.find_spec(module).origin
        source = open(path).read()
        doc = ast.get_docstring(ast.parse(source), clean=False)
        assert doc, module
        raw = source[: source.index('"""', source.index('"""') + 3)]  # the docstring as written, opening to closing
        joined += [f"{module}: {line.strip()[-60:]}" for line in raw.splitlines() if re.search(r"(?<!\\)\\$", line)]
    assert not joined, joined
