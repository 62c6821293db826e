"""A user's own config folder (Hydra's --config-dir): its groups join ours, so `--config-dir DIR experiment=mine`
composes DIR/experiment/mine.yaml and the command-line check validates it like one of ours. Before, the check knew
only the shipped presets and refused experiment=mine as unknown."""

import pytest

from dit_train.config import check_command_line
from dit_train.config.command_line import split_config_dir

MINE = """# @package _global_
defaults:
  - override /model: dit_xs
train:
  steps: {steps}
"""


@pytest.fixture
def config_dir(tmp_path):
    (tmp_path / "experiment").mkdir()
    (tmp_path / "experiment" / "mine.yaml").write_text(MINE.format(steps=7))
    (tmp_path / "experiment" / "broken.yaml").write_text(MINE.format(steps=0))
    return tmp_path


@pytest.mark.parametrize("form", [["--config-dir", "D"], ["-cd", "D"], ["--config-dir=D"], ["-cd=D"]])
def test_every_spelling_of_the_flag_is_taken_out_of_the_overrides(form):
    assert split_config_dir(["a=1", *form, "b=2"]) == ("D", ["a=1", "b=2"])
    assert split_config_dir(["a=1"]) == (None, ["a=1"])


@pytest.mark.parametrize("flag", [["--config-dir", "{d}"], ["-cd", "{d}"], ["--config-dir={d}"]])
def test_an_experiment_of_the_users_folder_passes_the_check(config_dir, capsys, flag):
    argv = [f.format(d=config_dir) for f in flag] + ["experiment=mine", "run_dir=/tmp/unused", "train.dry_run=true"]
    check_command_line(argv)  # no SystemExit
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("name", ["conf a=1,b it's ü", "back\\slash", "trailing\\"])
def test_a_config_folder_of_any_name_composes_from_that_folder(tmp_path, capsys, name):
    """The check (and dit-study's compose) reach the folder through one hydra.searchpath override: its items were
    json.dumps'ed, which Hydra reads back with every backslash doubled, a folder that does not exist (experiment=mine
    refused, its value unchecked); now written by override_text.override_list."""
    folder = tmp_path / name
    (folder / "experiment").mkdir(parents=True)
    (folder / "experiment" / "broken.yaml").write_text(MINE.format(steps=0))
    with pytest.raises(SystemExit):
        check_command_line(["--config-dir", str(folder), "experiment=broken", "run_dir=/tmp/unused"])
    err = capsys.readouterr().err
    assert err.startswith("error: train.steps=0 is not valid") and err.count("\n") == 1, err


def test_the_users_experiment_is_validated_like_ours(config_dir, capsys):
    """Composed and checked, not waved through: its bad value is the usual one line."""
    with pytest.raises(SystemExit) as stop:
        check_command_line(["--config-dir", str(config_dir), "experiment=broken", "run_dir=/tmp/unused"])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.startswith("error: train.steps=0 is not valid") and err.count("\n") == 1, err


def test_an_unknown_experiment_is_one_line_naming_ours_and_the_users(config_dir, capsys):
    with pytest.raises(SystemExit) as stop:
        check_command_line(["--config-dir", str(config_dir), "experiment=mien"])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.count("\n") == 1, err
    assert err.startswith("error: experiment='mien' is not a known experiment; valid: ") and ", mine, " in err
    assert "debug" in err and "broken" in err


def test_a_missing_config_folder_is_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        check_command_line(["--config-dir", str(tmp_path / "nope"), "experiment=mine"])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.startswith(f"error: --config-dir {tmp_path / 'nope'}: no such folder"), err


@pytest.mark.parametrize("spelling", ["file://{d}", "{d}"])
def test_an_experiment_of_the_users_searchpath_passes_the_check(config_dir, capsys, spelling):
    """`hydra.searchpath=[file://DIR]` adds DIR's groups in Hydra; the check refused experiment=mine as unknown."""
    searchpath = f"hydra.searchpath=[{spelling.format(d=config_dir)}]"
    check_command_line([searchpath, "experiment=mine", "run_dir=/tmp/unused", "train.dry_run=true"])
    assert capsys.readouterr().err == ""
    with pytest.raises(SystemExit) as stop:  # composed with it and validated, as with --config-dir
        check_command_line([searchpath, "experiment=broken", "run_dir=/tmp/unused"])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.startswith("error: train.steps=0 is not valid") and err.count("\n") == 1, err


def test_the_searchpath_of_the_users_primary_config_counts(config_dir, tmp_path, capsys):
    """`--config-dir D --config-name main` where D/main.yaml sets hydra.searchpath: its folders' groups count too."""
    own = tmp_path / "own"
    (own / "experiment").mkdir(parents=True)
    (own / "experiment" / "theirs.yaml").write_text(MINE.format(steps=5))
    (config_dir / "main.yaml").write_text(f"defaults:\n  - config\n  - _self_\nhydra:\n  searchpath:\n    - file://{own}\n")
    check_command_line(["--config-dir", str(config_dir), "--config-name", "main", "experiment=theirs"])
    assert capsys.readouterr().err == ""
    with pytest.raises(SystemExit):
        check_command_line(["--config-dir", str(config_dir), "--config-name", "main", "experiment=nope"])
    err = capsys.readouterr().err
    assert "experiment='nope' is not a known experiment" in err and ", theirs" in err and ", mine," in err, err


def test_searchpath_and_config_dir_together(config_dir, tmp_path, capsys):
    """Hydra searches --config-dir and every hydra.searchpath entry: both folders' options pass, one override."""
    other = tmp_path / "other"
    (other / "experiment").mkdir(parents=True)
    (other / "experiment" / "theirs.yaml").write_text(MINE.format(steps=5))
    for option in ("mine", "theirs"):
        check_command_line(["--config-dir", str(config_dir), f"hydra.searchpath=[file://{other}]",
                            f"experiment={option}", "run_dir=/tmp/unused", "train.dry_run=true"])
    assert capsys.readouterr().err == ""


def test_a_searchpath_that_is_not_a_list_is_one_line(capsys):
    with pytest.raises(SystemExit) as stop:
        check_command_line(["hydra.searchpath=/some/folder", "experiment=mine"])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.startswith("error: hydra.searchpath='/some/folder' is not valid: a list"), err


def train_command(*argv, cwd=None):
    import os
    import subprocess
    import sys

    from conftest import ROOT

    return subprocess.run([sys.executable, "-m", "dit_train", *map(str, argv)], capture_output=True, text=True,
                          timeout=300, cwd=cwd, env={**os.environ, "PYTHONPATH": ROOT})


def test_a_group_option_of_the_users_config_path_passes_the_check(tmp_path):
    """`--config-path DIR --config-name mine optimizer=mine` (Hydra's flags: DIR holds the primary config, in place
    of ours): the check looked for options in our folder and --config-dir only and refused optimizer=mine before
    Hydra, which composes it, saw the command."""
    (tmp_path / "optimizer").mkdir()
    (tmp_path / "optimizer" / "mine.yaml").write_text("defaults:\n  - muon\n  - _self_\nlr: 0.0123\n")
    (tmp_path / "mine.yaml").write_text("defaults:\n  - config\n  - _self_\nhydra:\n  searchpath:\n"
                                        "    - pkg://dit_train.conf\n")
    r = train_command("--config-path", tmp_path, "--config-name", "mine", "optimizer=mine", "--cfg", "job")
    assert r.returncode == 0, r.stderr
    assert "  name: muon\n" in r.stdout and "  lr: 0.0123\n" in r.stdout, r.stdout
    r = train_command("--config-path", tmp_path, "--config-name", "mine", "optimizer=mien", "--cfg", "job")
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr  # a typo is still found, naming DIR's option
    assert r.stderr.startswith("error: optimizer='mien' is not a known optimizer; valid: ") and "mine" in r.stderr


def test_a_relative_config_path_is_one_line_saying_where_hydra_looks(tmp_path):
    """Hydra reads a relative --config-path from dit_train's package folder, not the working directory: its own
    error named neither; the check says so and gives the absolute path to type."""
    (tmp_path / "my_conf").mkdir()
    (tmp_path / "my_conf" / "mine.yaml").write_text("defaults:\n  - config\n")
    r = train_command("--config-path", "my_conf", "--config-name", "mine", cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith("error: --config-path my_conf: no such folder (") and \
        f"give an absolute path (--config-path {tmp_path / 'my_conf'})" in r.stderr, r.stderr


def test_a_users_yaml_named_like_one_of_our_presets_is_refused_where_it_is_chosen(config_dir, capsys):
    """Hydra searches our conf/ first: the user's experiment/debug.yaml was never read, and experiment=debug ran the
    shipped debug run silently (a trial's own smoke.yaml ran as the shipped smoke study). A user's yaml of a schema
    option (optimizer/adamw.yaml) is read (it is merged onto the schema), so that one still passes."""
    (config_dir / "experiment" / "debug.yaml").write_text(MINE.format(steps=7))
    (config_dir / "optimizer").mkdir()
    (config_dir / "optimizer" / "adamw.yaml").write_text("name: adamw\nlr: 0.123\n")
    with pytest.raises(SystemExit) as stop:
        check_command_line(["--config-dir", str(config_dir), "--multirun", "experiment=mine,debug"])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err == (f"error: experiment=debug: {config_dir}/experiment/debug.yaml is never "
                                            f"read: dit_train's own experiment/debug.yaml is searched first and "
                                            f"wins; give yours another name\n")
    check_command_line(["--config-dir", str(config_dir), "experiment=mine", "optimizer=adamw", "train.dry_run=true",
                        "run_dir=/tmp/unused"])
    assert capsys.readouterr().err == ""
