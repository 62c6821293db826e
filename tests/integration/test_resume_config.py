"""`dit-train run_dir=X train.resume=auto` continues a run however it was started: the run's saved config with only
what the command line sets on top (dit_train/runs/resume_config.py). Before, a resume of any non-default run was refused
unless the original command was repeated in full (each key it did not repeat listed as a change)."""

import json
import os
import shlex
import shutil

import pytest

from conftest import needs_fashion, run_cli_in_process

pytestmark = needs_fashion
TINY = ["model.hidden_size=32", "model.depth=2", "model.num_heads=2", "model.patch_size=8", "train.batch_size=8",
        "train.val_every=0", "train.sample_every=0", "eval.every_n_steps=0", "train.progress=false",
        "train.log_every=1", "logger.wandb.mode=disabled"]


def dit_train(*args, cwd):
    """`python -m dit_train *args` in this process (conftest.run_cli_in_process; ~3 s less a command than a new
    Python): exit code, stdout, stderr."""
    proc = run_cli_in_process(*args, cwd=cwd)
    return proc.returncode, proc.stdout, proc.stderr


def steps_logged(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [r["step"] for r in map(json.loads, f) if "train/loss" in r]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A non-default run: muon at its own lr, a tiny model, 2 steps with a checkpoint."""
    root = tmp_path_factory.mktemp("resume_config")
    rc, out, err = dit_train(f"run_dir={root / 'run'}", "optimizer=muon", "optimizer.lr=3e-3", *TINY,
                             "train.steps=2", "train.ckpt_every=2", cwd=root)
    assert rc == 0, err
    return root


def test_a_resume_needs_only_the_run_folder_and_what_changes(run):
    rc, out, err = dit_train(f"run_dir={run / 'run'}", "train.resume=auto", "train.steps=3", cwd=run)
    assert rc == 0, err
    log = out + err
    assert "continuing with the config saved in" in log and "the command line changes train.steps" in log
    assert steps_logged(run / "run") == [1, 2, 3]
    saved = json.load(open(run / "run" / "checkpoints" / "step_00000003.dcp" / "train_state.json"))["config"]
    assert saved["optimizer"]["name"] == "muon" and saved["optimizer"]["lr"] == 3e-3 and saved["model"]["depth"] == 2


@pytest.mark.parametrize("change, named", [(["model.depth=3"], "model.depth: 2 -> 3); these keys"),
                                          (["optimizer=adamw"], 'optimizer.name: "muon" -> "adamw" (and ')])
def test_a_change_outside_the_resume_policy_is_refused_naming_only_it(run, change, named):
    """The refusal is the only output, and the run folder is as it was, its dit_train.log included (before, an INFO
    line `continuing with the config saved in ...` came first, on stdout and in the run's log)."""
    before = files_of(run / "run")
    rc, out, err = dit_train(f"run_dir={run / 'run'}", "train.resume=auto", *change, cwd=run)
    assert rc == 2 and err.strip().count("\n") == 0 and named in err, err
    assert out == ""
    assert files_of(run / "run") == before


def files_of(folder):
    """Every file under `folder` with its size and modification time."""
    return {os.path.relpath(os.path.join(d, f), folder): (os.stat(os.path.join(d, f)).st_size,
                                                          os.stat(os.path.join(d, f)).st_mtime_ns)
            for d, _, files in os.walk(folder) for f in files}


def test_a_fork_starts_from_its_sources_config_with_the_command_lines_changes(run):
    rc, out, err = dit_train(f"run_dir={run / 'fork'}", f"train.init_from={run / 'run'}", "optimizer.lr=1e-3",
                             "train.steps=2", cwd=run)
    assert rc == 0, err
    config = json.load(open(run / "fork" / "checkpoints" / "step_00000002.dcp" / "train_state.json"))["config"]
    assert config["optimizer"]["name"] == "muon" and config["optimizer"]["lr"] == 1e-3
    assert config["model"]["hidden_size"] == 32 and config["train"]["batch_size"] == 8


def test_a_run_in_a_folder_named_by_a_sweeps_overrides_resumes_with_its_saved_config(run, tmp_path):
    """A study's run folders are named by their overrides (`optimizer.lr=0.003,seed=0`): written into the compose
    of the saved run unescaped, such a run_dir was a Hydra syntax error, and the resume was judged as typed (a
    warning, then "trained with another config" for every key the command did not repeat)."""
    from dit_train.config.override_text import override

    folder = tmp_path / "sweep" / "optimizer.lr=0.003,optimizer=muon,seed=0"
    shutil.copytree(run / "run", folder)
    step = max(steps_logged(folder))
    rc, out, err = dit_train("train.resume=auto", override("run_dir", str(folder)), f"train.steps={step + 1}",
                             cwd=tmp_path)
    assert rc == 0, err
    log = out + err
    assert "continuing with the config saved in" in log and "judged as typed" not in log
    assert steps_logged(folder)[-1] == step + 1
    assert sorted(os.listdir(tmp_path)) == ["sweep"] and os.listdir(tmp_path / "sweep") == [folder.name]


def test_a_crafted_saved_config_resolves_nothing_on_resume(run, tmp_path, monkeypatch):
    """A run folder from elsewhere whose checkpoint's config holds `${oc.env:...}`: the resumed config kept it as
    an interpolation, so the reader's environment went into config.yaml, the logs and wandb's config. It is taken
    literally, as sampling and export take it."""
    from omegaconf import OmegaConf

    from conftest import compose
    from dit_train.runs.resume_config import continue_saved_config

    monkeypatch.setenv("DIT_TRAIN_TEST_SECRET", "s3cret")
    copy = tmp_path / "copy"
    shutil.copytree(run / "run", copy)
    for state_file in copy.glob("checkpoints/*.dcp/train_state.json"):
        state = json.loads(state_file.read_text())
        state["config"]["logger"]["wandb"]["name"] = "${oc.env:DIT_TRAIN_TEST_SECRET}"
        state_file.write_text(json.dumps(state))
    overrides = [f"run_dir={copy}", "train.resume=auto"]
    resumed = continue_saved_config(compose(overrides), overrides)
    assert resumed.logger.wandb.name == "${oc.env:DIT_TRAIN_TEST_SECRET}"
    assert "s3cret" not in OmegaConf.to_yaml(resumed, resolve=True)


def test_the_check_before_hydra_reads_the_checkpoints_train_state_once(run, monkeypatch, capsys):
    """`dit-train run_dir=RUN train.resume=auto ...`: the check rebuilds the run's config from the checkpoint and
    judges the resume on the same train_state.json; it read and parsed the file twice. Its verdicts are unchanged."""
    from dit_train.config import check_command_line
    from dit_train.runs import checkpoint as ckpt

    read = ckpt.read_json
    files = []
    monkeypatch.setattr(ckpt, "read_json", lambda file, *a, **kw: files.append(os.path.basename(file)) or
                        read(file, *a, **kw))
    check_command_line([f"run_dir={run / 'run'}", "train.resume=auto", "train.steps=3"])
    assert capsys.readouterr().err == "" and files == ["train_state.json"]
    files.clear()
    with pytest.raises(SystemExit) as stop:  # a refused change: the same line as before, from one read
        check_command_line([f"run_dir={run / 'run'}", "train.resume=auto", "optimizer.lr=1e-3"])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "optimizer.lr: 0.003 -> 0.001" in err and files == ["train_state.json"], err


def test_a_saved_config_declaring_another_model_than_its_tensors_is_refused_before_building(run, tmp_path):
    """A run folder from elsewhere whose checkpoints' saved config declares a wider model than their tensors: the
    resume built (and allocated) that model, then failed in the load with a traceback; a huge declared width or
    depth was an out-of-memory. The metadata's shapes decide first: one line naming both, exit 2, nothing
    written."""
    copy = tmp_path / "copy"
    shutil.copytree(run / "run", copy)
    for state_file in copy.glob("checkpoints/*.dcp/train_state.json"):
        state = json.loads(state_file.read_text())
        state["config"]["model"]["hidden_size"] = 64
        state_file.write_text(json.dumps(state))
    before = files_of(copy)
    rc, out, err = dit_train(f"run_dir={copy}", "train.resume=auto", "train.steps=3", cwd=tmp_path)
    assert rc == 2 and err.strip().count("\n") == 0, err
    assert "does not hold the weights of the model" in err and "(model tensors)" in err and "makes [384]" in err, err
    assert files_of(copy) == before


@pytest.mark.parametrize("folder", [["--config-dir", "{conf}"], ["hydra.searchpath=[file://{conf}]"]])
def test_a_run_of_the_users_own_experiment_resumes_with_its_options(tmp_path, folder):
    """`--config-dir DIR experiment=mine`: the check before Hydra composes the saved run's options with DIR too
    (before, it could not find experiment/mine and warned that the resume was judged as typed). The same with
    `hydra.searchpath=[file://DIR]`: the check refused experiment=mine, and the run itself composed without DIR."""
    (tmp_path / "conf" / "experiment").mkdir(parents=True)
    (tmp_path / "conf" / "experiment" / "mine.yaml").write_text("# @package _global_\noptimizer:\n  lr: 3e-3\n")
    folder = [f.format(conf=tmp_path / "conf") for f in folder]
    mine = [*folder, "experiment=mine", f"run_dir={tmp_path / 'run'}", *TINY]
    rc, out, err = dit_train(*mine, "train.steps=1", cwd=tmp_path)
    assert rc == 0, err
    rc, out, err = dit_train(*mine, "train.resume=auto", "train.steps=2", cwd=tmp_path)
    assert rc == 0 and "cannot compose" not in out + err, out + err
    assert "the command line changes train.steps" in out and steps_logged(tmp_path / "run") == [1, 2]


def test_a_resume_says_each_warning_once_and_a_refused_fresh_run_only_its_line(tmp_path):
    """The check before Hydra repeats the run's first steps quietly: the warning about an interrupted save's
    leftovers comes once (before, it was printed bare by the check, then again by the run). A fresh run into the
    folder is refused in one line and nothing else, the folder left as it was."""
    rc, out, err = dit_train(f"run_dir={tmp_path / 'run'}", *TINY, "train.steps=1", cwd=tmp_path)
    assert rc == 0, err
    (tmp_path / "run" / "checkpoints" / "step_00000002.dcp.tmp-123").mkdir()
    rc, out, err = dit_train(f"run_dir={tmp_path / 'run'}", "train.resume=auto", "train.steps=2", cwd=tmp_path)
    assert rc == 0 and (out + err).count("partial checkpoint") == 1, out + err
    before = files_of(tmp_path / "run")
    rc, out, err = dit_train(f"run_dir={tmp_path / 'run'}", *TINY, cwd=tmp_path)
    assert rc == 2 and out == "" and err == (f"error: run folder {tmp_path / 'run'} already has checkpoints "
                                             f"(step_00000002.dcp); pass train.resume=auto to continue it, or choose "
                                             f"a new run_dir\n"), out + err
    assert files_of(tmp_path / "run") == before


def trusting_copy(run, tmp_path):
    """A copy of the run as if handed over: its checkpoints' saved config trusts a torch.hub checkout the folder
    ships (`hub/hubconf.py`, named relative to where the user types the command), with FD every step."""
    copy = tmp_path / "copy"
    shutil.copytree(run / "run", copy)
    (copy / "hub").mkdir()
    marker = tmp_path / "hubconf_ran"
    (copy / "hub" / "hubconf.py").write_text(f"open({str(marker)!r}, 'w').close()\n"
                                              "def dinov2_vits14(**kw):\n    raise RuntimeError('a payload only')\n")
    (copy / "hub" / "dinov2_vits14_pretrain.pth").write_bytes(b"")
    for state_file in copy.glob("checkpoints/*.dcp/train_state.json"):
        state = json.loads(state_file.read_text())
        state["config"]["eval"].update(encoder="dinov2_vits14", encoder_path="copy/hub", trust_encoder_code=True,
                                       every_n_steps=1)
        state_file.write_text(json.dumps(state))
    return copy, marker


@pytest.mark.parametrize("how", ["resume", "fork"])
def test_a_saved_config_never_grants_trust_to_encoder_code(run, tmp_path, how):
    """A run folder from elsewhere whose checkpoint's config says eval.trust_encoder_code=true and names a torch.hub
    checkout it ships as the FD encoder: resuming or forking it imported that hubconf.py (the saved value held, as
    for any key the command line leaves alone). Trust comes from the command line only: the checkout is refused in
    one line naming the key, exit 2, and nothing runs or is written."""
    from conftest import compose
    from dit_train.runs.resume_config import continue_saved_config

    copy, marker = trusting_copy(run, tmp_path)
    command = {"resume": [f"run_dir={copy}", "train.resume=auto"],
               "fork": [f"run_dir={tmp_path / 'fork'}", f"train.init_from={copy}"]}[how]
    continued = continue_saved_config(compose(command), command)
    assert continued.eval.encoder_path == "copy/hub" and continued.eval.trust_encoder_code is False
    before = files_of(copy)
    rc, out, err = dit_train(*command, "train.steps=3", cwd=tmp_path)
    assert rc == 2 and err.strip().count("\n") == 0, err
    assert "hubconf.py' would run as Python" in err and "eval.trust_encoder_code=true" in err, err
    assert not marker.exists()
    assert files_of(copy) == before and not (tmp_path / "fork").exists()
    # the user's own word still counts: the same command with eval.trust_encoder_code=true gets past the check
    trusted = continue_saved_config(compose(command + ["eval.trust_encoder_code=true"]),
                                    command + ["eval.trust_encoder_code=true"])
    assert trusted.eval.trust_encoder_code is True


@pytest.mark.parametrize("how", ["resume", "fork"])
def test_a_saved_config_never_says_where_data_leaves_the_run_folder(run, tmp_path, caplog, how):
    """A run folder from elsewhere whose checkpoint's config logs online to the sender's wandb entity and puts the
    FD reference cache in a folder of its choosing: the resume (and a fork) kept both, so the user's run was
    uploaded, and reference statistics written and read outside the run folder. They come from the command line
    and the user's defaults; the dropped values are named in one warning line, as the overrides that keep them."""
    import logging

    from conftest import compose
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from dit_train.runs.resume_config import continue_saved_config

    copy = tmp_path / "copy"
    shutil.copytree(run / "run", copy)
    for state_file in copy.glob("checkpoints/*.dcp/train_state.json"):
        state = json.loads(state_file.read_text())
        state["config"]["logger"]["wandb"].update(mode="online", entity="sender", project="collect")
        state["config"]["eval"]["cache_dir"] = str(tmp_path / "sender's cache")
        state_file.write_text(json.dumps(state))
    command = {"resume": [f"run_dir={copy}", "train.resume=auto"],
               "fork": [f"run_dir={tmp_path / 'fork'}", f"train.init_from={copy}"]}[how]
    defaults = compose()
    with caplog.at_level(logging.WARNING, logger="dit_train"):
        continued = continue_saved_config(compose(command), command)
    assert continued.logger.wandb.mode == "disabled" and continued.logger.wandb.entity is None
    assert continued.logger.wandb.project == defaults.logger.wandb.project
    assert continued.eval.cache_dir == defaults.eval.cache_dir
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    # ready to pass: the shell splits them into overrides that Hydra reads back as the dropped values (the cache
    # folder's quote was shell-quoted only: pasted, `eval.cache_dir=/.../sender's cache` was a Hydra syntax error)
    words = shlex.split(warnings[0].split("word): ", 1)[1].rsplit("; pass them to keep them", 1)[0])
    assert {o.key_or_group: o.value() for o in OverridesParser.create().parse_overrides(words)} == {
        "logger.wandb.mode": "online", "logger.wandb.entity": "sender", "logger.wandb.project": "collect",
        "eval.cache_dir": f"{tmp_path}/sender's cache"}, warnings
    # the user's own word counts: the same command naming them continues with them, with no warning
    mine = command + ["logger.wandb.mode=offline", f"eval.cache_dir={tmp_path / 'mine'}"]
    caplog.clear()
    continued = continue_saved_config(compose(mine), mine)
    assert continued.logger.wandb.mode == "offline" and continued.eval.cache_dir == str(tmp_path / "mine")
    assert not [r for r in caplog.records if r.levelno == logging.WARNING and "cache_dir" in r.getMessage()]


def test_a_saved_option_name_that_is_a_path_is_never_composed(run, tmp_path):
    """A run folder from elsewhere whose checkpoint's config names its model `../../../<elsewhere>/evil`: the resume
    composed `model=<that>` to learn what the command line changed, so Hydra read evil.yaml from outside every config
    folder, and a `# @package _global_` file there set any key the saved config lacks (here data.root; resolvers
    such as ${oc.env:...} included). A saved option is composed only when it is a preset's plain name; the run
    continues its saved values and the key takes its default."""
    import yaml

    from conftest import CONF_DIR, compose
    from dit_train.runs.resume_config import continue_saved_config

    copy = tmp_path / "copy"
    shutil.copytree(run / "run", copy)
    name = os.path.relpath(tmp_path / "evil", os.path.join(CONF_DIR, "model"))
    for state_file in copy.glob("checkpoints/*.dcp/train_state.json"):
        state = json.loads(state_file.read_text())
        state["config"]["model"]["name"] = name
        del state["config"]["data"]["root"]
        state_file.write_text(json.dumps(state))
        model = state["config"]["model"]
    (tmp_path / "evil.yaml").write_text("# @package _global_\n" + yaml.safe_dump(
        {"model": model, "data": {"root": str(tmp_path / "from_evil_yaml")}}))
    overrides = [f"run_dir={copy}", "train.resume=auto", "train.steps=3"]
    resumed = continue_saved_config(compose(overrides), overrides)
    assert resumed.data.root == compose().data.root  # the default: nothing came from evil.yaml
    assert resumed.model.name == name and resumed.model.hidden_size == 32 and resumed.train.steps == 3


@pytest.mark.parametrize("resume, refused", [
    ([], "already has checkpoints"),
    (["train.resume=auto"], "optimizer.lr"),  # job 0 continues a run of lr 3e-3 at 1e-2
])
def test_a_sweep_job_that_would_be_refused_is_refused_before_hydra_rewrites_the_sweeps_record(run, tmp_path,
                                                                                            resume, refused):
    """Each sweep job's folder is known before Hydra starts (hydra.sweep.dir/subdir), so its resume is decided then:
    a rerun of a sweep, or one that changes a job's lr, was refused only inside the job, after Hydra had replaced
    the sweep folder's multirun.yaml with the refused command (found by a new-user trial)."""
    sweep = tmp_path / "S"
    shutil.copytree(run / "run", sweep / "0")
    (sweep / "multirun.yaml").write_text("the sweep's own record\n")
    before = files_of(sweep)
    rc, out, err = dit_train("--multirun", f"hydra.sweep.dir={sweep}", "hydra.sweep.subdir=${hydra.job.num}",
                             "optimizer=muon", "optimizer.lr=1e-2,3e-3", *TINY, "train.steps=2", *resume, cwd=tmp_path)
    assert rc == 2 and err.startswith("error: ") and err.count("\n") == 1 and refused in err, out + err
    assert files_of(sweep) == before and (sweep / "multirun.yaml").read_text() == "the sweep's own record\n"
