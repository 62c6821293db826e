"""The `dit-train` console script: it exists in pyproject, Hydra's tab completion lists the config groups through
it, the banner (checked with every command's --help) and log file say dit_train, an explicit run_dir leaves no
stray Hydra folder, and `experiment=debug` is a run of seconds."""

import os
import subprocess
import sys
import tomllib

from conftest import ROOT, needs_fashion

# this checkout's code, from any working directory; one intra-op thread: the suite runs two workers on two cores,
# and a trainer's second thread waits for a core the other worker holds (the debug run took 43 s in CI)
ENV = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}


def console_script() -> str:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)["project"]["scripts"]["dit-train"]


def run_console_script(args, cwd, env=ENV, timeout=120):
    """What the installed `dit-train` wrapper does: import the entry point and call it with argv[0] = dit-train."""
    module, function = console_script().split(":")
    code = f"import sys; sys.argv[0] = 'dit-train'; from {module} import {function}; sys.exit({function}())"
    return subprocess.run([sys.executable, "-c", code, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


COMPLETIONS = r"""
import contextlib, io, json, os, sys
from importlib import import_module

module, function = sys.argv[1].split(":")
result = []
for comp_line, args in json.loads(sys.argv[2]):
    if comp_line is None:
        os.environ.pop("COMP_LINE", None)
    else:
        os.environ["COMP_LINE"] = comp_line  # what bash sets when it asks for completions
    sys.argv = ["dit-train", *args]  # the installed wrapper's argv[0]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            code = getattr(import_module(module), function)() or 0
        except SystemExit as e:
            code = e.code or 0
    result.append([code, out.getvalue()])
print(json.dumps(result))
"""


def test_tab_completion_lists_the_config_groups(tmp_path):
    """The three completion calls bash makes through the console script, one after another in one process (each
    as the wrapper calls it, with its own COMP_LINE), not one interpreter and torch import each."""
    import json

    calls = [("dit-train ", ["-sc", "query=bash"]), ("dit-train optimizer=", ["-sc", "query=bash"]),
             (None, ["-sc", "install=bash"])]
    r = subprocess.run([sys.executable, "-c", COMPLETIONS, console_script(), json.dumps(calls)], cwd=tmp_path,
                       env={k: v for k, v in ENV.items() if k != "COMP_LINE"}, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    (code, groups), (options_code, options), (install_code, install) = json.loads(r.stdout.splitlines()[-1])
    assert code == options_code == install_code == 0, r.stdout[-3000:]
    assert {"model=", "optimizer=", "data=", "eval=", "logger=", "experiment="} <= set(groups.split())
    assert {"optimizer=muon", "optimizer=periodic_rowwise"} <= set(options.split())
    assert install.rstrip().endswith("hydra_bash_completion dit-train")
    assert not os.listdir(tmp_path)  # completion makes no run folder


@needs_fashion
def test_debug_experiment_is_small_and_an_explicit_run_dir_is_the_only_folder(tmp_path):
    """Its size is what makes it seconds long (12 s measured on an idle 2-core machine; the wall time itself is a
    measurement for the notes, not a test: a loaded CI machine would make it flaky)."""
    from conftest import compose, run_cli_in_process

    debug = compose(["experiment=debug", "run_dir=/tmp/unused"])
    assert debug.train.steps <= 20 and debug.train.val_samples <= 64 and debug.train.sample_steps <= 10
    out = run_console_script(["experiment=debug", "run_dir=run", "train.progress=false"], tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert os.listdir(tmp_path) == ["run"]  # Hydra's files went into the run folder: no runs/<date>/<time>/
    run = tmp_path / "run"
    assert (run / "dit_train.log").exists() and (run / "samples" / "step_00000020.png").exists()
    assert "end of run: checkpoint, validation loss (64 images x 2 t), sample grid (20 images, 10 steps), summary" \
        in out.stdout
    # the routing table's pointer to per-tensor routing is a command-line one, not a Python call
    assert "per tensor: the same command with train.dry_run=true" in out.stdout
    assert "optimizer adamw: AdamW on every parameter" in out.stdout and "routing.table()" not in out.stdout
    assert not any(line.startswith("step ") for line in out.stdout.splitlines())  # train.progress=false
    # the resume in this process (the console script ran above; its stdout and stderr are no terminal either), one
    # step on: what it shows is the trainer's, not the process's
    resumed = run_cli_in_process("experiment=debug", "run_dir=run", "train.resume=auto", "train.steps=21",
                                 "train.progress=true", cwd=tmp_path)  # else the saved run's false is continued
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    # train.progress (the default) into a pipe: no bar, but lines (progress_lines.py), the last step's always
    assert any(line.startswith("step 21/21 (100.0%), loss ") for line in resumed.stdout.splitlines()), resumed.stdout
    assert "%|" not in resumed.stderr
    assert os.listdir(tmp_path) == ["run"]  # nor does a resume


def test_a_run_dir_holding_an_interpolation_makes_only_the_folder_hydra_resolves(tmp_path):
    """`run_dir=runs/${now:%Y}`: Hydra resolves it (runs/2026); the entry made a folder under the literal name
    `${now:%Y}` first, left empty beside the run."""
    from conftest import run_cli_in_process

    out = run_cli_in_process("experiment=debug", "data=synthetic", "run_dir=runs/${now:%Y}", "train.dry_run=true",
                             cwd=str(tmp_path))
    assert out.returncode == 0, out.stderr[-2000:]
    assert not os.path.exists(tmp_path / "runs" / "${now:%Y}")


CHECK_EVERY_COMMAND = r"""
import contextlib, io, json, runpy, sys, warnings
from importlib import import_module

# runpy warns that a module it runs as __main__ was imported before (here, by the console-script call)
warnings.simplefilter("ignore", RuntimeWarning)

def help_text(call):
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            call()
            code = 0
        except SystemExit as e:
            code = e.code or 0
    return code, out.getvalue()

result = {}
for name, target in json.loads(sys.argv[1]).items():
    module, function = target.split(":")
    # the wrapper exits with what the function returns: anything but an exit status (a summary dict) is exit 1
    returns = getattr(import_module(module), function).__annotations__.get("return", "unannotated")
    assert returns in ("int", "None", int, None), f"{target} returns {returns}"
    sys.argv = [name, "--help"]
    script = help_text(getattr(import_module(module), function))
    sys.argv = [module, "--help"]
    as_module = help_text(lambda: runpy.run_module(module, run_name="__main__", alter_sys=True))
    result[name] = [script, as_module]
print(json.dumps(result))
"""


def test_every_console_script_and_its_python_m_form_answer_help_as_that_command(tmp_path):
    """Each [project.scripts] entry, called as the installed wrapper calls it, exits 0 on --help with a usage line
    naming the command; `python -m <its module> --help` is the same command (one form per command in the docs, the
    other kept working). dit-train's help is Hydra's, with a banner naming dit_train; dit-torchrun's is torchrun's
    and only exits 0."""
    import json

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        scripts = tomllib.load(f)["project"]["scripts"]
    assert len(scripts) >= 14 and all(name.startswith("dit-") for name in scripts)
    r = subprocess.run([sys.executable, "-c", CHECK_EVERY_COMMAND, json.dumps(scripts)], cwd=tmp_path, env=ENV,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    for name, ((code, text), (module_code, module_text)) in json.loads(r.stdout.splitlines()[-1]).items():
        assert code == 0 and module_code == 0, (name, text[-500:], module_text[-500:])
        if name == "dit-train":  # `python -m dit_train --help` as well as the console script
            assert text.startswith("dit_train is powered by Hydra") and module_text.startswith(
                "dit_train is powered by Hydra"), (text[:80], module_text[:80])
        if name not in ("dit-train", "dit-torchrun"):
            assert text.startswith(f"usage: {name} ") and module_text == text, (name, text[:200], module_text[:200])
