"""benchmarks/code_shape.py (docs/layout.md): lines of functions, classes and files at a git revision, read with
git show, against a two-commit repository whose sizes are known by construction."""

import subprocess

from benchmarks import code_shape


def git(repo, *args):
    subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True)


def test_sizes_at_each_revision_without_a_checkout(tmp_path, monkeypatch):
    git(tmp_path, "init", "-q")
    long_body = "\n".join(f"    x{i} = {i}" for i in range(70))
    (tmp_path / "a.py").write_text(f"class C:\n    def m(self):\n        return 1\n\n\ndef long():\n{long_body}\n")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_x.py").write_text("def test():\n    pass\n")  # tests/ is not counted
    git(tmp_path, "add", ".")
    git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    (tmp_path / "a.py").write_text("def short():\n    return 0\n")  # the work tree no longer matches HEAD~0
    monkeypatch.chdir(tmp_path)
    s = code_shape.shape("HEAD")
    assert s["files"] == [(5 + 1 + 70, "a.py")]  # class (3 lines), 2 blank, def + 70 body lines
    assert s["functions"] == [(71, "a.py:long"), (2, "a.py:m")]
    assert s["classes"] == [(3, "a.py:C")]
    assert "2 functions (1 over 60 lines)" in code_shape.report("HEAD")
