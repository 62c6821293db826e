"""What a run folder says about the code that made it: the commit, and '-dirty' only for uncommitted code."""

import subprocess

from dit_train.runs.provenance import git_commit, modified_files


def git(repo, *args):
    subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True)


def test_dirty_means_uncommitted_code_and_modified_files_are_listed(tmp_path):
    (tmp_path / "dit_train").mkdir()
    (tmp_path / "docs").mkdir()
    (tmp_path / "dit_train" / "train.py").write_text("a = 1\n")
    (tmp_path / "docs" / "report.md").write_text("old\n")
    git(tmp_path, "init", "-q")
    git(tmp_path, "add", ".")
    git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "init")
    head = git_commit(str(tmp_path))
    assert len(head) == 40 and modified_files(str(tmp_path)) == []

    (tmp_path / "docs" / "report.md").write_text("published results\n")  # a study publishing as it goes
    (tmp_path / "notes.txt").write_text("untracked\n")
    assert git_commit(str(tmp_path)) == head
    assert modified_files(str(tmp_path)) == ["docs/report.md"]

    (tmp_path / "dit_train" / "train.py").write_text("a = 2\n")
    assert git_commit(str(tmp_path)) == head + "-dirty"
    assert modified_files(str(tmp_path)) == ["dit_train/train.py", "docs/report.md"]


def test_outside_a_repository_there_is_no_commit(tmp_path):
    assert git_commit(str(tmp_path)) is None and modified_files(str(tmp_path)) == []
