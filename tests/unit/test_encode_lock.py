"""out/.encode.lock (data/encode_lock.py) where something other than its own lock file is at that name: the lock is
refused in one line, and nothing outside --out is created, truncated or written."""

import os

import pytest

from dit_train.config.errors import ConfigError
from dit_train.data.encode_lock import LOCK_NAME, acquire


def refusal(out, what):
    return (f"--out {out} holds a {LOCK_NAME} that is {what}, not the lock file dit-encode-latents makes (a regular "
            f"file of its own): remove it, or choose another --out")


def refused(tmp_path, place) -> tuple:
    """(out, the refusal's text) where place(out/LOCK_NAME) put something at the lock's name."""
    out = tmp_path / "lat"
    out.mkdir()
    place(out / LOCK_NAME)
    with pytest.raises(ConfigError) as e:
        acquire(str(out))
    return out, str(e.value)


def test_a_symlink_named_like_the_lock_is_not_followed_and_its_target_is_left_as_it_was(tmp_path):
    victim = tmp_path / "someone_elses.txt"
    victim.write_text("precious\n")
    out, said = refused(tmp_path, lambda lock: lock.symlink_to(victim))
    assert said == refusal(out, f"a symlink (to {victim})")
    assert victim.read_text() == "precious\n"  # was truncated and overwritten with the holder's pid


def test_a_dangling_symlink_named_like_the_lock_creates_nothing_where_it_points(tmp_path):
    target = tmp_path / "elsewhere" / "made.txt"
    target.parent.mkdir()
    out, said = refused(tmp_path, lambda lock: lock.symlink_to(target))
    assert said == refusal(out, f"a symlink (to {target})")
    assert not target.exists()


def test_a_hard_link_named_like_the_lock_is_not_written(tmp_path):
    victim = tmp_path / "someone_elses.txt"
    victim.write_text("precious\n")
    out, said = refused(tmp_path, lambda lock: os.link(victim, lock))
    assert said == refusal(out, "another file's second name (2 links)")
    assert victim.read_text() == "precious\n"


def test_a_folder_or_a_fifo_named_like_the_lock_is_one_line(tmp_path):
    out = tmp_path / "lat"
    (out / LOCK_NAME).mkdir(parents=True)
    with pytest.raises(ConfigError) as e:
        acquire(str(out))
    assert str(e.value) == refusal(out, "a folder")
    out2 = tmp_path / "lat2"
    out2.mkdir()
    os.mkfifo(out2 / LOCK_NAME)
    with pytest.raises(ConfigError) as e:
        acquire(str(out2))
    assert str(e.value) == refusal(out2, "a FIFO, device or socket")


def test_the_lock_file_it_makes_itself_is_taken_and_removed(tmp_path):
    out = tmp_path / "lat"
    lock = acquire(str(out))
    assert (out / LOCK_NAME).is_file() and not (out / LOCK_NAME).is_symlink()
    lock.release()
    assert not out.exists()  # made for it, removed with it
