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


def test_the_layout_page_names_every_folder_of_the_package():
    with open(os.path.join(ROOT, "docs", "layout.md")) as f:
        layout = f.read()
    package = os.path.join(ROOT, "dit_train")
    folders = [d for d in sorted(os.listdir(package)) if os.path.isdir(os.path.join(package, d)) and d != "__pycache__"]
    assert len(folders) >= 10
    missing = [d for d in folders if f"`{d}/`" not in layout]
    assert not missing, f"docs/layout.md does not name {missing}"


def test_every_relative_link_in_readme_and_docs_resolves():
    """Markdown links and images to files of the checkout (web links and #anchors aside), from the page's folder;
    published study folders included (their reports link their plots)."""
    pages = ["README.md", *(os.path.relpath(os.path.join(d, f), ROOT) for d, _, fs in os.walk(os.path.join(ROOT, "docs"))
                            for f in fs if f.endswith(".md"))]
    assert len(pages) > 15
    broken = []
    for page in pages:
        with open(os.path.join(ROOT, page)) as f:
            text = re.sub(r"```.*?```", "", f.read(), flags=re.S)  # code is not a link
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            path = target.split("#")[0]
            if path and not re.match(r"[a-z]+:", path) and not os.path.exists(
                    os.path.join(ROOT, os.path.dirname(page), path)):
                broken.append(f"{page}: {target}")
    assert not broken, f"links to files that do not exist: {broken}"


# Python files the docs name that are not in the checkout, each for its reason
NOT_IN_THE_CHECKOUT = {
    "dit_train/optim/directions/sign.py": "docs/extending.md: the file it tells a user to write",
    "sign.py": "docs/extending.md: the same file saved beside a command of the user's own",
    "scripts/gpu_check_stages.py": "docs/layout.md: the layout before the restructure, beside the one after",
    "torch/storage.py": "docs/host_overhead.md: a file of torch's",
    "hubconf.py": "docs/fd_evaluation.md, docs/reliability.md: the entry file of a torch.hub checkout",
}


def test_every_python_file_the_docs_name_exists():
    """A `name.py` in the README or docs is a file of the checkout (the end of its path, as the pages abbreviate
    it: `optim/routing.py`): docs/data.md sent users to an `encode_latents.py` that was `dit-encode-latents`."""
    files = {os.path.relpath(os.path.join(d, f), ROOT) for d, _, fs in os.walk(ROOT) if "/.git" not in d
             for f in fs if f.endswith(".py")}
    pages = ["README.md",
             *(os.path.join("docs", f) for f in os.listdir(os.path.join(ROOT, "docs")) if f.endswith(".md"))]
    missing = []
    for page in pages:
        with open(os.path.join(ROOT, page)) as f:
            for name in re.findall(r"`([\w./-]+\.py)`", f.read()):
                if name not in NOT_IN_THE_CHECKOUT and not any(p == name or p.endswith("/" + name) for p in files):
                    missing.append(f"{page}: {name}")
    assert not missing, f"Python files the docs name that do not exist: {missing}"




def test_ci_runs_the_readmes_test_command():
    """.ci/run's last line is the README's test command (CI adds only --durations): CI tests what users run."""
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = re.search(r"bash scripts/setup.sh --dev && (python -m pytest[^\n]*)", f.read()).group(1)
    with open(os.path.join(ROOT, ".ci", "run")) as f:
        ci = f.read().strip().splitlines()
    assert "bash scripts/setup.sh --dev" in ci
    assert re.sub(r" --durations=\d+", "", ci[-1]) == readme, (ci[-1], readme)


def test_setup_installs_the_cpu_torch_wheel_where_no_torch_is_installed():
    """The README's demo line says setup.sh installs CPU torch where none is installed: PyPI's Linux wheel of
    torch is the CUDA build (with its nvidia-* CUDA packages), so the install names PyTorch's CPU index first, and
    falls back to the configured index where that one cannot be reached (a machine that sees only its registry)."""
    with open(os.path.join(ROOT, "scripts", "setup.sh")) as f:
        installs = [line.strip() for line in f if re.match(r"\s*pip install\b.*\btorch\b", line)]
    with open(os.path.join(ROOT, "README.md")) as f:
        assert "CPU torch" in f.read()
    assert len(installs) == 2, installs
    assert "--index-url https://download.pytorch.org/whl/cpu" in installs[0] and installs[0].endswith("||"), installs
    assert "--index-url" not in installs[1], installs
