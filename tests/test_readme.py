"""The README's code that users copy must run as written."""

import os
import re

import pytest

from conftest import ROOT


def readme_block_after(marker: str) -> str:
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    start = text.index(marker)
    return re.search(r"```python\n(.*?)```", text[start:], re.S).group(1)


def test_optimizer_on_a_diffusers_model_example_runs(capsys, one_intra_op_thread):
    pytest.importorskip("diffusers")
    exec(compile(readme_block_after("The optimizers work in other training scripts too"), "README.md", "exec"), {})
    table = capsys.readouterr().out
    assert "| matrix | 19 |" in table and "97.1%" in table  # the numbers the README's comment states
