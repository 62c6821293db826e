"""The cache of the RowNorm C kernels (optim/native_rownorm.py): a damaged cached library is rebuilt, not loaded
(a truncated .so kills the process that loads it with SIGBUS), and processes starting at once build it once."""

import os
import re
import shutil
import subprocess
import sys
import textwrap

import pytest

from conftest import ROOT
from dit_train.optim import native_rownorm

REBUILT = "do not match their recorded checksum (truncated or altered); rebuilding them"
# a fresh process that loads the kernels from the cache under $XDG_CACHE_HOME and checks a product against torch
USE_KERNELS = textwrap.dedent("""
    import torch
    from dit_train.optim import native_rownorm as n
    assert n.load() is not None
    U, s, x = torch.randn(2, 8, 5), torch.rand(2, 5), torch.randn(2, 5)
    torch.testing.assert_close(n.power_iteration_round(n.TALL_LAST, U, s, x)[1], (U @ (s * x)[..., None])[..., 0])
    print("ok")
""")


def use_kernels(cache: str, **env) -> subprocess.Popen:
    env = {**os.environ, "XDG_CACHE_HOME": cache, "PYTHONPATH": ROOT, **env}
    return subprocess.Popen([sys.executable, "-c", USE_KERNELS], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


@pytest.fixture
def cached(tmp_path):
    """A cache folder holding this session's build (library + recorded checksum): (cache root, library path)."""
    built = native_rownorm.load()
    assert built is not None, "the C kernels did not build (is there a C compiler?)"
    folder = tmp_path / "cache" / "dit_train"
    folder.mkdir(parents=True)
    lib = str(folder / os.path.basename(built._name))
    shutil.copy(built._name, lib)
    shutil.copy(built._name + ".sha256", lib + ".sha256")
    return str(tmp_path / "cache"), lib


def read(path):
    with open(path, "rb") as f:
        return f.read()


@pytest.mark.parametrize("damage", ["flip a byte", "no checksum"])
def test_an_altered_or_unrecorded_cached_library_is_rebuilt(cached, monkeypatch, damage):
    """A flipped byte in the code (silently wrong results or a crash) and a library without its record (a build
    killed between the rename and the record, or a cache from before the records) are both rebuilt."""
    cache, lib = cached
    whole = bytearray(read(lib))
    if damage == "flip a byte":
        whole[len(whole) // 2] ^= 0xFF
        with open(lib, "wb") as f:
            f.write(whole)
        whole[len(whole) // 2] ^= 0xFF
    else:
        os.remove(lib + ".sha256")
    monkeypatch.setenv("XDG_CACHE_HOME", cache)
    monkeypatch.setattr(native_rownorm, "_lib", [])
    if damage == "flip a byte":
        with pytest.warns(UserWarning, match=re.escape(REBUILT)):
            assert native_rownorm.load() is not None
    else:  # nothing to warn about: a build that never finished
        assert native_rownorm.load() is not None
    assert read(lib) == whole and native_rownorm._intact(lib)


def test_fresh_processes_rebuild_a_truncated_cached_library_once(cached, tmp_path):
    """Before: `Bus error`, rc 135 (-SIGBUS), on every run until the cache was deleted by hand. Two processes
    starting at once find the library truncated: one rebuilds it (under a lock, into a temp file renamed over it),
    the other waits and loads that build; both run, and the cache holds the whole library, its record and the
    lock, no temp file. The compiler is a wrapper that logs each output file, so the builds can be counted."""
    cache, lib = cached
    whole = read(lib)
    os.truncate(lib, len(whole) // 2)
    log, cc = tmp_path / "cc.log", tmp_path / "cc"
    real = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    # logs its output file, and takes 2 s more: the other process arrives while the first one builds
    cc.write_text(f'#!/bin/sh\nfor a; do [ "$prev" = -o ] && echo "$a" >> {log}; prev=$a; done\nsleep 2\n'
                  f'exec {real} "$@"\n')
    cc.chmod(0o755)
    procs = [use_kernels(cache, CC=str(cc)) for _ in range(2)]
    errs = []
    for proc in procs:
        out, err = proc.communicate(timeout=240)
        assert proc.returncode == 0 and out.strip() == "ok", (proc.returncode, err[-2000:])
        errs.append(err)
    assert sum(REBUILT in err for err in errs) == 1, errs
    assert len(set(log.read_text().split())) == 1, log.read_text()  # one temp file: one build
    assert read(lib) == whole and native_rownorm._intact(lib)
    names = sorted(os.listdir(os.path.dirname(lib)))
    assert names == sorted(os.path.basename(lib) + suffix for suffix in ("", ".sha256", ".lock")), names
