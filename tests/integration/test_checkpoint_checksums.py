"""Content checksums (runs/checkpoint_checksums.py): a shard whose bytes changed without changing its size (a bit
flipped on disk or in a copy) is refused by every reader in one line naming the file, before a tensor is read; a
record that is not one is one line; a checkpoint written before records loads as before; 2 gloo ranks record and
verify their own shards."""

import json
import logging
import os

import pytest
import torch
import torch.distributed as dist

from conftest import compose, gloo_group, needs_fashion, spawn_ranks
from dit_train.runs import checkpoint as ckpt
from dit_train.runs.checkpoint_checksums import RECORD
from test_checkpoint_safety import main_in_process, saved_run


def flip_byte(path: str, part: str = "ema", shard: str | None = None) -> str:
    """Flip one bit in the middle of the largest stored `part` tensor (in `shard` if given): same size, other
    bytes. Returns the shard's name."""
    meta = ckpt._read_metadata(path)
    name, off, length = max(((info.relative_path, info.offset, info.length) for index, info in meta.storage_data.items()
                             if index.fqn.startswith(part + ".") and shard in (None, info.relative_path)),
                            key=lambda t: t[2])
    file = os.path.join(path, name)
    size = os.path.getsize(file)
    with open(file, "r+b") as f:
        f.seek(off + length // 2)
        byte = f.read(1)[0]
        f.seek(off + length // 2)
        f.write(bytes([byte ^ 0x10]))
    assert os.path.getsize(file) == size
    return name


def one_line(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.strip() and "Warning" not in ln]


def test_a_flipped_byte_in_a_shard_is_refused_by_every_reader_naming_the_file(tmp_path, monkeypatch, capfd):
    run_dir, path = saved_run(tmp_path)
    name = flip_byte(path)
    with pytest.raises(ckpt.CheckpointError, match=rf"is damaged: its {name} does not hold the bytes it was saved "
                                                   rf"with .*crc32") as e:
        ckpt.load_ema_weights(run_dir)
    assert "\n" not in str(e.value) and "use an earlier checkpoint" in str(e.value)
    for module in ("dit_train.sample", "dit_train.export"):
        args = [run_dir] + ([str(tmp_path / "out")] if "export" in module else [])
        code, err = main_in_process(module, args, tmp_path, monkeypatch, capfd)
        lines = one_line(err)
        assert code == 2 and len(lines) == 1 and f"is damaged: its {name} does not hold" in lines[0], err
    assert not (tmp_path / "out").exists()


def test_a_changed_metadata_byte_is_refused_before_it_is_used(tmp_path):
    run_dir, path = saved_run(tmp_path)
    meta = os.path.join(path, ".metadata")
    data = open(meta, "rb").read()
    assert data.count(b"ema.blocks.0.attn.qkv.weight") == 1  # the pickle holds the name once: renamed, same size
    open(meta, "wb").write(data.replace(b"ema.blocks.0.attn.qkv.weight", b"ema.blocks.0.attn.qkv.wEight", 1))
    with pytest.raises(ckpt.CheckpointError, match=r"is damaged: its \.metadata does not hold the bytes") as e:
        ckpt.load_ema_weights(run_dir)
    assert "\n" not in str(e.value)


def test_readers_verify_only_what_they_read(tmp_path):
    """An export reads the EMA weights only: a flipped optimizer byte is not its concern (nor a cost to it), while
    a resume, which reads the optimizer, refuses it."""
    run_dir, path = saved_run(tmp_path)
    name = flip_byte(path, part="optimizer")
    ckpt.load_ema_weights(run_dir)
    with pytest.raises(ckpt.CheckpointError, match=f"its {name} does not hold the bytes"):
        ckpt._dcp_load({"optimizer": {"param_groups": [{"lr": 0.0}]}}, path)  # what a resume reads of it


def test_a_save_that_dies_before_its_record_leaves_no_complete_checkpoint(tmp_path, monkeypatch):
    from dit_train.runs import checkpoint_checksums

    def crash(files):
        raise RuntimeError("simulated crash while the record is written")

    monkeypatch.setattr(checkpoint_checksums, "encode", crash)
    with pytest.raises(BaseException) as e:  # DCP's CheckpointException is a BaseException
        saved_run(tmp_path)
    assert "simulated crash" in str(e.value)
    run_dir = str(tmp_path / "run")
    assert ckpt.list_checkpoints(run_dir) == [] and not any(ckpt.MARKER in files for _, _, files in os.walk(run_dir))


@pytest.mark.parametrize("content, match", [
    (b'{"format": 1, "algor', "is not valid JSON"),
    (b'[1, 2]', "not a dit_train checksum record"),
    (b'{"format": 1, "algorithm": "crc32", "files": {".metadata": [[0, 5, "x"]]}}', r"not \[offset, length, crc32\]"),
    (b'{"format": 1, "algorithm": "crc32", "files": {".metadata": [], "../etc/passwd": []}}',
     "not a file of a checkpoint"),
    (b'{"format": 1, "algorithm": "sha1", "files": {}}', "algorithm 'crc32' expected"),
    (b'{"format": true, "algorithm": "crc32", "files": {".metadata": []}}', "format 1 .* expected"),  # True == 1
    (b'{"format": 1, "algorithm": "crc32", "files": {".metadata": [], "__0_0.distcp\\n": []}}',
     "not a file of a checkpoint"),
])
def test_a_record_that_is_not_one_is_one_line_naming_it(tmp_path, content, match):
    run_dir, path = saved_run(tmp_path)
    with open(os.path.join(path, RECORD), "wb") as f:
        f.write(content)
    with pytest.raises(ckpt.CheckpointError, match=match) as e:
        ckpt.load_ema_weights(run_dir)
    assert RECORD in str(e.value) and "is damaged" in str(e.value) and "\n" not in str(e.value)


def test_a_record_missing_a_shards_ranges_is_damage(tmp_path):
    run_dir, path = saved_run(tmp_path)
    file = os.path.join(path, RECORD)
    record = json.load(open(file))
    record["files"] = {".metadata": record["files"][".metadata"]}
    open(file, "w").write(json.dumps(record))
    with pytest.raises(ckpt.CheckpointError, match=r"holds no checksum of bytes \d+-\d+ of __0_0\.distcp"):
        ckpt.load_ema_weights(run_dir)


def test_a_checkpoint_written_before_records_loads_as_before_with_one_info_line(tmp_path, caplog):
    run_dir, path = saved_run(tmp_path)
    os.remove(os.path.join(path, RECORD))  # what every save writes now
    with caplog.at_level(logging.INFO, logger="dit_train"):
        for _ in range(2):
            weights, _, _ = ckpt.load_ema_weights(run_dir)
    torch.manual_seed(0)
    from test_checkpoint_safety import TINY
    from dit_train.model.dit import DiT, DiTConfig

    ema = DiT(DiTConfig(**TINY)).state_dict()
    assert all(torch.equal(weights[k], ema[k]) for k in ema)
    said = [r for r in caplog.records if RECORD in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.INFO and not [r for r in caplog.records
                                                                       if r.levelno >= logging.WARNING]


# ---- resume ----------------------------------------------------------------------------------------------------
@needs_fashion
def test_resume_and_fork_refuse_a_flipped_shard_in_one_line_and_auto_falls_back_past_it(tiny_cfg, tmp_path,
                                                                                         caplog):
    from dit_train.trainer.loop import run

    tiny_cfg.train.keep_last = 0
    run(tiny_cfg)
    first, last = ckpt.list_checkpoints(tiny_cfg.run_dir)
    name = flip_byte(last, part="model")
    tiny_cfg.train.steps = 9
    tiny_cfg.train.resume = last
    with pytest.raises(ckpt.CheckpointError, match=rf"is damaged: its {name} does not hold the bytes") as e:
        run(tiny_cfg)
    assert "\n" not in str(e.value) and f"{first} is the run's previous one" in str(e.value)
    fork = tiny_cfg.copy()
    fork.run_dir, fork.train.resume, fork.train.init_from = str(tmp_path / "fork"), None, last
    with pytest.raises(ckpt.CheckpointError, match=rf"is damaged: its {name} does not hold the bytes") as e:
        run(fork)  # a fork reads the model and EMA weights: the same refusal
    assert "\n" not in str(e.value)
    tiny_cfg.train.resume = "auto"
    with caplog.at_level(logging.INFO, logger="dit_train"):
        run(tiny_cfg)
    assert f"{name} does not hold the bytes" in caplog.text and "trying the previous one" in caplog.text
    assert f"resumed from {first} at step 3" in caplog.text


@needs_fashion
def test_resume_of_a_checkpoint_without_a_record_works(tiny_cfg, caplog):
    from dit_train.trainer.loop import run

    run(tiny_cfg)
    last = ckpt.list_checkpoints(tiny_cfg.run_dir)[-1]
    os.remove(os.path.join(last, RECORD))
    tiny_cfg.train.steps, tiny_cfg.train.resume = 9, "auto"
    with caplog.at_level(logging.INFO, logger="dit_train"):
        run(tiny_cfg)
    assert f"resumed from {last} at step 6" in caplog.text
    assert os.path.isfile(os.path.join(ckpt.list_checkpoints(tiny_cfg.run_dir)[-1], RECORD))


# ---- 2 gloo ranks ----------------------------------------------------------------------------------------------
TWO_RANKS = ["model.hidden_size=32", "model.depth=2", "model.num_heads=2", "model.patch_size=8", "train.steps=2",
             "train.batch_size=12", "train.warmup_steps=1", "train.log_every=1", "train.val_every=0",
             "train.val_samples=4", "train.val_batch_size=4", "train.val_t_points=1", "train.sample_every=0",
             "train.ckpt_every=2", "train.keep_last=0", "train.progress=false", "train.samples_per_class=1",
             "train.sample_steps=1", "optimizer=adamw"]


def _two_ranks(rank, world, port, root):
    """Save (asynchronously: the hashing runs in DCP's writer thread, its results on the save's gloo group), resume
    from the recorded checkpoint, then refuse one whose rank-1 shard has a flipped byte, on both ranks."""
    with gloo_group(rank, world, port):
        from dit_train.trainer.loop import run

        base = TWO_RANKS + [f"run_dir={root}/run", "train.async_checkpoint=true"]
        run(compose(base))
        run(compose(base + ["train.steps=4", "train.resume=auto"]))
        last = ckpt.checkpoint_path(f"{root}/run", 4)
        if rank == 0:
            flip_byte(last, part="model", shard="__1_0.distcp")
        dist.barrier()
        with pytest.raises(ckpt.CheckpointError, match=r"is damaged: its __1_0\.distcp does not hold the bytes") as e:
            run(compose(base + ["train.steps=6", f"train.resume={last}"]))
        assert "\n" not in str(e.value)


@needs_fashion
def test_two_ranks_record_their_shards_resume_verified_and_refuse_a_flipped_one(tmp_path):
    spawn_ranks(_two_ranks, 2, (str(tmp_path),))
    for step in (2, 4):
        path = ckpt.checkpoint_path(str(tmp_path / "run"), step)
        record = json.load(open(os.path.join(path, RECORD)))
        assert sorted(record["files"]) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
        for name, spans in record["files"].items():  # the ranges cover each file exactly, no gap, no overlap
            ends = sorted((off, off + length) for off, length, _ in spans)
            assert ends[0][0] == 0 and ends[-1][1] == os.path.getsize(os.path.join(path, name))
            assert all(a[1] == b[0] for a, b in zip(ends, ends[1:])), name


# ---- a hostile file system -------------------------------------------------------------------------------------
def _fifo_after_check(path, monkeypatch, name="__0_0.distcp", kind="fifo"):
    """Make the shard `name` a FIFO once every check of the folder passed it as a regular file, just before the
    shards are read (a shared file system changed in between); returns a function that unblocks a reader
    waiting on it."""
    real = ckpt._SafeReader.read_data
    file = os.path.join(path, name)

    def swap_then_read(self, plan, planner):
        if os.path.isfile(file) and not os.path.islink(file):
            if kind == "link":  # the same bytes, elsewhere: a link is never followed
                os.replace(file, file + ".elsewhere")
                os.symlink(file + ".elsewhere", file)
            else:
                os.remove(file)
                os.mkfifo(file)
        return real(self, plan, planner)

    monkeypatch.setattr(ckpt._SafeReader, "read_data", swap_then_read)

    def unblock():
        os.close(os.open(file, os.O_WRONLY | os.O_NONBLOCK))

    return unblock


@pytest.mark.parametrize("kind, said", [("fifo", "is not a regular file"), ("link", "is a symbolic link")])
def test_a_shard_swapped_for_a_fifo_after_the_metadata_check_is_refused_not_waited_on(tmp_path, monkeypatch, kind,
                                                                                       said):
    import threading

    run_dir, path = saved_run(tmp_path)
    unblock = _fifo_after_check(path, monkeypatch, kind=kind)
    out = {}

    def load():
        try:
            ckpt.load_ema_weights(run_dir)
            out["error"] = None
        except BaseException as e:  # noqa: BLE001 - reported below
            out["error"] = e

    reader = threading.Thread(target=load, daemon=True)
    reader.start()
    reader.join(20)
    hung = reader.is_alive()
    if hung and kind == "fifo":
        unblock()
        reader.join(20)
    assert not hung, "the checksum verification opened the FIFO and waited for a writer"
    e = out["error"]
    assert isinstance(e, ckpt.CheckpointError), repr(e)
    assert f"its __0_0.distcp {said}" in str(e) and "refusing to load it" in str(e)
    assert "\n" not in str(e)


def _save_on_two_ranks(rank, world, port, root, asynchronous, failing):
    """Each rank saves a tensor of its own; `failing`: rank 1's hashing of its shard hits a read error (EIO), or
    rank 0's write of the record finds the disk full (ENOSPC). The save must fail on both ranks, never hang."""
    import errno

    from dit_train.runs import checkpoint_checksums

    with gloo_group(rank, world, port):
        if failing == "hashing" and rank == 1:
            def broken(folder, ranges):
                raise OSError(errno.EIO, "Input/output error", os.path.join(folder, "__1_0.distcp"))

            checkpoint_checksums.hash_ranges = broken
        if failing == "record" and rank == 0:
            def full(files):
                raise OSError(errno.ENOSPC, "No space left on device", RECORD)

            checkpoint_checksums.encode = full
        run_dir = f"{root}/run"
        tensors = {"x": {str(rank): torch.full((64,), float(rank + 1))}}  # a tensor of its own per rank: x.0, x.1
        group = dist.new_group(backend="gloo") if asynchronous else None
        try:
            pending = ckpt.start_save(run_dir, 1, tensors, {"step": 1}, asynchronous=asynchronous, group=group)
            pending.finish(keep_last=0)
            dist.barrier()
            outcome = "saved"
        except BaseException as e:  # noqa: BLE001 - written for the test to read
            outcome = f"{type(e).__name__}: {e}".splitlines()[0]
        open(f"{root}/rank{rank}.txt", "w").write(outcome)


@pytest.mark.parametrize("asynchronous", [False, True])
@pytest.mark.parametrize("failing, error", [(None, None), ("hashing", "[Errno 5]"), ("record", "[Errno 28]")])
def test_two_ranks_fail_a_save_together_when_one_cannot_hash_or_record_and_a_saved_one_loads_elsewhere(
        tmp_path, asynchronous, failing, error):
    """A failed hash or record write fails the save on both ranks (no hang, no COMPLETE); a save that succeeded
    is verified by a process of another world size (one, reading rank 1's file too), and refused there after
    a byte of rank 1's file flipped."""
    spawn_ranks(_save_on_two_ranks, 2, (str(tmp_path), asynchronous, failing), timeout=120)
    outcomes = [open(tmp_path / f"rank{r}.txt").read() for r in (0, 1)]
    run_dir = str(tmp_path / "run")
    if failing:
        assert all(o.startswith(f"OSError: {error}") for o in outcomes), outcomes
        assert ckpt.list_checkpoints(run_dir) == []
        assert not any(ckpt.MARKER in files for _, _, files in os.walk(run_dir))
        return
    assert outcomes == ["saved", "saved"]
    path = ckpt.checkpoint_path(run_dir, 1)
    state = {"x": {"0": torch.zeros(64), "1": torch.zeros(64)}}
    ckpt._dcp_load(state, path)
    assert torch.equal(state["x"]["0"], torch.full((64,), 1.0)) and torch.equal(state["x"]["1"], torch.full((64,), 2.0))
    name = flip_byte(path, part="x", shard="__1_0.distcp")
    with pytest.raises(ckpt.CheckpointError, match=rf"its {name} does not hold the bytes"):
        ckpt._dcp_load({"x": {"0": torch.zeros(64), "1": torch.zeros(64)}}, path)


def test_a_metadata_past_the_size_cap_is_refused_before_it_is_hashed(tmp_path, monkeypatch):
    """A `.metadata` grown sparse to 8 GB, with a record whose range for it has that length (the crc need not
    match: it is compared after the hashing), was hashed whole (seconds per GB) before the size cap refused it."""
    from dit_train.runs import checkpoint_checksums, checkpoint_metadata

    run_dir, path = saved_run(tmp_path)
    size = 8 << 30
    os.truncate(os.path.join(path, ".metadata"), size)
    file = os.path.join(path, RECORD)
    record = json.load(open(file))
    record["files"][".metadata"] = [[0, size, 0]]
    open(file, "w").write(json.dumps(record))
    hashed = []
    real = checkpoint_checksums.crc32_range
    monkeypatch.setattr(checkpoint_checksums, "crc32_range", lambda f, off, length: hashed.append(length) or
                        real(f, off, min(length, 1 << 20)))  # the test itself never hashes 8 GB
    with pytest.raises(ckpt.CheckpointError, match=rf"is damaged: its \.metadata is {size:,} bytes, more than") as e:
        ckpt.load_ema_weights(run_dir)
    assert "\n" not in str(e.value)
    assert all(length <= checkpoint_metadata.MAX_METADATA_BYTES for length in hashed), hashed


def test_a_record_larger_than_its_metadata_allows_is_refused_before_it_is_parsed(tmp_path, monkeypatch):
    """A record of 5 million extra ranges (81 MiB, ~10x that once parsed, in every rank) beside a 6 KB .metadata
    was parsed and the checkpoint loaded; a record holds ~30 bytes per storage entry, the .metadata 178+."""
    run_dir, path = saved_run(tmp_path)
    file = os.path.join(path, RECORD)
    record = json.load(open(file))
    assert os.path.getsize(file) < os.path.getsize(os.path.join(path, ".metadata"))  # what a save writes
    record["files"]["__0_0.distcp"] += [[off, 1, 0] for off in range(10**9, 10**9 + 200_000)]
    open(file, "w").write(json.dumps(record))
    parsed = []
    monkeypatch.setattr(json, "loads", lambda data, **kw: parsed.append(len(data)) or json.JSONDecoder().decode(
        data.decode() if isinstance(data, bytes) else data))
    with pytest.raises(ckpt.CheckpointError, match=rf"is damaged: .*{RECORD} is [\d,]+ bytes, larger than the record "
                                                   rf"of its \.metadata can be") as e:
        ckpt.load_ema_weights(run_dir)
    assert "\n" not in str(e.value) and not [n for n in parsed if n > 1 << 20]  # the record was never parsed
