"""Every command in the ```bash blocks of README.md and of every docs/ page runs, shortened, so the documentation
cannot drift from the code.

Each command (continuation lines joined, `&&` chains split, comments dropped) is matched by the longest prefix in
RUNNERS, which says how the test runs it: as written, with overrides or flags appended that make it short, or,
where it would take hours or needs a GPU cluster or Slurm, as much as runs here: its program's `--help`, and for
the trainer the job's config composed and checked (`--cfg job`). A documented command that no prefix matches
fails test_every_documented_command_has_a_runner: add its row when you add the command. The placeholders (a run
folder, a sweep folder, a checkpoint) become one tiny run folder that the training, sample, export and FD commands
share; the commands run through bash in a scratch folder holding a copy of `scripts/`, the files docs/extending.md
tells a user to write, and, first on PATH, this checkout's console scripts (pyproject's [project.scripts], called
as pip's wrappers call them). Published study folders (docs/results/<study>/) are records, not instructions."""

from __future__ import annotations

import glob
import os
import re
import shutil
import shlex
import subprocess
import sys
import tomllib

import pytest

from conftest import ROOT, needs_fashion

SHELL = "bash"

# the pages whose commands run: README first (its demo makes the run folder the others read), then docs/ in order
PAGES = ["README.md", *sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md"))),
         "docs/results/README.md"]
# pages another change rewrites this session (lead: delete each entry once that change is merged)
PENDING: dict[str, str] = {}

# placeholder paths -> the shared scratch run (a sweep is the folder holding it); [optional] flags: given
PLACEHOLDERS = {"runs/<date>/<time>-<suffix>": "runs/tiny", "runs/<run>": "runs/tiny", "runs/my_run": "runs/tiny",
                "sweeps/scaling_study": "runs", "[--dtype bf16]": "--dtype bf16",
                "/shared/runs/dit_15b_prw": "runs/tiny",
                "runs/x/checkpoints/step_00400000.dcp": "runs/tiny/checkpoints/step_00000002.dcp",
                "[--activation-checkpointing]": "--activation-checkpointing", "[hydra overrides]": "",
                "[--launch-us 8] [--view-us 2] [--top-ops] [--json out.jsonl]": "--launch-us 8 --view-us 2 --top-ops"}
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
    elif words[0] == "python":
        words = words[:2]
    else:  # a console script: argparse prints its help before it reads a positional (test_documented_studies_exist)
        words = words[:1]
    return " ".join(words + ["--help"])


def as_written(command: str) -> str:
    return command


def trainer_config(command: str) -> str:
    """A launcher's trainer command (torchrun/srun ... -m dit_train OVERRIDES): its overrides compose and pass the
    config check (Hydra prints the job's config); a `...` standing for elided words is dropped."""
    overrides = [w for w in command.split(" -m dit_train ", 1)[1].split() if w != "..."]
    return "python -m dit_train " + " ".join(overrides) + " --cfg job"


def all_at_once(program: str, extra: str):
    """Every documented command of `program` in one run: the words after `program` of each, in page order, then
    `extra` (argparse keeps an option's last value, so the run is `extra`'s, and every documented flag and value
    is still parsed). The commands shared one script's code paths and differed in flags; a run each was ~14 s."""
    def run(command: str) -> str:
        words = dict.fromkeys(c[len(program):].strip() for _, c in COMMANDS if runner_of(c) is RUNNERS[program])
        return " ".join([program, *words, extra])
    return run


def overrides_and_flags(overrides: str, flags: str):
    """appended(), with Hydra overrides as well: argparse takes the positional overrides as one run of words, so
    they go beside the command's own trailing ones, before the flags."""
    def run(command: str) -> str:
        return (f"{command} {overrides} {flags}" if "=" in command.split()[-1] else
                f"{command} {flags} {overrides}")
    return run


def syntax_only(command: str) -> str:
    """Needs Slurm (scontrol, srun): bash parses it."""
    return f"bash -n -c {shlex.quote(command)}"


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
    # GPU runs (8-32 GPUs): their overrides compose and pass the config check
    "torchrun --nproc_per_node 8 -m dit_train": trainer_config,
    "torchrun --nnodes 4 --nproc_per_node 8 --rdzv-endpoint $HEAD:29500 -m dit_train": trainer_config,
    "torchrun --nproc_per_node 8 --no-python dit-fd": help_of,
    # docs/optimizers.md: the benchmark on one tiny block (64 wide: the command's 512 made it the test's longest),
    # without its two compile_rownorm contenders: inductor's C++ compile of their kernels was ~37 of its 44 s of CPU
    # on a cold cache (CI's); the compiled RowNorm steps are tests/unit/test_fused_rownorm.py's
    "python -m benchmarks.bench_optimizer": appended("--preset dit_s --hidden-size 64 --depth 1 --repeats 1 "
                                                     "--warmup 0 --no-compile"),
    # docs/extending.md: the user's my_sign_train.py with the direction of the page, and my_train.py with its
    # metric (the scratch folder holds the files the page has a user write)
    "python my_sign_train.py optimizer=sign experiment=debug":
        appended("run_dir=runs/sign train.steps=2 train.val_every=0 train.sample_every=0"),
    "python my_train.py experiment=debug eval.mean_pixel.every_n_steps":
        appended("run_dir=runs/metric train.steps=2 train.val_every=0 train.sample_every=0 "
                 "eval.mean_pixel.every_n_steps=1"),
    # docs/fd_throughput.md
    "python -m benchmarks.bench_fd": appended("--batches 1 --encoders dinov2_random"),
    # docs/host_overhead.md: its commands differ in --optimizers and --blocks-per-unit; one run takes them all
    "python -m benchmarks.host_overhead": all_at_once("python -m benchmarks.host_overhead",
                                                      "--preset dit_xs model.depth=2 --world-size 2 --optimizers adamw "
                                                      "--blocks-per-unit 1 2"),
    "python -m benchmarks.block_ops --preset dit_15b --json": lambda command: (
        "python -m benchmarks.block_ops --preset dit_xs --json after.json"),
    "python -m benchmarks.block_ops --compare": lambda command: (  # one run compared with itself: the same lines
        "python -m benchmarks.block_ops --preset dit_xs --json before.json && cp before.json after.json && " + command),
    # docs/layout.md: reads this checkout's git history
    "python -m benchmarks.code_shape": lambda command: f"cd {ROOT} && {command}",
    # docs/scaling_out.md
    "torchrun --standalone --nproc_per_node 8 -m dit_train": trainer_config,
    "torchrun --nnodes 4 --nproc_per_node 8 --rdzv_id my_dit_15b": trainer_config,
    "torchrun --nnodes 4 --nproc_per_node 8 ... -m dit_train": trainer_config,
    "dit-comm-volume": as_written,
    "head=$(scontrol show hostnames": syntax_only,
    "export OMP_NUM_THREADS=": as_written,
    "srun --kill-on-bad-exit=1 dit-torchrun": lambda command: f"dit-torchrun --help && {trainer_config(command)}",
    "dit-estimate-memory --preset": overrides_and_flags("model.depth=2",
                                                        "--preset dit_xs --world-size 2 --micro-batch 2"),
    "dit-estimate-memory --table": appended("--presets dit_xs --optimizers adamw --world-sizes 2"),
}


def page_commands(page: str) -> list[str]:
    """Each command of the page's ```bash blocks, placeholders replaced; a line that is a comment (a script's
    shebang and #SBATCH lines) is no command."""
    with open(os.path.join(ROOT, page)) as f:
        blocks = re.findall(r"```bash\n(.*?)```", f.read(), re.S)
    commands = []
    for block in blocks:
        for line in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"\s+#\s.*$", "", line).strip()  # a trailing comment: '  # ...'
            if not line.startswith("#"):
                commands += [part.strip() for part in line.split(" && ") if part.strip()]
    for placeholder, value in PLACEHOLDERS.items():  # a whole word: sweeps/scaling_study_cpu stays
        commands = [re.sub(re.escape(placeholder) + r"(?=\s|$)", value, c) for c in commands]
    return [" ".join(c.split()) for c in commands]


def documented_commands() -> list[tuple[str, str]]:
    """(page, command) for every page that is not PENDING, in page order."""
    return [(page, c) for page in PAGES if page not in PENDING for c in page_commands(page)]


def runner_of(command: str):
    prefixes = [p for p in RUNNERS if command.startswith(p)]
    return RUNNERS[max(prefixes, key=len)] if prefixes else None


COMMANDS = documented_commands()


def test_every_documented_command_has_a_runner():
    missing = [f"{page}: {c}" for page, c in COMMANDS if runner_of(c) is None]
    assert not missing, f"documented commands without a row in RUNNERS (tests/integration/test_readme_commands.py): {missing}"
    assert len([c for page, c in COMMANDS if page == "README.md"]) >= 15  # the extraction found the blocks
    assert {"docs/scaling_out.md", "docs/studies.md", "docs/extending.md"} <= {page for page, _ in COMMANDS}
    # both worked examples of docs/extending.md end in a command that runs (the direction's was a comment)
    assert {c.split()[1] for page, c in COMMANDS if page == "docs/extending.md"} >= {"my_sign_train.py", "my_train.py"}
    assert all(os.path.exists(os.path.join(ROOT, page)) for page in PENDING)


def test_documented_studies_exist():
    """dit-study's commands run as `dit-study --help` (one process for all of them): the experiment each names is
    one dit-study accepts (the check it makes before it reads the experiment)."""
    from dit_train.config.files import group_options

    named = {c.split()[1] for _, c in COMMANDS if c.startswith("dit-study ")}
    assert "scaling_study_cpu" in named  # the extraction found them
    assert named <= set(group_options("experiment")), named - set(group_options("experiment"))


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
    with open(os.path.join(ROOT, "docs", "extending.md")) as f:  # the files the page has a user write
        blocks = re.findall(r"```python\n(.*?)```", f.read(), re.S)
    (folder / "mean_pixel.py").write_text(next(b for b in blocks if "class MeanPixel" in b))
    (folder / "sign.py").write_text(next(b for b in blocks if "class Sign(Direction)" in b))
    (folder / "my_sign_train.py").write_text(next(b for b in blocks if b.startswith("# my_sign_train.py")))
    (folder / "my_train.py").write_text(next(b for b in blocks if "import mean_pixel" in b))
    return folder


_RAN: dict[str, subprocess.CompletedProcess] = {}  # a shortened command that several README lines share runs once


@needs_fashion
@pytest.mark.parametrize("page,command", COMMANDS, ids=[f"{page}: {c}" for page, c in COMMANDS])
def test_documented_command_runs(scratch, page, command):
    """In page order, README first: the demo's run folder exists before the commands that read it."""
    runner = runner_of(command)
    if runner is None:
        pytest.fail(f"no runner for {command!r}")
    shortened = runner(command)
    if shortened not in _RAN:
        _RAN[shortened] = subprocess.run([SHELL, "-c", shortened], cwd=str(scratch), capture_output=True, text=True,
                                         timeout=300, env={**os.environ, "PYTHONPATH": ROOT,
                                                              "PATH": f"{scratch / 'bin'}:{os.environ['PATH']}"})
    r = _RAN[shortened]
    assert r.returncode == 0, f"{page}: {command}\nran as: {shortened}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
