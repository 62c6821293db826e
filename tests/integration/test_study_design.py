"""dit-study keeps a study's design: study.json records it at the first invocation and a later invocation of a
changed design is refused before anything runs or is written; every group's trainer command line is checked
before study.json is written; a selected lr at an end of its scan is said. The runs are faked (a finished
checkpoint and a final validation loss per run, as test_study's finish_runs writes them): what is tested is
dit-study's bookkeeping, not training (test_study's end-to-end tests run real trainers)."""

import json
import re

import pytest
from omegaconf import OmegaConf

from test_study import finish_runs

from dit_train.config.errors import ConfigError
from dit_train.study import publish as publish_study
from dit_train.study import run as run_study

TINY = """# @package _global_
defaults:
  - override /model: dit_xs
study:
  name: tiny
  models: [dit_xs]
  optimizers: [adamw]
  selection_seeds: [20]
  seeds: [1, 2]
  lr_scan: {adamw: [1.0e-3, 2.0e-3]}
model: {hidden_size: 32, depth: 1, num_heads: 1, patch_size: 8}
train: {steps: 2, batch_size: 8, val_every: 0, sample_every: 0, ckpt_every: 0, resume: auto, progress: false}
eval: {every_n_steps: 0}
logger: {wandb: {mode: disabled}}
hydra:
  sweep: {dir: "sweeps/${study.name}", subdir: "${hydra.job.override_dirname}"}
  job: {config: {override_dirname: {exclude_keys: [experiment, launcher]}}}
"""


@pytest.fixture
def tiny(tmp_path, monkeypatch):
    """The study `tiny` in a config folder of the user's, and a trainer that finishes each run it is given (the
    final validation loss grows with the lr: the lowest value scanned is selected) unless told to exit 2."""
    conf = tmp_path / "conf" / "experiment"
    conf.mkdir(parents=True)
    (conf / "tiny.yaml").write_text(TINY)
    launched, exit_code = [], {"code": 0}

    def trainer(cmd):
        launched.append(cmd)
        if exit_code["code"]:
            return exit_code["code"]
        start = cmd.index("experiment=tiny") + 1
        at = next(i for i, o in enumerate(cmd) if o.startswith("seed="))
        fixed, extra = cmd[start:at], cmd[at + 2:]  # after seed=: hydra.sweep.dir, then the user's overrides
        sweep = next(o.split("=", 1)[1] for o in cmd if o.startswith("hydra.sweep.dir="))
        lr = float(next(o.split("=", 1)[1] for o in fixed if o.startswith("optimizer.lr=")))
        runs = [{"name": run_study.run_name([*fixed, f"seed={s}", *extra], ["experiment", "launcher"]), "lr": lr}
                for s in cmd[at][len("seed="):].split(",")]
        finish_runs(tmp_path / sweep, runs, lambda r: 0.2 + r["lr"])
        return 0

    monkeypatch.setattr(run_study, "run_trainer", trainer)

    def edit(old, new):
        text = (conf / "tiny.yaml").read_text()
        assert old in text
        (conf / "tiny.yaml").write_text(text.replace(old, new))

    def main(*extra):
        return run_study.main(["tiny", "--config-dir", str(tmp_path / "conf"), "--sweep-dir", str(tmp_path / "sweep"),
                               *extra])

    return type("Tiny", (), {"main": staticmethod(main), "edit": staticmethod(edit), "launched": launched,
                             "exit_code": exit_code, "sweep": tmp_path / "sweep"})


def test_a_studys_design_is_recorded_and_a_changed_design_is_refused_before_anything_runs(tiny, capsys):
    assert tiny.main() == 0
    out = capsys.readouterr().out
    assert len(tiny.launched) == 3  # two scan groups (seed 20), then seeds 1, 2 at the selected lr
    record = json.loads((tiny.sweep / "study.json").read_text())
    config = record["design"].pop("config")
    assert record["design"] == {"study": {"models": ["dit_xs"], "optimizers": ["adamw"], "selection_seeds": [20],
                                          "seeds": [1, 2], "lr_scan": {"adamw": [1e-3, 2e-3]}},
                                "train": {"steps": 2}}
    # the run config, as the yaml and the defaults set it, but for what each run or machine sets for itself
    assert {k: config[k] for k in ("train.batch_size", "train.warmup_steps", "model.hidden_size", "data.root")} == {
        "train.batch_size": 8, "train.warmup_steps": 100, "model.hidden_size": 32,
        "data.root": "/usr/share/datasets/fashion-mnist"}
    assert not {"seed", "optimizer.lr", "run_dir", "train.steps", "train.resume", "logger.wandb.mode"} & set(config)
    assert not [k for k in config if k.startswith(("study.", "hydra."))]
    record["design"]["config"] = config
    assert "design_first_invocation" not in record and len(record["invocations"][0]["design_sha256"]) == 64
    # the selected lr is the grid's lowest value, and the default lr_scan_extend=0 does not grow the scan
    assert "[study] dit_xs adamw: the selected lr=0.001 is the lowest value scanned and study.lr_scan_extend is 0" in out
    before = (tiny.sweep / "study.json").read_bytes()

    # the new user's edit: another selection seed, and the old one among the evaluation seeds
    tiny.edit("selection_seeds: [20]\n  seeds: [1, 2]", "selection_seeds: [21]\n  seeds: [1, 2, 3, 4, 20]")
    assert tiny.main() == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"error: {tiny.sweep / 'study.json'}: evaluation seed(s) [20] of study.seeds " \
                                    f"[1, 2, 3, 4, 20] chose the learning rates in this sweep" in err, err
    tiny.edit("selection_seeds: [21]\n  seeds: [1, 2, 3, 4, 20]", "selection_seeds: [20]\n  seeds: [1, 2]")
    tiny.edit("[1.0e-3, 2.0e-3]", "[1.0e-3, 2.0e-3, 4.0e-3]")  # one more lr for one optimizer, after evaluation
    assert tiny.main() == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "the study's design changed since study.json recorded it: study.lr_scan.adamw " \
                                    "was [0.001, 0.002], is [0.001, 0.002, 0.004] now" in err and "--sweep-dir" in err
    tiny.edit("[1.0e-3, 2.0e-3, 4.0e-3]", "[1.0e-3, 2.0e-3]")
    # a misspelled key, a bad value: the trainer's own one line before anything runs (the record stays as it was)
    for bad, line in (("train.stpes=3", "error: train.stpes=3 is not valid: not a key of train; valid keys: "),
                      ("train.steps=abc", "error: train.steps='abc' is not valid: expected an integer >= 1")):
        assert tiny.main(bad) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith(line), err
    assert len(tiny.launched) == 3 and (tiny.sweep / "study.json").read_bytes() == before

    # a record from before dit-study kept the design (the published ones): its design is recorded now, and said
    del record["design"]
    (tiny.sweep / "study.json").write_text(json.dumps(record))
    assert tiny.main() == 0
    assert "has no record of the study's design (written by an older dit-study): recording" in capsys.readouterr().out
    record = json.loads((tiny.sweep / "study.json").read_text())
    assert record["design"]["study"]["seeds"] == [1, 2] and record["design_first_invocation"] == 2
    assert [c["command"] for c in record["invocations"]] == [record["invocations"][0]["command"]] * 2
    assert len(tiny.launched) == 3  # every run was finished

    # pieces of the study elsewhere: published records of another design (one more seed) are not continued, nor
    # is this sweep published into their folder
    records = tiny.sweep.parent / "published" / "runs"
    records.mkdir(parents=True)
    other = {**record, "design": {**record["design"], "study": {**record["design"]["study"], "seeds": [1, 2, 3]}}}
    (records / "study.json").write_text(json.dumps(other))
    assert tiny.main("--records", str(records)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{records / 'study.json'}: the study's design changed since study.json " \
                                    f"recorded it: study.seeds was [1, 2, 3], is [1, 2] now" in err, err
    with pytest.raises(ConfigError, match=r"design differs from the one published in .*: study.seeds is \[1, 2\] "
                                          r"here, \[1, 2, 3\] there"):
        publish_study.refuse_another_study(str(tiny.sweep / "study.json"), str(records))
    assert len(tiny.launched) == 3


def test_a_changed_run_config_is_refused_and_a_design_recorded_without_one_gets_it(tiny, capsys):
    """Outside `study:` too (the yaml's train.batch_size, a command line's train.warmup_steps): an arm rerun under
    another batch size was paired with the arm run under the old one. What each run or machine sets for itself (a
    resume may change it: cadence, paths, logging) is no change of design."""
    assert tiny.main() == 0
    capsys.readouterr()
    before = (tiny.sweep / "study.json").read_bytes()
    tiny.edit("batch_size: 8", "batch_size: 16")
    assert tiny.main() == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "the study's design changed since study.json recorded it: config.train.batch_size " \
                                    "was 8, is 16 now; " in err and "restore train.batch_size in experiment tiny or " \
                                                                   "the command line's overrides, or run" in err, err
    tiny.edit("batch_size: 16", "batch_size: 8")
    assert tiny.main("train.warmup_steps=3") == 2
    assert "config.train.warmup_steps was 100, is 3 now" in capsys.readouterr().err
    assert (tiny.sweep / "study.json").read_bytes() == before and len(tiny.launched) == 3
    tiny.edit("sample_every: 0, ckpt_every: 0", "sample_every: 7, ckpt_every: 0, keep_last: 3")
    assert tiny.main() == 0 and len(tiny.launched) == 3  # every run is finished: none launched
    tiny.edit("sample_every: 7, ckpt_every: 0, keep_last: 3", "sample_every: 0, ckpt_every: 0")

    # a design recorded by an older dit-study (study: and steps): compared on what it has, the run config added
    record = json.loads((tiny.sweep / "study.json").read_text())
    config = record["design"].pop("config")
    (tiny.sweep / "study.json").write_text(json.dumps(record))
    assert tiny.main() == 0
    assert "records the study's design without its run config (written by an older dit-study): recording this " \
           "invocation's run config into it" in capsys.readouterr().out
    record = json.loads((tiny.sweep / "study.json").read_text())
    assert record["design"]["config"] == config and record["design_config_first_invocation"] == 3
    assert "design_first_invocation" not in record
    tiny.edit("batch_size: 8", "batch_size: 16")
    assert tiny.main() == 2 and "config.train.batch_size was 8, is 16 now" in capsys.readouterr().err
    tiny.edit("batch_size: 16", "batch_size: 8")

    # published pieces: another run config is refused (--records, dit-publish-study); an older design is not
    records = tiny.sweep.parent / "published" / "runs"
    records.mkdir(parents=True)
    other = {**record, "design": {**record["design"], "config": {**config, "train.batch_size": 16}}}
    (records / "study.json").write_text(json.dumps(other))
    assert tiny.main("--records", str(records)) == 2
    assert "config.train.batch_size was 16, is 8 now" in capsys.readouterr().err
    with pytest.raises(ConfigError, match=r"config.train.batch_size is 8 here, 16 there"):
        publish_study.refuse_another_study(str(tiny.sweep / "study.json"), str(records))
    older = {**record, "design": {k: v for k, v in record["design"].items() if k != "config"}}
    (records / "study.json").write_text(json.dumps(older))
    publish_study.refuse_another_study(str(tiny.sweep / "study.json"), str(records))
    assert tiny.main("--records", str(records)) == 0 and len(tiny.launched) == 3


@pytest.mark.parametrize("old, new, line", [
    ("lr_scan: {adamw: [1.0e-3, 2.0e-3]}", "lr_scan: {adamw: [1.0e-3, 2.0e-3]}\n  lr_scan_extnd: 1",
     "study.lr_scan_extnd=1 is not valid: not a key of study; valid keys: K, axes, common_lr, lr, lr_scan, "
     "lr_scan_extend, models, name, notes, optimizers, rownorm_scale, seeds, selection_seeds"),
    ("seeds: [1, 2]", "seeds: [1, 2]\n  lr_scan_extend: -1",
     "study.lr_scan_extend=-1 is not valid: expected an integer >= 0"),
    ("seeds: [1, 2]", "seeds: [1, 2]\n  lr_scan_extend: 1.5",
     "study.lr_scan_extend=1.5 is not valid: expected an integer >= 0"),
    ("seeds: [1, 2]", "seeds: [1, 2]\n  lr_scan_extend: lots",
     "study.lr_scan_extend='lots' is not valid: expected an integer >= 0"),
    ("[1.0e-3, 2.0e-3]", "[abc, 2.0e-3]", "study.lr_scan={'adamw': ['abc', 0.002]} is not valid: null or a mapping "
                                          "of optimizer to a non-empty list of distinct positive numbers"),
    ("[1.0e-3, 2.0e-3]", "[]", "study.lr_scan={'adamw': []} is not valid: null or a mapping of optimizer to a "
                               "non-empty list"),
    ("[1.0e-3, 2.0e-3]", "[1.0e-3, 1.0e-3]", "study.lr_scan={'adamw': [0.001, 0.001]} is not valid: null or a "
                                             "mapping of optimizer to a non-empty list of distinct positive numbers"),
    ("seeds: [1, 2]", "seeds: [1, 1]",
     "study.seeds=[1, 1] is not valid: expected a non-empty list of distinct integer seeds"),
    ("seeds: [1, 2]", "seeds: [1, 2]\n  axes: {train.steps: [3, 4]}",
     "study.axes may not name train.steps: a study's runs are of one length (its reports compare runs of one "
     "length, and refuse a sweep of several); run one study per horizon, each in its own --sweep-dir"),
    (None, "hydra.sweep.dir=elsewhere", "hydra.sweep.dir=elsewhere: dit-study places each run in <sweep folder>/<its "
                                        "overrides> itself, where study.json finds it; give the sweep folder as "
                                        "--sweep-dir"),
    (None, "hydra.sweep.subdir=x", "hydra.sweep.subdir=x: dit-study places each run"),
    (None, "hydra.run.dir=x", "hydra.run.dir=x: dit-study places each run"),
])
def test_a_study_dit_study_cannot_run_as_written_is_one_line_before_anything_is_written(tiny, capsys, old, new,
                                                                                        line):
    """Each `study:` key by its declaration (keys.py: unknown, wrong type or range, repeats), a horizon as an axis,
    and a command line that would put the runs where study.json does not look: one line, exit 2, nothing written
    and no trainer started (they were ignored, rounded, a TypeError, an endless wait with exit 0, or runs that only
    the reports refused)."""
    if old is None:
        assert tiny.main(new) == 2
    else:
        tiny.edit(old, new)
        assert tiny.main() == 2
    err = capsys.readouterr().err
    prefix = "error: " if old is None else "error: tiny: "
    assert err.count("\n") == 1 and err.startswith(prefix + line), err
    assert not tiny.launched and not tiny.sweep.exists()


def test_a_group_the_trainer_refuses_is_not_to_be_retried_by_rerunning(tiny, capsys):
    """A trainer's exit 2 (its config check: the resume of a run folder it refuses, say) cannot be fixed by running
    the same command again; any other failure can."""
    tiny.exit_code["code"] = 2
    assert tiny.main() == 1
    out = capsys.readouterr().out
    assert "[study] 2 group(s) refused by the trainer's config check (exit 2, the error above): rerunning the same " \
           "command cannot fix that" in out and "rerun the same command to retry" not in out
    tiny.exit_code["code"] = 1
    assert tiny.main() == 1
    assert "[study] 2 group(s) failed; rerun the same command to retry them" in capsys.readouterr().out


def test_a_group_whose_run_folder_is_busy_is_to_be_rerun_later(tiny, capsys):
    """A trainer's exit 73 (another process holds a run folder's lock) is not a config refusal: waiting and rerunning
    fixes it, and the study went on to its other groups."""
    from dit_train.runs.lock import EXIT_RUN_FOLDER_BUSY

    tiny.exit_code["code"] = EXIT_RUN_FOLDER_BUSY
    assert tiny.main() == 1
    out = capsys.readouterr().out
    assert len(tiny.launched) == 2  # both scan groups started: one busy folder does not stop the others
    assert "[study] 2 group(s) stopped at a run folder in use by another process (exit 73, the error above): rerun " \
           "the same command when it has finished" in out, out
    assert "refused by the trainer's config check" not in out and "group(s) failed" not in out, out


def study(**changes):
    return OmegaConf.create({"models": ["dit_s"], "optimizers": ["adamw", "muon"], "selection_seeds": [20],
                             "seeds": [1, 2, 3], "lr_scan": {"adamw": [1e-3, 2e-3], "muon": [4e-3, 8e-3]}, **changes})


def test_every_change_of_a_recorded_design_is_refused_naming_the_key():
    """Adding an evaluation seed is refused like any change (seeds added once results are seen are optional
    stopping); a record without a design still refuses another selection seed and the reuse of one."""
    old = {"design": run_study.study_design(study(), 600)}
    run_study.check_design(old, run_study.study_design(study(notes="text", name="other"), 600), study(), "s", "x")
    for changed, steps, key, was, now in (
            (study(seeds=[1, 2, 3, 4]), 600, "study.seeds", "[1, 2, 3]", "[1, 2, 3, 4]"),
            (study(), 900, "train.steps", "600", "900"),
            (study(lr_scan_extend=1), 600, "study.lr_scan_extend", "absent", "1"),  # not the text '(absent)'
            (study(optimizers=["adamw"]), 600, "study.optimizers", "['adamw', 'muon']", "['adamw']")):
        with pytest.raises(ValueError, match="^" + re.escape(f"s: the study's design changed since study.json "
                                                             f"recorded it: {key} was {was}, is {now} now; ")):
            run_study.check_design(old, run_study.study_design(changed, steps), changed, "s", "x")
    legacy = {"runs": [{"name": "a", "model": "dit_s", "optimizer": "muon", "seed": 20, "phase": "scan"}]}
    run_study.check_design(legacy, {}, study(), "s", "x")  # its own selection seed: no change
    with pytest.raises(ValueError, match=r"selection seed\(s\) \[20\] chose the learning rates in this sweep; "
                                         r"study.selection_seeds is \[21\] now"):
        run_study.check_design(legacy, {}, study(selection_seeds=[21]), "s", "x")
    with pytest.raises(ValueError, match=r"evaluation seed\(s\) \[20\] of study.seeds \[1, 20\] chose the "):
        run_study.check_design(legacy, {}, study(selection_seeds=[21], seeds=[1, 20]), "s", "x")


def test_a_selected_lr_at_an_end_of_its_scan_is_said_unless_the_scan_may_still_grow():
    loss = {"0.001": 0.3, "0.002": 0.2, "0.004": 0.25}
    assert run_study.edge_note("v", {"lr": 0.002, "val_loss": loss}, study()) is None
    low = run_study.edge_note("v", {"lr": 0.001, "val_loss": loss}, study())
    assert low.startswith("[study] v: the selected lr=0.001 is the lowest value scanned and study.lr_scan_extend "
                          "is 0, so the scan does not grow: the best lr may lie beyond it")
    high = run_study.edge_note("v", {"lr": 0.004, "val_loss": loss}, study(lr_scan_extend=1))
    assert "the highest value scanned and the scan grew by study.lr_scan_extend=1 value(s) at that end" in high
    assert run_study.edge_note("v", {"lr": 0.001, "val_loss": {"0.001": 0.3}}, study()) is None  # a one-value scan
