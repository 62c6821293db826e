"""Every command in README.md's ```bash blocks runs, shortened, so the README cannot drift from the code.

Each command (continuation lines joined, `&&` chains split, comments dropped) is matched by the longest prefix in
RUNNERS, which says how the test runs it: as written, with overrides or flags appended that make it short, or
as `--help` where it would take hours or needs a GPU cluster. A README command that no prefix matches fails
test_every_readme_command_has_a_runner: add its row when you add the command. The README's placeholders (a run
folder, a sweep folder) become one tiny run folder that the training, sample, export and FD commands share; the
commands run through bash in a scratch folder holding a copy of `scripts/` and, first on PATH, this checkout's
console scripts (pyproject's [project.scripts], called as pip's wrappers call them)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib

import pytest

from conftest import ROOT, needs_fashion

SHELL = "bash"

# the README's placeholder paths -> the shared scratch run (a sweep is the folder holding it)
PLACEHOLDERS = {"runs/<date>/<time>-<suffix>": "runs/tiny", "runs/<run>": "runs/tiny", "runs/my_run": "runs/tiny",
                "sweeps/scaling_study": "runs", "[--dtype bf16]": "--dtype bf16"}
TINY_RUN = ("model.hidden_size=32 model.depth=1 model.num_heads=1 model.patch_size=8 train.batch_size=4 "
            "train.val_every=2 train.val_samples=4 train.val_batch_size=4 train.val_t_points=1 train.sample_every=2 "
            "train.samples_per_class=1 train.sample_steps=1 train.warmup_steps=0 train.log_every=1")
TINY_FD = ("--eval-preset ci --encoder dinov2_random --cache-dir fd_cache --reference-split val --reference-num 16 "
           "--num-samples 8 --batch-size 8 --sample-steps 1")


def appended(extra: str):
    """Run the command as written, then `extra` (a later override or flag wins)."""
    return lambda command: f"{command} {extra}"


def help_of(command: str) -> str:
    """`--help` of the command's program (torchrun's script or module: run by python here)."""
    words = command.split()
    if words[0] == "torchrun" and "--no-python" in words:  # the program is the console script after the flag
        words = [words[words.index("--no-python") + 1]]
    elif words[0] == "torchrun":
        i = next(i for i, w in enumerate(words) if w.endswith(".py") or w == "-m")
        words = ["python", *words[i:i + (2 if words[i] == "-m" else 1)]]
    else:
        words = words[:2]
    return " ".join(words + ["--help"])


def as_written(command: str) -> str:
    return command


# README command prefix -> how this test runs it (the longest matching prefix is used); in README order
RUNNERS = {
    # installs packages: the script's syntax only
    "bash scripts/setup.sh": lambda command: "bash -n scripts/setup.sh",
    # the demo (1000 steps) as 2 steps of a tiny model: the run folder the later commands use
    "python -m dit_train": appended(f"run_dir=runs/tiny train.steps=2 {TINY_RUN}"),
    "python -m pytest": lambda command: f"cd {ROOT} && python -m pytest -q --collect-only tests/unit/test_readme.py",
    "dit-train experiment=debug": appended("run_dir=runs/debug train.steps=2 train.val_every=0 train.sample_every=0"),
    "dit-train optimizer=periodic_rowwise": appended("train.dry_run=true"),
    "dit-train --multirun": appended("train.dry_run=true"),
    "dit-train model=dit_4b train.dry_run=true": as_written,
    "dit-train run_dir=runs/tiny train.resume=auto": as_written,  # finished: says so and leaves it
    'eval "$(dit-train -sc install=bash)"': as_written,
    "dit-sample": appended("--steps 1 --per-class 1"),
    "dit-export": as_written,
    "dit-reference-stats": appended(TINY_FD),
    "dit-fd": appended(TINY_FD),
    "dit-study": help_of,
    "dit-report": help_of,
    "dit-paired-report": help_of,
    "dit-publish-study": help_of,
    "torchrun --nproc_per_node 8 --no-python dit-encode-latents": help_of,
    # a 32-GPU run: its overrides compose and pass the config check (Hydra prints the job's config)
    "torchrun --nnodes 4 --nproc_per_node 8 --rdzv-endpoint $HEAD:29500 -m dit_train":
        lambda command: "python -m dit_train " + command.split(" -m dit_train ", 1)[1] + " --cfg job",
    "torchrun --nproc_per_node 8 --no-python dit-fd": help_of,
}


def readme_commands() -> list[str]:
    """Each command of README.md's ```bash blocks, placeholders replaced."""
    with open(os.path.join(ROOT, "README.md")) as f:
        blocks = re.findall(r"```bash\n(.*?)```", f.read(), re.S)
    commands = []
    for block in blocks:
        for line in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"\s+#\s.*$", "", line).strip()  # a trailing comment: '  # ...'
            commands += [part.strip() for part in line.split(" && ") if part.strip()]
    for placeholder, value in PLACEHOLDERS.items():  # a whole word: sweeps/scaling_study_cpu stays
        commands = [re.sub(re.escape(placeholder) + r"(?=\s|$)", value, c) for c in commands]
    return [" ".join(c.split()) for c in commands]


def runner_of(command: str):
    prefixes = [p for p in RUNNERS if command.startswith(p)]
    return RUNNERS[max(prefixes, key=len)] if prefixes else None


COMMANDS = readme_commands()


def test_every_readme_command_has_a_runner():
    missing = [c for c in COMMANDS if runner_of(c) is None]
    assert not missing, (f"README commands without a row in RUNNERS (tests/integration/test_readme_commands.py): "
                         f"{missing}")
    assert len(COMMANDS) >= 20  # the extraction found the blocks


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    folder = tmp_path_factory.mktemp("readme")
    # a copy: through a link, setup.sh's `here/..` would name the scratch folder
    shutil.copytree(os.path.join(ROOT, "scripts"), folder / "scripts", ignore=shutil.ignore_patterns("__pycache__"))
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        scripts = tomllib.load(f)["project"]["scripts"]
    os.makedirs(folder / "bin")
    for name, target in scripts.items():  # what pip writes for an entry point, with this interpreter
        module, function = target.split(":")
        wrapper = folder / "bin" / name
        wrapper.write_text(f"#!{sys.executable}\nimport sys\nfrom {module} import {function}\n"
                           f"sys.argv[0] = {name!r}\nsys.exit({function}())\n")
        wrapper.chmod(0o755)
    return folder


_RAN: dict[str, subprocess.CompletedProcess] = {}  # a shortened command that several README lines share runs once


@needs_fashion
@pytest.mark.parametrize("command", COMMANDS)
def test_readme_command_runs(scratch, command):
    """In README order: the demo's run folder exists before the commands that read it."""
    runner = runner_of(command)
    if runner is None:
        pytest.fail(f"no runner for {command!r}")
    shortened = runner(command)
    if shortened not in _RAN:
        _RAN[shortened] = subprocess.run([SHELL, "-c", shortened], cwd=str(scratch), capture_output=True, text=True,
                                         timeout=300, env={**os.environ, "PYTHONPATH": ROOT,
                                                              "PATH": f"{scratch / 'bin'}:{os.environ['PATH']}"})
    r = _RAN[shortened]
    assert r.returncode == 0, f"{command}\nran as: {shortened}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
