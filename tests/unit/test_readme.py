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


def test_the_layout_section_names_every_folder_of_the_package():
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    layout = text[text.index("## Layout"):text.index("\n## ", text.index("## Layout") + 1)]
    package = os.path.join(ROOT, "dit_train")
    folders = [d for d in sorted(os.listdir(package)) if os.path.isdir(os.path.join(package, d)) and d != "__pycache__"]
    assert len(folders) >= 10
    missing = [d for d in folders if f"`{d}/`" not in layout]
    assert not missing, f"README's layout section does not name {missing}"


def test_ci_runs_the_readmes_test_command():
    """.ci/run's last line is the README's test command (CI adds only --durations): CI tests what users run."""
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = re.search(r"bash scripts/setup.sh --dev && (python -m pytest[^\n]*)", f.read()).group(1)
    with open(os.path.join(ROOT, ".ci", "run")) as f:
        ci = f.read().strip().splitlines()
    assert "bash scripts/setup.sh --dev" in ci
    assert re.sub(r" --durations=\d+", "", ci[-1]) == readme, (ci[-1], readme)
