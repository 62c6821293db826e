"""The command line as a user meets it: one-line errors, dry runs, multirun sweeps (most in the test's process)."""

import os
import subprocess
import sys
import time

import pytest

from conftest import ROOT, compose, needs_fashion, run_cli_in_process
from dit_train.config import ConfigError, validate


def cli(*args, cwd="/tmp", timeout=300):
    """`python -m dit_train *args` in this process (conftest.run_cli_in_process): a new Python importing torch is
    ~3 s a command. The real process is tested by test_bad_value_on_command_line_is_one_line (a refusal: exit code
    and stderr), test_dry_run_every_preset_from_any_directory (a dry run) and test_multirun_sweep_over_lr."""
    return run_cli_in_process(*args, cwd=cwd, timeout=timeout)


def cli_process(*args, cwd="/tmp", timeout=300):
    # one intra-op thread, as conftest gives each of CI's two workers: a second only adds contention on 2 cores
    return subprocess.run([sys.executable, "-m", "dit_train", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"})


def test_unknown_group_option_is_one_line_listing_choices():
    r = cli("optimizer=sgd")
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "optimizer='sgd'" in lines[0]
    assert "adamw, mud, muon, periodic_rowwise, rownorm" in lines[0]


def test_a_dry_run_prints_the_per_tensor_routing_without_pointing_at_a_python_call(tmp_path):
    """A dry run printed the summary's 'per tensor: optimizer.routing.table()' above the per-tensor table itself."""
    out = cli("model=dit_xs", "train.dry_run=true", cwd=str(tmp_path)).stdout
    assert "optimizer adamw: AdamW on every parameter" in out and "| x_embedder.proj.weight | (128, 16) | adamw |" in out
    assert "routing.table()" not in out


def test_a_dry_run_of_an_image_folder_says_its_shapes_are_the_presets(tmp_path):
    """A dry run reads no data: with data=image_folder it printed dit_xs's 1x32x32 size and 64 tokens as if they were
    the run's, which takes 3 channels, the images' size and the class folders from data.root."""
    r = cli("data=image_folder", f"data.root={tmp_path}", "model=dit_xs", "train.dry_run=true", cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert (f"shapes: the preset's (1x32x32, 10 classes); a dry run reads no data: the run takes channels, image "
            f"size and class count from data.root={tmp_path} (docs/data.md)") in r.stdout, r.stdout
    assert "shapes:" not in cli("model=dit_xs", "train.dry_run=true", cwd=str(tmp_path)).stdout
    # the README's `dit-train model=dit_4b train.dry_run=true` (latents, no data.root): was `from data.root=None`
    r = cli("model=dit_4b", "train.dry_run=true", cwd=str(tmp_path))
    assert ("a dry run reads no data: the run takes channels, image size and class count from the data at data.root "
            "(not set here; a run needs it) (docs/data.md)") in r.stdout, r.stdout


def test_dry_run_every_preset_from_any_directory(tmp_path):
    r = cli_process("model=dit_15b", "train.dry_run=true", cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert "15,158,211,088 parameters" in r.stdout and "dry run" in r.stdout
    # nothing written, not even Hydra's runs/<date>/<time>/ folder or an empty runs/ (Hydra's folder is a temporary)
    assert os.listdir(tmp_path) == []


def test_a_dry_run_sweep_writes_nothing(tmp_path):
    """`-m ... train.dry_run=true` left multirun/<date>/<time>/multirun.yaml behind."""
    r = cli("-m", "model=dit_xs", "train.dry_run=true", "optimizer=adamw", cwd=str(tmp_path))
    assert r.returncode == 0 and "dry run: nothing allocated" in r.stdout, r.stderr
    assert os.listdir(tmp_path) == []


def test_a_dry_run_under_a_launchers_world_size_joins_no_group_and_writes_nothing(tmp_path):
    """With torchrun's variables for rank 0 of 8, a dry run joined the process group and waited for 7 peers that
    never came, silently, leaving runs/<date>/<time>/ with .hydra/ and an empty dit_train.log. A real process: the
    old behaviour blocks in torch's rendezvous, which only a subprocess timeout can end."""
    env = {"WORLD_SIZE": "8", "RANK": "0", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "8", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": "29577"}
    r = subprocess.run([sys.executable, "-m", "dit_train", "model=dit_xs", "train.dry_run=true", "run_dir=mine"],
                       cwd=str(tmp_path), capture_output=True, text=True, timeout=60,
                       env={**os.environ, **env, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr
    assert ("world size 8 (WORLD_SIZE): config checked for 8 ranks; per-rank batch 8 of train.batch_size=64. This "
            "dry run is one process and joins no process group") in r.stdout
    assert os.listdir(tmp_path) == []  # nor the explicit run_dir


BAD = [
    ("train.steps=0", "train.steps=0"),
    ("train.batch_size=-4", "train.batch_size=-4"),
    ("train.lr_schedule=step", "train.lr_schedule='step'"),
    ("train.ema_decay=1.5", "train.ema_decay=1.5"),
    ("train.precision=fp8", "train.precision='fp8'"),
    ("train.grad_clip=-1", "train.grad_clip=-1"),
    ("train.resume=/no/such/run", "train.resume='/no/such/run'"),
    ("optimizer.lr=0", "optimizer.lr=0"),
    ("optimizer.lr=-1e-3", "optimizer.lr=-0.001"),
    ("model.patch_size=3", "model.patch_size=3"),
    ("model.num_heads=5", "model.num_heads=5"),
    ("model.in_channels=3", "model.in_channels=3"),
    ("flow.t_sampling=beta", "flow.t_sampling='beta'"),
    ("flow.t_std=0", "flow.t_std=0"),
    ("train.val_t_points=0", "train.val_t_points=0"),
    ("train.keep_last=-1", "train.keep_last=-1"),
    ("optimizer=periodic_rowwise optimizer.K=0", "optimizer.K=0"),
    ("optimizer=periodic_rowwise optimizer.K=1.5", "optimizer.K=1.5"),
    ("optimizer=muon optimizer.scale=huge", "optimizer.scale='huge'"),
    ("optimizer=muon optimizer.momentum=1.0", "optimizer.momentum=1.0"),
    ("data.name=cifar10", "data.name='cifar10'"),
    ("eval.every_n_steps=10 eval.num_samples=1", "eval.num_samples=1"),
    # types, and keys checked up front that used to fail only once the run had started
    ("optimizer.lr=abc", "optimizer.lr='abc'"),
    ("train.steps=1.5", "train.steps=1.5"),
    ("train.progress=yes", "train.progress='yes'"),
    ("logger.wandb.mode=bogus", "logger.wandb.mode='bogus'"),
    ("+optimizer.foo=1", "optimizer.foo=1"),
    ("+train.stepz=3", "train.stepz=3"),
    ("parallel.fsdp=maybe", "parallel.fsdp='maybe'"),
    ("parallel.reduce_dtype=float32", "parallel.reduce_dtype='float32'"),
    ("parallel.blocks_per_fsdp_unit=0", "parallel.blocks_per_fsdp_unit=0"),
    ("parallel.blocks_per_fsdp_unit=1.5", "parallel.blocks_per_fsdp_unit=1.5"),
    ("optimizer=muon optimizer.ns_dtype=bfloat16", "optimizer.ns_dtype='bfloat16'"),
    ("data.image_size=16 model.image_size=16", "data.image_size=16"),
    ("eval.encoder=clip", "eval.encoder='clip'"),
    ("eval.reference_split=test", "eval.reference_split='test'"),
    ("model.class_dropout_prob=1.0", "model.class_dropout_prob=1.0"),
]


@pytest.mark.parametrize("override,expected", BAD)
def test_bad_values_fail_before_heavy_work_with_one_line(override, expected):
    cfg = compose(["run_dir=/tmp/unused", *override.split()])
    with pytest.raises(ConfigError) as e:
        validate(cfg)
    msg = str(e.value)
    assert "\n" not in msg and expected in msg and ("valid" in msg or "must be" in msg)


def test_batch_not_divisible_by_world_size():
    cfg = compose(["run_dir=/tmp/unused", "train.batch_size=9"])
    with pytest.raises(ConfigError, match="train.batch_size=9 .*divisible by the world size 2"):
        validate(cfg, world_size=2)


def test_bad_value_on_command_line_is_one_line():
    r = cli_process("train.steps=0")
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "error: train.steps=0 is not valid: expected an integer >= 1"]


@pytest.mark.parametrize("args,line", [
    (["optimizer.lr=abc"], "error: optimizer.lr='abc' is not valid: expected a learning rate > 0"),
    (["logger.wandb.mode=bogus"],
     "error: logger.wandb.mode='bogus' is not valid: choose one of online, offline, disabled"),
    (["train.steps=1.5"], "error: train.steps=1.5 is not valid: expected an integer >= 1"),
    (["parallel.blocks_per_fsdp_unit=0"],
     "error: parallel.blocks_per_fsdp_unit=0 is not valid: expected an integer >= 1"),
    (["optimizer=muon", "optimizer.weight_decy=0.1"], "error: optimizer.weight_decy=0.1 is not valid: not a key of "
     "optimizer 'muon'; valid keys: "),
    (["--multirun", "optimizer.lr=1e-3,abc"], "error: optimizer.lr='abc' is not valid: expected a learning rate > 0"),
    (["run_dir="], "error: run_dir='' is not valid: expected a folder path"),  # was an unnamed ENOENT, exit 1
    # a top-level key named as typed: was `config.seed='abc'`
    (["seed=abc"], "error: seed='abc' is not valid: expected an integer"),
    # a misspelt section with a dotted key: was `config.trian={'steps': 3} is not valid: not a key of the run config`
    (["trian.steps=3"], "error: trian.steps='3' is not valid: not a config group or key; groups: data, model, "
                        "optimizer, eval, logger, launcher, experiment; keys: seed, run_dir, flow, train, "),
    # a flag Hydra does not know: was Hydra's 7-line usage and `__main__.py: error: unrecognized arguments`
    (["--dry-run", "experiment=debug"], "error: --dry-run is not a flag of dit-train (flags: --cfg, --config-dir, "),
    (["--resume=auto"], "error: --resume is not a flag of dit-train (flags: "),
    # an argparse prefix of --multirun: Hydra ran it as a sweep with every check here skipped (a dry run, as here,
    # left a multirun/ folder)
    (["--multi", "train.dry_run=true"], "error: --multi is not a flag of dit-train (flags: "),
    # a misspelt group: was Hydra's "Could not override 'optimzer'."
    (["optimzer=muon"], "error: optimzer='muon' is not valid: not a config group or key; groups: data, model, "
                        "optimizer, eval, logger, launcher, experiment; keys: seed, run_dir, flow, train, "),
    # a section of keys given one value, as if it were a group: was a traceback (AttributeError: 'str' object has
    # no attribute 'get'), or with other overrides Hydra's "Could not override 'train.dry_run'."
    (["train=x"], "error: train='x' is not valid: train is a section of keys, not a config group with options; set "
                  "its keys one by one (train.<key>=VALUE), its keys: steps, batch_size, "),
    (["flow=1", "train.dry_run=true"], "error: flow='1' is not valid: flow is a section of keys, not a config group "
                                       "with options; set its keys one by one (flow.<key>=VALUE), its keys: "
                                       "t_sampling, t_mean, t_std, shift"),
    (["study=x"], "error: study='x' is not valid: an experiment's grid for dit-study, set in its yaml "),
])
def test_bad_config_on_command_line_leaves_no_run_folder(tmp_path, args, line):
    """Checked before Hydra makes runs/<date>/<time> (or the sweep folder): one line, exit 2, seconds, nothing
    left in the working directory."""
    t0 = time.perf_counter()
    r = cli(*args, cwd=str(tmp_path))
    wall = time.perf_counter() - t0
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith(line), r.stderr
    assert wall < 30, wall  # ~1 s on an idle 2-core machine; before: 13 s for logger.wandb.mode=bogus
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("flag,meant", [("--dry-run", "train.dry_run=true"), ("--resume=auto", "train.resume=auto"),
                                        ("--steps", "train.steps=VALUE")])
def test_an_unknown_flag_names_the_override_it_may_have_meant(tmp_path, flag, meant):
    r = cli(flag, "experiment=debug", cwd=str(tmp_path))
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert lines[0].endswith(f"; did you mean the override {meant}?"), r.stderr
    assert os.listdir(tmp_path) == []


def test_slurm_launcher_without_multirun_is_refused_saying_what_to_type(tmp_path):
    """Hydra's launchers act only under --multirun: without it, launcher=slurm trained on the login node."""
    r = cli("launcher=slurm", "model=dit_s", f"run_dir={tmp_path / 'run'}", cwd=str(tmp_path))
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert lines[0] == ("error: launcher=slurm submits jobs to Slurm only under --multirun (without it the run would "
                        f"train here, on this machine): python -m dit_train --multirun launcher=slurm model=dit_s "
                        f"run_dir={tmp_path / 'run'}")
    assert os.listdir(tmp_path) == []


def test_stray_hydra_folder_is_removed_only_when_it_holds_only_hydra_files(tmp_path):
    """What __main__ calls when an error is found inside the Hydra job (after Hydra made the folder, e.g. under
    the Slurm launcher, where the check before Hydra does not run): Hydra's files only -> gone, with the empty
    date folder; anything the run wrote -> kept."""
    from dit_train.config import remove_stray_hydra_dir

    run = tmp_path / "runs" / "2024-01-01" / "12-00-00"
    (run / ".hydra").mkdir(parents=True)
    (run / "train.log").write_text("")
    remove_stray_hydra_dir(str(run))
    assert os.listdir(tmp_path / "runs") == []
    kept = tmp_path / "kept"
    (kept / ".hydra").mkdir(parents=True)
    (kept / "metrics.jsonl").write_text("{}")
    remove_stray_hydra_dir(str(kept))
    assert sorted(os.listdir(kept)) == [".hydra", "metrics.jsonl"]


@needs_fashion
def test_multirun_sweep_over_lr(tmp_path):
    r = cli_process("--multirun", "optimizer.lr=1e-3,3e-3", f"hydra.sweep.dir={tmp_path}/sweep",
            "model.hidden_size=32", "model.depth=1", "model.num_heads=1", "model.patch_size=8",
            "train.steps=2", "train.batch_size=4", "train.val_samples=4", "train.val_batch_size=4",
            "train.val_t_points=1", "train.sample_every=0", "train.samples_per_class=1", "train.sample_steps=1",
            "train.progress=false", "train.warmup_steps=0", cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr[-2000:]
    for job in ("0", "1"):
        assert os.path.exists(tmp_path / "sweep" / job / "summary.json")
    assert "lr: 0.003" in (tmp_path / "sweep" / "1" / "config.yaml").read_text()


@needs_fashion
def test_compile_rownorm_true_without_a_cxx_compiler_is_one_line_before_the_run_folder(tmp_path, monkeypatch):
    """No compiler on PATH (a fresh machine): before, the first step died in torch.compile's InvalidCxxCompiler
    traceback, the run folder written."""
    for name in ("CC", "CXX"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    r = cli(f"run_dir={tmp_path / 'run'}", "model.hidden_size=32", "model.depth=1", "model.num_heads=1",
            "model.patch_size=8", "train.batch_size=4", "train.steps=2", "optimizer=rownorm",
            "optimizer.compile_rownorm=true", cwd=str(tmp_path))
    assert r.returncode == 2 and r.stderr.splitlines() == [
        "error: optimizer.compile_rownorm=true on CPU needs a C++ compiler for torch.compile's kernels, and none is on "
        "PATH ($CXX, g++, c++ or clang++): install one, or use optimizer.compile_rownorm=auto (eager on CPU)"]
    assert not (tmp_path / "run").exists()


def test_a_missing_image_folder_is_refused_before_any_run_folder_exists(tmp_path):
    """The image folder was found missing only by the dataset, after Hydra had made runs/<date>/<time>/ (#28 item 3);
    now the pre-Hydra check refuses it, and nothing is left where the user ran the command."""
    r = cli("data=image_folder", f"data.root={tmp_path / 'missing'}", "model.in_channels=3", "model.image_size=64",
            "train.steps=1", cwd=str(tmp_path), timeout=120)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        f"error: data.root='{tmp_path / 'missing'}' is not valid: not a folder; image_folder needs "
        f"root/<class>/<images>"], r.stderr
    assert os.listdir(tmp_path) == []


def test_an_experiment_in_the_users_own_config_dir_runs(tmp_path):
    """`--config-dir DIR experiment=mine`, as Hydra users write it: DIR's experiment group joins ours (before, the
    check before Hydra refused `mine` as unknown); a dry run of it is dit_xs, as mine.yaml chooses."""
    (tmp_path / "conf" / "experiment").mkdir(parents=True)
    (tmp_path / "conf" / "experiment" / "mine.yaml").write_text(
        "# @package _global_\ndefaults:\n  - override /model: dit_xs\n")
    r = cli("--config-dir", str(tmp_path / "conf"), "experiment=mine", "train.dry_run=true", cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert "model dit_xs: 1,275,920 parameters" in r.stdout, r.stdout
    r = cli("--config-dir", str(tmp_path / "conf"), "experiment=yours", cwd=str(tmp_path))
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "valid: debug, lr_scan_cpu, mine, " in r.stderr, r.stderr
