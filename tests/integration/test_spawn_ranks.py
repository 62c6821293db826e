"""The multi-process test harness: one SIGABRT is retried once with a warning; errors and a second abort are not."""

import os

import pytest
import torch.multiprocessing as mp

from conftest import spawn_ranks


def _abort_first_time(rank, world, port, marker):
    if rank == 1 and not os.path.exists(marker):
        open(marker, "w").close()
        os.abort()


def _always_abort(rank, world, port):
    if rank == 1:
        os.abort()


def _raise(rank, world, port, calls):
    with open(calls, "a") as f:
        f.write(f"{rank}\n")
    raise ValueError("wrong maths")


def test_one_abort_is_rerun_with_a_warning(tmp_path):
    with pytest.warns(UserWarning, match="rank 1 aborted"):
        spawn_ranks(_abort_first_time, 2, (str(tmp_path / "aborted_once"),))


def test_a_second_abort_fails():
    with pytest.raises(mp.ProcessExitedException, match="SIGABRT"), pytest.warns(UserWarning):
        spawn_ranks(_always_abort, 2, ())


def test_an_exception_is_never_rerun(tmp_path):
    calls = tmp_path / "calls"
    with pytest.raises(mp.ProcessRaisedException, match="wrong maths"):
        spawn_ranks(_raise, 1, (str(calls),))
    assert calls.read_text() == "0\n"
