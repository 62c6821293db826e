"""Run records received from elsewhere (a colleague's tarball) given to dit-report, dit-paired-report and
dit-publish-study: a record that points outside the sweep, a crafted value, another study or a half-finished copy is
one line and exit status 2, refused before anything is written; a published file is never left torn; text from a
record goes into report.md as text, never as HTML or a forged heading or row."""

import json
import math
import os
import subprocess
import sys

import pytest
import yaml

from conftest import ROOT
from dit_train.study import paired_report
from dit_train.study import publish as publish_study
from dit_train.study import report
from test_paired_report import two_phase_sweep
from test_study import train_rows, write_run


def finished_run(folder, opt="adamw", seed=0, steps=4, summary=True, val=0.5, model="dit_xs"):
    """A run of `steps` planned steps (config.yaml's train.steps), finished when `summary`."""
    write_run(folder, model, opt, seed, train_rows(0.01, 0.1, 0) + [{"step": 4, "val/loss": val}], summary=summary)
    set_config(folder, train={"steps": steps})


def set_config(folder, **values):
    path = os.path.join(folder, "config.yaml")
    with open(path) as f:
        cfg = yaml.safe_load(f)
    for key, value in values.items():
        cfg[key] = {**cfg.get(key, {}), **value} if isinstance(value, dict) else value
    with open(path, "w") as f:
        yaml.safe_dump(cfg, f)


def one_line_error(capsys, *words) -> str:
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err, err
    for w in words:
        assert w in err, err
    return err


def edit_study(sweep, fn):
    study = json.loads((sweep / "study.json").read_text())
    fn(study)
    (sweep / "study.json").write_text(json.dumps(study))


# 1: study.json's run names are folders of the sweep itself
@pytest.mark.parametrize("name", ["ABS", "../elsewhere", "sub/../../elsewhere", "link"])
def test_a_run_name_outside_the_sweep_or_a_linked_run_folder_is_refused(tmp_path, capsys, name):
    sweep, elsewhere = tmp_path / "sweep", tmp_path / "elsewhere"
    two_phase_sweep(sweep)
    victim = "muon_lr0.016_s1"
    os.rename(sweep / victim, elsewhere)  # the records the attacker's name reaches
    given = {"ABS": str(elsewhere), "link": victim}.get(name, name)
    if name == "link":
        os.symlink(elsewhere, sweep / victim)
    edit_study(sweep, lambda s: [r.update(name=given) for r in s["runs"] if r["name"] == victim])
    assert paired_report.main([str(sweep)]) == 2
    one_line_error(capsys, repr(given) if name != "link" else "symbolic link")
    assert not (sweep / "report.md").exists()
    # dit-publish-study reads the published copy's study.json the same way: refused before anything is copied
    if name != "link":
        assert publish_study.main([str(sweep), str(tmp_path / "dest")]) == 2
        one_line_error(capsys, repr(given))
        assert not (tmp_path / "dest").exists()


# 2: dit-report reads only regular files of the sweep
@pytest.mark.parametrize("record", ["metrics.jsonl", "summary.json", "config.yaml", "run_info.json", "study.json"])
@pytest.mark.parametrize("kind", ["link", "fifo"])
def test_dit_report_refuses_a_linked_or_fifo_record(tmp_path, capsys, record, kind):
    sweep = tmp_path / "sweep"
    finished_run(sweep / "a")
    (sweep / "a" / "run_info.json").write_text(json.dumps({"git_commit": "abc"}))
    (sweep / "study.json").write_text(json.dumps({"experiment": "e", "runs": []}))
    secret = tmp_path / "secret"
    secret.write_text(json.dumps({"steps": 4, "val_loss": 0.123456, "git_commit": "SECRET", "experiment": "S"}))
    path = sweep / record if record == "study.json" else sweep / "a" / record
    path.unlink()
    os.symlink(secret, path) if kind == "link" else os.mkfifo(path)
    assert report.main([str(sweep)]) == 2
    one_line_error(capsys, record, "symbolic link" if kind == "link" else "not a regular file")
    assert not (sweep / "report.md").exists()


# 3: a failed publish leaves every published file whole
PUBLISH_WITH_FILE_LIMIT = """
import resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG (as on a full disk)
resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[3]), int(sys.argv[3])))
from dit_train.study import publish
sys.exit(publish.main(sys.argv[1:3]))
"""


def test_a_publish_that_fails_mid_copy_leaves_the_published_records_whole(tmp_path):
    sweep, dest = tmp_path / "sweep", tmp_path / "dest"
    finished_run(sweep / "a")
    assert publish_study.main([str(sweep), str(dest)]) == 0
    before = {n: (dest / "runs" / "a" / n).read_bytes() for n in os.listdir(dest / "runs" / "a")}
    big = [{"step": s, "train/loss": 1.0, "pad": "x" * 900} for s in range(1, 200)]  # ~180 KB of metrics
    with open(sweep / "a" / "metrics.jsonl", "a") as f:
        f.writelines(json.dumps(r) + "\n" for r in big)
    limit = 64 << 10  # every other file fits; the new metrics.jsonl does not
    done = subprocess.run([sys.executable, "-c", PUBLISH_WITH_FILE_LIMIT, str(sweep), str(dest), str(limit)],
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT}, capture_output=True, text=True)
    after = {n: (dest / "runs" / "a" / n).read_bytes() for n in os.listdir(dest / "runs" / "a")}
    assert after == before  # shutil.copy2 straight onto metrics.jsonl had cut it at 64 KiB (and left a traceback)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("error: ") and done.stderr.count("\n") == 1 and "File too large" in done.stderr


def test_publishing_a_sweep_onto_itself_is_one_line(tmp_path, capsys):
    finished_run(tmp_path / "x" / "runs" / "a")
    assert publish_study.main([str(tmp_path / "x" / "runs"), str(tmp_path / "x")]) == 2  # was shutil.SameFileError
    one_line_error(capsys, "runs")


# 4: an unfinished copy never replaces a finished published run
def test_an_unfinished_sweep_run_never_replaces_a_finished_published_one(tmp_path, capsys):
    sweep, dest = tmp_path / "sweep", tmp_path / "dest"
    finished_run(sweep / "a", val=0.5)
    assert publish_study.main([str(sweep), str(dest)]) == 0
    published = {n: (dest / "runs" / "a" / n).read_bytes() for n in os.listdir(dest / "runs" / "a")}
    finished_run(sweep / "a", val=0.9, summary=False)  # the run started again on another machine, unfinished
    (sweep / "a" / "summary.json").unlink()
    finished_run(sweep / "b", opt="muon")
    capsys.readouterr()
    assert publish_study.main([str(sweep), str(dest)]) == 0
    assert f"kept {dest / 'runs' / 'a'}" in capsys.readouterr().out
    assert {n: (dest / "runs" / "a" / n).read_bytes() for n in os.listdir(dest / "runs" / "a")} == published
    assert (dest / "runs" / "b" / "summary.json").exists()
    # a summary short of train.steps is no finished run either: it replaces nothing finished
    finished_run(sweep / "a", val=0.9)
    (sweep / "a" / "summary.json").write_text(json.dumps({"steps": 2, "val_loss": 0.9}))
    assert publish_study.main([str(sweep), str(dest)]) == 0
    assert {n: (dest / "runs" / "a" / n).read_bytes() for n in os.listdir(dest / "runs" / "a")} == published


# 5: one destination, one study
def test_publishing_another_experiment_into_a_destination_is_refused(tmp_path, capsys):
    dest = tmp_path / "dest"
    for exp in ("first", "second"):
        finished_run(tmp_path / exp / "a", opt="adamw" if exp == "first" else "muon")
        (tmp_path / exp / "study.json").write_text(json.dumps({"experiment": exp, "command": f"dit-study {exp}",
                                                               "runs": []}))
    assert publish_study.main([str(tmp_path / "first"), str(dest)]) == 0
    study = (dest / "runs" / "study.json").read_bytes()
    config = (dest / "runs" / "a" / "config.yaml").read_bytes()
    assert publish_study.main([str(tmp_path / "second"), str(dest)]) == 2
    one_line_error(capsys, "'first'", "'second'")
    assert (dest / "runs" / "study.json").read_bytes() == study and (dest / "runs" / "a" / "config.yaml").read_bytes() \
        == config


# 6: no record file larger than any run writes
def test_a_record_larger_than_any_run_writes_is_not_published(tmp_path, capsys):
    sweep, dest = tmp_path / "sweep", tmp_path / "dest"
    finished_run(sweep / "a")
    with open(sweep / "a" / "metrics.jsonl", "r+b") as f:
        f.truncate(600 << 20)  # sparse: no disk used here; a gigabyte in the destination before
    assert publish_study.main([str(sweep), str(dest)]) == 2
    one_line_error(capsys, "metrics.jsonl", "bytes")
    assert not dest.exists()


# 7: study.json's labels agree with the runs' config.yaml
@pytest.mark.parametrize("key, value", [("optimizer", {"name": "adamw"}), ("optimizer", {"lr": 0.5}),
                                        ("seed", 3), ("optimizer", {"K": 5})])
def test_a_run_whose_config_disagrees_with_its_study_label_is_refused(tmp_path, capsys, key, value):
    sweep = tmp_path / "sweep"
    two_phase_sweep(sweep)
    set_config(sweep / "pr_lr0.008_s1", **{key: value})  # e.g. an AdamW run labelled periodic_rowwise
    assert paired_report.main([str(sweep)]) == 2
    one_line_error(capsys, "pr_lr0.008_s1", "config.yaml")
    assert not (sweep / "report.md").exists()
    assert publish_study.main([str(sweep), str(tmp_path / "dest")]) == 2  # refused before anything is copied
    one_line_error(capsys, "pr_lr0.008_s1", "config.yaml")
    assert not (tmp_path / "dest").exists()


# 8: finished = summary.json at train.steps, in the reports as in dit-study
def test_a_summary_short_of_train_steps_is_not_a_finished_run_in_the_reports(tmp_path):
    sweep = tmp_path / "sweep"
    finished_run(sweep / "a", steps=600)  # its summary says step 4
    text = report.build_report(str(sweep))
    assert "| a | incomplete (summary at step 4 of 600) | 4 |" in text and "(0 finished)" in text
    two_phase_sweep(tmp_path / "paired")
    set_config(tmp_path / "paired" / "pr_lr0.008_s1", train={"steps": 1200})  # its summary says 600
    text = paired_report.build(str(tmp_path / "paired"), None)
    assert "| periodic_rowwise K=3 (spectral) | val loss @600 | 2 | " in text.split("## Including")[0]


# 9: paired differences compare runs of one length
def test_paired_runs_of_different_lengths_are_refused(tmp_path, capsys):
    sweep = tmp_path / "sweep"
    two_phase_sweep(sweep)
    for name in os.listdir(sweep):
        if os.path.isdir(sweep / name):
            set_config(sweep / name, train={"steps": 600})
    set_config(sweep / "muon_lr0.016_s2", train={"steps": 400})
    (sweep / "muon_lr0.016_s2" / "summary.json").write_text(json.dumps({"steps": 400, "val_loss": 0.3}))
    assert paired_report.main([str(sweep)]) == 2
    one_line_error(capsys, "muon_lr0.016_s2", "400", "600")


def test_a_metric_no_pair_has_is_no_row_of_nan(tmp_path):
    sweep = tmp_path / "sweep"
    two_phase_sweep(sweep)
    for name in os.listdir(sweep):  # no run measured FD
        if name.startswith("muon"):
            path = sweep / name / "metrics.jsonl"
            path.write_text("".join(l for l in path.read_text().splitlines(True) if '"fd"' not in l))
    text = paired_report.build(str(sweep), None)
    assert "nan" not in text and "| muon | final FD |" not in text.split("## Paired differences against adamw")[1]


# 10: one run copied twice is not two seeds
def test_duplicate_run_folders_are_refused_naming_both(tmp_path, capsys):
    sweep = tmp_path / "sweep"
    finished_run(sweep / "a")
    finished_run(sweep / "b", opt="muon")
    import shutil

    shutil.copytree(sweep / "a", sweep / "a_copy")
    assert report.main([str(sweep)]) == 2
    one_line_error(capsys, "'a'", "'a_copy'")
    assert not (sweep / "report.md").exists()
    assert publish_study.main([str(sweep), str(tmp_path / "dest")]) == 2  # refused before anything is copied
    one_line_error(capsys, "'a'", "'a_copy'")
    assert not (tmp_path / "dest").exists()


# 11: study.json's keys have their types
@pytest.mark.parametrize("key, value", [("selection_seeds", "20"), ("selection_seeds", [0.5]),
                                        ("selection_seeds", [True]), ("lr_selection", {"dit_s adamw": 0.008}),
                                        ("common_lr", {"x": "0.1"}), ("notes", ["x"])])
def test_a_study_record_key_of_the_wrong_type_is_one_line(tmp_path, capsys, key, value):
    sweep = tmp_path / "sweep"
    two_phase_sweep(sweep)
    edit_study(sweep, lambda s: s.update({key: value}))
    assert paired_report.main([str(sweep)]) == 2
    one_line_error(capsys, "study.json", key)
    assert not (sweep / "report.md").exists()


def test_a_study_run_without_an_lr_is_one_line(tmp_path, capsys):
    sweep = tmp_path / "sweep"
    two_phase_sweep(sweep)
    edit_study(sweep, lambda s: s["runs"][1].pop("lr"))
    assert paired_report.main([str(sweep)]) == 2
    one_line_error(capsys, "'lr'", s_name := json.loads((sweep / "study.json").read_text())["runs"][1]["name"])
    assert s_name


# 12: no YAML aliases in a record
def test_a_yaml_alias_in_a_config_is_refused(tmp_path):
    sweep = tmp_path / "sweep"
    finished_run(sweep / "a")
    finished_run(sweep / "b", opt="muon")
    cfg = (sweep / "b" / "config.yaml").read_text()
    (sweep / "b" / "config.yaml").write_text("x: &a [1, 2]\ny: [*a, *a]\n" + cfg)
    text = report.build_report(str(sweep))
    row = next(l for l in text.splitlines() if l.startswith("| b |"))
    assert "damaged" in row and "alias" in row
    from dit_train.runs.json_file import DamagedJSONFile, read_yaml

    with pytest.raises(DamagedJSONFile, match="anchor or alias"):
        read_yaml(str(sweep / "b" / "config.yaml"))


# 14: values that raised tracebacks, text that became HTML or Markdown structure
def test_crafted_values_give_a_report_not_a_traceback(tmp_path, capsys):
    sweep = tmp_path / "sweep"
    finished_run(sweep / "a", model="$\\notacommand{x}$")  # matplotlib's mathtext raised ValueError
    finished_run(sweep / "b", opt="muon")
    (sweep / "b" / "summary.json").write_text('{"steps": 4, "val_loss": 1' + "0" * 400 + "}")  # OverflowError
    # (the metrics' last validation value stands)
    with open(sweep / "a" / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 5, "train/loss": "x"}) + "\n")  # TypeError
    assert report.main([str(sweep)]) == 0, capsys.readouterr().err
    text = (sweep / "report.md").read_text()
    assert "| b | finished | 4 | 0.5 |" in text and os.path.exists(sweep / "val_loss_vs_step.png")


def test_an_output_that_cannot_be_written_is_one_line_in_every_command(tmp_path, capsys):
    sweep = tmp_path / "sweep"
    two_phase_sweep(sweep)
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    assert paired_report.main([str(sweep), "--out", str(blocker / "out")]) == 2
    one_line_error(capsys, "a_file")
    finished_run(tmp_path / "one" / "a")
    assert report.main([str(tmp_path / "one"), "--out", str(blocker / "out")]) == 2
    one_line_error(capsys, "a_file")
    assert publish_study.main([str(tmp_path / "one"), str(blocker / "dest")]) == 2
    one_line_error(capsys, "a_file")


def test_record_text_goes_into_report_md_as_text(tmp_path):
    sweep = tmp_path / "sweep"
    finished_run(sweep / "x<iframe src=e>|y", model="<script>s</script>\n# Forged model")
    finished_run(sweep / "b", opt="muon")
    (sweep / "study.json").write_text(json.dumps({
        "experiment": "e<b>", "banner": "ok\n# Forged banner", "notes": "n\n\n| forged | row |\n<iframe>",
        "invocations": [{"command": "dit-study e`\n# Forged command", "git_commit": "c"}], "runs": []}))
    text = report.build_report(str(sweep))
    assert "<script>" not in text and "<iframe" not in text and "<b>" not in text
    assert not any(l.startswith(("# Forged", "| forged")) for l in text.splitlines())
    runs = text.split("## Runs")[1].strip().splitlines()
    assert len(runs) == 4 and runs[3].startswith("| x&lt;iframe src=e&gt;\\|y | finished |")


def test_a_dead_writers_temp_report_is_removed_on_the_next_write(tmp_path):
    sweep = tmp_path / "sweep"
    finished_run(sweep / "a")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    (sweep / f"report.md.tmp-{dead}").write_text("torn")
    (sweep / "report.md.tmp-1").write_text("a live writer's (pid 1 runs)")
    report.build_report(str(sweep))
    assert not (sweep / f"report.md.tmp-{dead}").exists() and (sweep / "report.md.tmp-1").exists()


def test_a_run_folder_study_json_does_not_list_is_shown_and_counted_nowhere(tmp_path):
    """A folder that strayed into a study's sweep (a trial run, another sweep's) went into every table's means."""
    sweep = tmp_path / "sweep"
    two_phase_sweep(sweep)
    before = report.build_report(str(sweep), str(tmp_path / "before"))
    finished_run(sweep / "stray", opt="muon", seed=9, val=9.0)
    after = report.build_report(str(sweep), str(tmp_path / "after"))
    rows = [line for line in after.splitlines() if line.startswith("| stray |")]
    assert rows == [f"| stray | {report.NOT_LISTED} | 4 | 9 | — | — | — |"], rows
    assert "1 run folder(s) that study.json does not list" in after
    assert [line for line in after.splitlines() if "stray" not in line and not line.startswith("Built by")] == \
        [line for line in before.splitlines() if not line.startswith("Built by")]


def test_table_1_means_finished_runs_only_and_counts_diverged_seeds_and_skipped_updates(tmp_path):
    """A diverged seed (NaN final val loss and FD) vanished from the mean, leaving the other seed's value with no ±
    and no note; a run that skipped most of its updates read `finished`; a crashed seed's step-2 values were averaged
    with the finished seeds' step-4 ones."""
    sweep = tmp_path / "sweep"
    fd_row = {"fd_encoder": "inception", "fd_num_gen": 8, "fd_num_ref": 16}
    for seed, fd, val in ((0, 100.0, 1.0), (1, math.nan, math.nan)):  # seed 1 diverged: it finished with NaN
        rows = train_rows(0.01, 0.1, 0) + [{"step": 4, "fd": fd, **fd_row}, {"step": 4, "val/loss": val}]
        write_run(sweep / f"adamw-{seed}", "dit_xs", "adamw", seed, rows, summary=False)
        set_config(sweep / f"adamw-{seed}", train={"steps": 4})
        # the trainer's summary.json: skipped_steps counts the steps whose update it skipped (loop.skip_update)
        (sweep / f"adamw-{seed}" / "summary.json").write_text(json.dumps(
            {"steps": 4, "val_loss": val, "skipped_steps": 3 * seed}))
    crashed = train_rows(0.01, 0.1, 0)[:2] + [{"step": 2, "fd": 140.0, **fd_row}, {"step": 2, "val/loss": 1.5}]
    crashed[1]["skipped_steps"] = 1  # the last train row's count: a run without summary.json
    write_run(sweep / "adamw-2", "dit_xs", "adamw", 2, crashed, summary=False)
    set_config(sweep / "adamw-2", train={"steps": 4})
    finished_run(sweep / "muon-0", opt="muon", val=0.8)
    with open(sweep / "muon-0" / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 4, "fd": 80.0, **fd_row}) + "\n")
    text = report.build_report(str(sweep))
    t1 = text.split("## Table 1")[1].split("## Table 2")[0]
    # FD and val loss: seed 0's alone, the diverged seed 1 counted beside it, the crashed seed 2 in no mean; the gain
    # over AdamW is against finished AdamW's 100, not (100 + 140) / 2
    assert ("| dit_xs | adamw | 3 (2 finished) | finished, incomplete (step 2); non-finite updates skipped (seed 1: "
            "3 of 4 updates skipped, seed 2: 1 of 2 updates skipped) | 100 (1 of 2 non-finite) (inception) | — | 4 | "
            "1 (1 of 2 non-finite) |") in t1, t1
    assert "| dit_xs | muon | 1 | finished | 80 (inception) | +20.0% | 4 | 0.8 |" in t1, t1
    assert "The means are over finished runs only" in t1 and "left out of the mean and counted beside it" in t1
    runs = text.split("## Runs")[1]
    assert ("| adamw-1 | finished; 3 of 4 updates skipped (non-finite loss or gradient) | 4 | non-finite | "
            "non-finite | — | — |") in runs, runs
    assert "| adamw-2 | incomplete (step 2); 1 of 2 updates skipped (non-finite loss or gradient) | 2 | 1.5 |" in runs
    assert "| adamw-0 | finished | 4 | 1 | 100 (4) |" in runs
    assert "nan" not in text.lower().replace("nan-finite", "")


def test_a_plain_multirun_folder_and_a_study_are_never_published_into_one_destination(tmp_path, capsys):
    """A sweep without study.json published into a study's destination was merged into it ("copied 1 run records"):
    the experiment check needs a study.json on both sides. Refused either way round, before anything is copied."""
    study, plain, dest = tmp_path / "study", tmp_path / "plain", tmp_path / "dest"
    finished_run(study / "a")
    (study / "study.json").write_text(json.dumps({"experiment": "fab", "command": "dit-study fab", "runs": []}))
    finished_run(plain / "b", opt="muon")
    assert publish_study.main([str(study), str(dest)]) == 0
    before = {p: p.read_bytes() for p in dest.rglob("*") if p.is_file()}
    assert publish_study.main([str(plain), str(dest)]) == 2
    one_line_error(capsys, "'fab'", f"{plain} has no study.json")
    assert {p: p.read_bytes() for p in dest.rglob("*") if p.is_file()} == before
    other = tmp_path / "other"  # the other way round: plain runs published first, then a study into them
    assert publish_study.main([str(plain), str(other)]) == 0
    capsys.readouterr()
    before = {p: p.read_bytes() for p in other.rglob("*") if p.is_file()}
    assert publish_study.main([str(study), str(other)]) == 2
    one_line_error(capsys, "without a study.json", str(study / "study.json"))
    assert {p: p.read_bytes() for p in other.rglob("*") if p.is_file()} == before
