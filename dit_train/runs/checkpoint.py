"""Checkpoints: one format for any number of ranks, written atomically, read as data (never as code).

`<run_dir>/checkpoints/step_00001200.dcp/` is a torch.distributed.checkpoint folder:
- the tensors, each rank writing its own shards: `model` and `optimizer` keyed by parameter name (so a
  checkpoint written by N ranks loads on M ranks, or on one process without FSDP) and `ema` the same way;
- `train_state.json`: the TrainState (train_state.py: step = data position, schedule, training generator, EMA
  count, run time, skipped steps, best FD) and the resolved config, written by rank 0;
- `checksums.json`: a crc32 of every stored item and of `.metadata`, gathered from the ranks by DCP's writer and
  written by rank 0 before the marker; every reader verifies the ranges it reads before reading them
  (checkpoint_checksums.py; a checkpoint without one, written before, loads unverified);
- `COMPLETE`, written last. Everything goes into `step_N.dcp.tmp/`, which is renamed when complete, so only
  complete folders are ever listed; leftovers of an interrupted save are reported and removed (a complete save
  whose rename was cut short is put in place). The tensors may be written in the background (start_save: DCP's
  async_save); the marker and the rename wait for the write (PendingSave.finish; checkpoint_saver.py decides when).

Loading never executes code from the file: DCP's metadata is read by checkpoint_metadata.py (exact names, shard
files inside the folder only), its non-tensor items with `torch.load(weights_only=True)`, and the train state is
JSON.
Single-file `step_N.pt` checkpoints of earlier versions are read-only (EMA weights for export, sampling and FD),
also loaded with `weights_only=True`.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import pickle
import re
import shutil
import time
import warnings
from concurrent.futures import Future

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from dit_train.runs import checkpoint_checksums, checkpoint_metadata
from dit_train.runs.atomic_io import fsync_dir, naming, write_synced
from dit_train.runs.folder_kind import no_checkpoints
from dit_train.runs.json_file import read_json
from dit_train.runs.lock import held_by_a_writer
from dit_train.parallel.fsdp import barrier, rank

log = logging.getLogger("dit_train")
# ASCII digits only: `\d` also matches fullwidth and other scripts' digits, and a lookalike name such as
# step_００００００１０.dcp sorted after every real one, so it was always the newest: resumed instead of the run's
# own newest checkpoint (which moved aside as abandoned) and never pruned while the run's own were
CKPT_RE = re.compile(r"^step_([0-9]{8})\.dcp$")
LEGACY_RE = re.compile(r"^step_([0-9]{8})\.pt$")
MARKER = "COMPLETE"
# a save without a process group says it assumes a single process; it does (an async save says so from its writer
# thread, after a catch_warnings around the call has ended, hence a filter for the process)
SINGLE_PROCESS_WARNING = ".*assuming the intent is to (save|load) in a single process"
warnings.filterwarnings("ignore", message=SINGLE_PROCESS_WARNING)
TRAIN_STATE = "train_state.json"


class CheckpointError(ValueError):
    """A checkpoint that cannot be used here; the message names it and says why."""


def checkpoint_dir(run_dir: str) -> str:
    return os.path.join(run_dir, "checkpoints")


def checkpoint_path(run_dir: str, step: int) -> str:
    return os.path.join(checkpoint_dir(run_dir), f"step_{step:08d}.dcp")


def is_complete(path: str) -> bool:
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, MARKER))


# ---- finding ------------------------------------------------------------------------------------------------
def list_checkpoints(run_dir: str, remove_partial: bool = True, legacy: bool = False) -> list[str]:
    """Complete checkpoints, oldest first (with `legacy`, read-only step_N.pt files too). Leftovers of an
    interrupted save are reported and, with `remove_partial` (rank 0 only), removed, except a complete save that was
    not yet renamed into place, which is put in place; a final-named folder without its marker is reported and
    skipped. A checkpoints folder or checkpoint that is a symbolic link is refused (CheckpointError)."""
    folder = checkpoint_dir(run_dir)
    _refuse_link(folder)
    if remove_partial and os.path.isdir(folder):
        _finish_interrupted_publish(folder)
    partial = glob.glob(os.path.join(folder, "*.tmp-*")) + glob.glob(os.path.join(folder, "*.tmp"))
    if partial and not remove_partial and held_by_a_writer(run_dir):  # a live run (a fork's parent) is saving it
        for tmp in partial:
            _report_once(f"checkpoint {tmp} is being written by the run in {run_dir}; its newest complete "
                         f"checkpoint is used", tmp)
        partial = []
    for tmp in partial:
        _report_once(f"ignoring partial checkpoint {tmp} (a save was interrupted; a run resumed in this folder "
                     f"{'publishes' if _publishable(tmp) else 'removes'} it)", tmp)
        if remove_partial:
            shutil.rmtree(tmp, ignore_errors=True) if os.path.isdir(tmp) else os.remove(tmp)
    if not os.path.isdir(folder):
        return []
    found = []
    for name in os.listdir(folder):
        path = os.path.join(folder, name)
        if CKPT_RE.match(name) or LEGACY_RE.match(name):
            _refuse_link(path)
        if CKPT_RE.match(name):
            if is_complete(path):
                found.append(path)
            else:
                _report_once(f"ignoring incomplete checkpoint {path} (no {MARKER} marker)", path)
        elif legacy and LEGACY_RE.match(name) and os.path.isfile(path):
            found.append(path)
    return sorted(found, key=lambda p: (os.path.basename(p)[5:13], p.endswith(".dcp")))


def _refuse_link(path: str) -> None:
    """A run's checkpoints folder and its checkpoints are read only as its own: a link there (`runA/checkpoints ->
    /elsewhere/run/checkpoints`) had dit-fd score, dit-sample sample and a resume load a model from elsewhere."""
    if os.path.islink(path):
        raise CheckpointError(f"{path} is a symbolic link (to {os.readlink(path)}): checkpoints are read only from "
                              f"the run folder's own checkpoints/ folder, not through a link to elsewhere; replace "
                              f"it by the folder itself, or name the checkpoint it points at")


PUBLISHING = re.compile(r"^(step_[0-9]{8}\.dcp)(\.tmp|\.old\.tmp)$")  # _publish's names for a step being published


def _publishable(tmp: str) -> bool:
    """A complete save (or the one it replaces) whose final name is free: what a crash inside _publish leaves."""
    found = PUBLISHING.match(os.path.basename(tmp))
    return bool(found) and not os.path.islink(tmp) and is_complete(tmp) and \
        not os.path.lexists(os.path.join(os.path.dirname(tmp), found.group(1)))


def _finish_interrupted_publish(folder: str) -> None:
    """A crash between _publish's two renames leaves step_N.dcp.old.tmp (the earlier save of that step) and a
    complete step_N.dcp.tmp, and no step_N.dcp: the newer save is put in place (the earlier one where the newer is
    incomplete); removing both as partial lost the step. Only complete saves whose final name is free are moved."""
    for name in sorted(os.listdir(folder), key=lambda n: n.endswith(".old.tmp")):  # the newer save first
        tmp = os.path.join(folder, name)
        if _publishable(tmp):
            final = os.path.join(folder, PUBLISHING.match(name).group(1))
            os.replace(tmp, final)
            fsync_dir(folder)
            log.warning("checkpoint %s was complete but not yet in place when a save was interrupted: put in place "
                        "from %s", final, name)


_REPORTED: set[str] = set()  # leftovers this process has reported: the run reads its folder several times


def _report_once(message: str, path: str) -> None:
    if path not in _REPORTED and log.isEnabledFor(logging.WARNING):  # not while the command-line check is quiet
        _REPORTED.add(path)
        log.warning(message)


def newest_step(run_dir: str) -> int:
    """The step of the newest complete checkpoint (0 when there is none): how far a run has really got."""
    found = list_checkpoints(run_dir, remove_partial=False)
    return read_train_state(found[-1])["step"] if found else 0


def run_checkpoints(path: str) -> tuple[str, list[str]]:
    """(run folder, its complete checkpoints oldest first, read-only .pt files too) for a run folder or its
    checkpoints/ folder; ([path], []) when neither holds any. dit-sample, dit-export and dit-fd accept the same."""
    for run_dir in (path, os.path.dirname(path.rstrip("/"))):
        found = list_checkpoints(run_dir, remove_partial=False, legacy=True)
        if found:
            return run_dir, found
    return path, []


def resolve_checkpoint(path: str) -> str:
    """A checkpoint folder (or a read-only step_N.pt file), or a run folder / its checkpoints folder (its newest
    complete checkpoint)."""
    path = str(path)
    if is_complete(path) or (os.path.isfile(path) and LEGACY_RE.match(os.path.basename(path))):
        return path
    if os.path.isdir(path):
        if CKPT_RE.match(os.path.basename(path.rstrip("/"))):
            raise FileNotFoundError(f"checkpoint {path!r} is incomplete (no {MARKER} marker): its save was "
                                    f"interrupted; use an earlier checkpoint")
        _, found = run_checkpoints(path)
        if found:
            return found[-1]
        raise no_checkpoints(path)
    if os.path.isfile(path):
        raise FileNotFoundError(f"{path!r} is not a checkpoint (expected a step_N.dcp folder or a run folder)")
    raise FileNotFoundError(f"checkpoint path {path!r} does not exist")


def prune_checkpoints(run_dir: str, keep_last: int) -> None:
    """Keep the newest `keep_last` complete checkpoints; 0 keeps all."""
    for old in list_checkpoints(run_dir, remove_partial=False, legacy=True)[:-keep_last] if keep_last > 0 else []:
        shutil.rmtree(old, ignore_errors=True) if os.path.isdir(old) else os.remove(old)


# ---- writing ------------------------------------------------------------------------------------------------
def tensor_state(model, optimizer, ema_model) -> dict:
    """Parameter-name keyed model/optimizer/EMA tensors (DTensor shards under FSDP2, plain tensors otherwise)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optimizer": optim_sd, "ema": get_model_state_dict(ema_model)}


def save(run_dir: str, step: int, tensors: dict, train_state: dict, keep_last: int) -> str:
    """Collective: every rank passes its own `tensors`; rank 0's `train_state` (JSON values) is written.
    Returns the final folder. On any error the temp folder is removed (a full disk is not filled further)."""
    pending = start_save(run_dir, step, tensors, train_state)
    pending.finish(keep_last)
    barrier()
    return pending.final


def start_save(run_dir: str, step: int, tensors: dict, train_state: dict, asynchronous: bool = False,
               group=None, stager=None) -> "PendingSave":
    """Collective: the first half of a save. Synchronous: the tensors are written when it returns. Asynchronous
    (torch.distributed.checkpoint.async_save): the tensors are copied to host memory before it returns (so the
    next optimizer step cannot change what is saved), by `stager` (a DCP AsyncStager kept across saves, whose
    buffers are reused; None: fresh copies), and written by a background thread whose collectives run on `group`
    (a gloo group of their own, so they never interleave with training's). Either way the checkpoint exists only
    once `finish()` has run: the marker and the rename follow the write. The PendingSave's `stage_s` is the
    copy's time (0 for a synchronous save)."""
    final = checkpoint_path(run_dir, step)
    tmp = final + ".tmp"
    if rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    barrier()
    writer = checkpoint_checksums.checksumming_writer(tmp)  # DCP's, fsynced, recording checksums.json
    no_dist = not dist.is_initialized()
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=SINGLE_PROCESS_WARNING)
            started = time.perf_counter()
            stage_s = 0.0
            if asynchronous:
                future = dcp.async_save(tensors, storage_writer=writer, process_group=group, no_dist=no_dist,
                                        async_stager=stager)
                stage_s = time.perf_counter() - started
                started = time.perf_counter()  # what follows is the background part
            else:
                future = Future()
                future.set_result(dcp.save(tensors, storage_writer=writer, no_dist=no_dist))
    except BaseException as e:
        error = _write_error(e, tmp)  # before the partial save is removed: it is what filled the disk
        if rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise error from None
    # frozen now: the run goes on changing the live train state while the tensors are written
    return PendingSave(run_dir, step, tmp, final, future, json.dumps(train_state).encode(), started, stage_s)


class PendingSave:
    """A save whose tensors are being (or have been) written; `finish()` makes it a checkpoint."""

    def __init__(self, run_dir: str, step: int, tmp: str, final: str, future: Future, train_state: bytes,
                 started: float, stage_s: float = 0.0):
        self.run_dir, self.step, self.tmp, self.final, self.future = run_dir, step, tmp, final, future
        self.train_state, self.started, self.stage_s = train_state, started, stage_s
        self.write_s = 0.0  # this rank's write (for an async save: from the end of staging to the end of its write)
        future.add_done_callback(self._written)  # runs at once for a synchronous save

    def _written(self, _future) -> None:
        self.write_s = time.perf_counter() - self.started

    def done(self) -> bool:
        return self.future.done()

    def finish(self, keep_last: int) -> dict:
        """Waits for this rank's write; on rank 0 (whose write returns only once every rank's shards and the
        metadata are on disk: DCP gathers the ranks' write results there) writes the train state and the
        COMPLETE marker, renames the folder into place and prunes to `keep_last`. Returns rank 0's ckpt/write_s
        and ckpt/bytes ({} elsewhere). A failed write removes the temp folder and raises."""
        try:
            self.future.result()
            if rank() != 0:
                return {}
            world = dist.get_world_size() if dist.is_initialized() else 1
            write_synced(self.train_state, os.path.join(self.tmp, TRAIN_STATE))
            write_synced(json.dumps({"step": self.step, "world_size": world, "format": "dcp-v2"}).encode(),
                         os.path.join(self.tmp, MARKER))
            fsync_dir(self.tmp)
            size = folder_bytes(self.tmp)
            _publish(self.tmp, self.final)
            prune_checkpoints(self.run_dir, keep_last)
        except BaseException as e:
            error = _write_error(e, self.tmp)  # before the partial save is removed
            if rank() == 0:
                shutil.rmtree(self.tmp, ignore_errors=True)
            raise error from None
        return {"ckpt/write_s": self.write_s, "ckpt/bytes": size}


def _write_error(e: BaseException, folder: str) -> BaseException:
    """A failed save as the OSError behind it, naming the folder (ENOSPC on a full disk): DCP wraps a rank's
    OSError into a CheckpointException whose message is a traceback, and a failed write names no file. torch's
    zip writer reports a write that hit a full disk or the file-size limit as a RuntimeError ("unexpected pos"),
    without the OSError: that one is read from the file system (called before the partial save is removed)."""
    failures = [exc for exc, _ in e.failures.values()] if isinstance(e, CheckpointException) else [e]
    for exc in failures:
        if isinstance(exc, OSError):
            return naming(exc, folder)
    if any(isinstance(exc, RuntimeError) for exc in failures):
        found = _out_of_space(folder)
        if found is not None:
            found.__traceback__ = e.__traceback__
            return found
    return e


FULL_BELOW_BYTES = 1 << 20  # free space a write that failed on a full disk leaves (tmpfs: none; ext4: a block)


def _out_of_space(folder: str) -> OSError | None:
    """ENOSPC where the file system holding `folder` has (next to) no space left, EFBIG where a file in it reached
    the process's file-size limit (ulimit -f); else None."""
    import errno
    import resource

    probe = folder
    while not os.path.isdir(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)
    try:
        if shutil.disk_usage(probe).free < FULL_BELOW_BYTES:
            return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), folder)
        limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        if limit != resource.RLIM_INFINITY and os.path.isdir(folder) and \
                max((os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder)), default=0) >= limit:
            return OSError(errno.EFBIG, f"{os.strerror(errno.EFBIG)} (the file-size limit, ulimit -f, is "
                                        f"{limit:,} bytes)", folder)
    except OSError:  # the folder went away: the save's own error stands
        return None
    return None


def folder_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def _publish(tmp: str, final: str) -> None:
    """Rename the complete temp folder into place (an older save of the same step is moved aside first)."""
    old = None
    if os.path.exists(final):
        old = final + ".old.tmp"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(tmp, final)
    fsync_dir(os.path.dirname(final))
    if old:
        shutil.rmtree(old, ignore_errors=True)


# ---- reading, as data ---------------------------------------------------------------------------------------
class _SafeReader(dcp.FileSystemReader):
    def __init__(self, path: str, record: dict | None = None):
        super().__init__(path)
        self.record = record  # checkpoint_checksums.read_record's: the ranges read are verified first

    def read_data(self, plan, planner):
        if self.record is not None:  # before DCP reads a byte: exactly the ranges this rank's plan reads
            ranges: dict[str, set[tuple[int, int]]] = {}
            for item in plan.items:
                info = self.storage_data[item.storage_index]
                ranges.setdefault(info.relative_path, set()).add((info.offset, info.length))
            checkpoint_checksums.verify(str(self.path), self.record, ranges)
        return super().read_data(plan, planner)

    def read_metadata(self, *args, **kwargs):
        from torch.distributed.checkpoint.metadata import StorageMeta

        metadata = checkpoint_metadata.read(str(self.path))
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner unpickles non-tensor items with weights_only=False; these are plain values."""

    def load_bytes(self, read_item, value) -> None:
        from torch.distributed.checkpoint._traverse import set_element  # what DCP's own planner uses

        loaded = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


def _read_metadata(path: str, verified: bool = False):
    """The checkpoint's DCP metadata, checked; first verified against its checksum record unless `verified`."""
    if not verified:
        _read_record(path)  # a changed byte is damage, found before the pickle is parsed
    try:
        return _SafeReader(path).read_metadata()
    except checkpoint_metadata.RefusedMetadata as e:
        raise CheckpointError(f"checkpoint {path!r}: {e}: refusing to load it (it could run code or read files "
                              f"outside it)") from None
    except (checkpoint_metadata.DamagedMetadata, OSError) as e:
        raise CheckpointError(f"checkpoint {path!r} is damaged: {e}; use an earlier checkpoint") from None


def _read_record(path: str) -> dict | None:
    """The checkpoint's checksum record (None for one written before records), its `.metadata` verified."""
    try:
        record = checkpoint_checksums.read_record(path)
        if record is not None:
            checkpoint_metadata.check_plain_file(path, ".metadata")  # never a FIFO opened to be hashed
            checkpoint_metadata.check_size(path)  # nor a sparse 1 TB file hashed whole before the cap refuses it
            checkpoint_checksums.verify_whole(path, record, ".metadata")
        return record
    except checkpoint_metadata.RefusedMetadata as e:
        raise CheckpointError(f"checkpoint {path!r}: {e}: refusing to load it") from None
    except checkpoint_metadata.DamagedMetadata as e:
        raise CheckpointError(f"checkpoint {path!r} is damaged: {e}; {_earlier(path)}") from None
    except checkpoint_checksums.ChecksumMismatch as e:  # a changed .metadata: what it is, where its reader says
        try:
            checkpoint_metadata.read(path)
        except checkpoint_metadata.RefusedMetadata as refused:
            raise CheckpointError(f"checkpoint {path!r}: {refused}: refusing to load it (it could run code or read "
                                  f"files outside it)") from None
        except checkpoint_metadata.DamagedMetadata as damaged:
            raise CheckpointError(f"checkpoint {path!r} is damaged: {damaged}; {_earlier(path)}") from None
        except OSError:
            pass
        raise CheckpointError(f"checkpoint {path!r} is damaged: {e}; {_earlier(path)}") from None
    except (checkpoint_checksums.BadRecord, OSError) as e:
        raise CheckpointError(f"checkpoint {path!r} is damaged: {e}; {_earlier(path)}") from None


def _earlier(path: str) -> str:
    """What to use instead of a damaged checkpoint: the run's previous kept one, if any."""
    run_dir = os.path.dirname(os.path.dirname(os.path.abspath(path)))
    try:
        found = [p for p in list_checkpoints(run_dir, remove_partial=False)
                 if os.path.basename(p) < os.path.basename(path.rstrip("/"))]
    except (CheckpointError, OSError):
        found = []
    if found:
        return (f"use an earlier checkpoint: {found[-1]} is the run's previous one (train.resume=auto falls back to "
                f"it by itself)")
    return "use an earlier checkpoint (this run keeps none before it)"


def _dcp_load(state: dict, path: str) -> None:
    record = _read_record(path)  # before any byte of the metadata or the shards is used
    _read_metadata(path, verified=True)  # refuses a pickle that could run code in one clear line (DCP rewraps errors)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=SINGLE_PROCESS_WARNING)
        try:
            dcp.load(state, storage_reader=_SafeReader(path, record), planner=_SafeLoadPlanner(),
                     no_dist=not dist.is_initialized())
        except CheckpointException as e:  # DCP collects every rank's failure into one (BaseException) error
            raise CheckpointError(_describe_load_failure(path, e)) from None


def _describe_load_failure(path: str, e: CheckpointException) -> str:
    """One line for a failed DCP read: a pickled item that names code (refused by torch's weights-only
    unpickler) is refused as such; anything else (a truncated or missing shard file) is damage."""
    errors = [failure[0] if isinstance(failure, tuple) else failure for failure in e.failures.values()]
    refused = [err for err in errors if isinstance(err, pickle.UnpicklingError) and "Weights only" in str(err)]
    if refused:
        named = [line.strip() for line in str(refused[0]).splitlines() if "GLOBAL" in line or "global" in line]
        return (f"checkpoint {path!r} holds objects other than tensors and plain values"
                f"{f' ({named[0][:160]})' if named else ''}; refusing to load it (it could run code)")
    swapped = [err for err in errors if isinstance(err, checkpoint_metadata.RefusedMetadata)]
    if swapped:  # a shard made a link or a FIFO after the metadata check (checkpoint_checksums.open_plain)
        return f"checkpoint {path!r}: {swapped[0]}: refusing to load it"
    mismatch = [err for err in errors if isinstance(err, checkpoint_checksums.ChecksumMismatch)]
    if mismatch:
        return f"checkpoint {path!r} is damaged: {mismatch[0]}; {_earlier(path)}"
    first = errors[0] if errors else e
    detail = str(first).strip().splitlines()[0] if str(first).strip() else "the file ends early"
    return (f"checkpoint {path!r} is damaged: reading its shards failed ({type(first).__name__}: {detail[:200]}); "
            f"use an earlier checkpoint")


def read_train_state(path: str, keys: tuple[str, ...] = ("step",)) -> dict:
    """A checkpoint's train_state.json, checked as data from elsewhere: a JSON object holding `keys`, an integer
    step and, where present, the run's config as an object. One line naming the file on anything else."""
    file = os.path.join(path, TRAIN_STATE)
    fix = "this checkpoint cannot be used: remove it, or use an earlier one of the run"
    try:
        checkpoint_metadata.check_plain_file(path, TRAIN_STATE)
    except checkpoint_metadata.RefusedMetadata as e:
        raise CheckpointError(f"checkpoint {path!r}: {e}; {fix}") from None
    state = read_json(file, keys, fix=fix)
    if type(state.get("step")) is not int or state["step"] < 0 or not isinstance(state.get("config", {}), dict):
        raise CheckpointError(f"{file} is not a dit_train train state (an integer 'step' and the run's 'config' "
                              f"object expected); {fix}")
    too_big = _config_beyond_any_schema(state.get("config", {}))
    if too_big:
        raise CheckpointError(f"{file}: its config holds {too_big}, beyond any dit_train config (~110 values, at most "
                              f"{MAX_CONFIG_NODES:,} and {MAX_CONFIG_DEPTH} levels deep are read): not read; {fix}")
    return state


# A run's config in train_state.json has ~110 values (keys, list items and leaves; `experiment=debug`) 4 levels deep,
# and every key of every schema's every option together is 203 (config.schemas.every_key). Readers make an OmegaConf
# node of it (~0.4 ms per value: a crafted config of 10^6 keys within the 16 MB file cap held dit-sample for 399 s
# and 3.5 GB), so a config of more than ~10x every key there is, or nested deeper than any schema, is refused first.
MAX_CONFIG_NODES = 2000
MAX_CONFIG_DEPTH = 16


def _config_beyond_any_schema(config) -> str | None:
    """What makes a JSON config larger than any dit_train config ("more than N values", "values nested deeper
    than N levels"), or None. Stops counting at the limit; iterative, so a deep nesting cannot exhaust the stack."""
    count, todo = 0, [(config, 0)]
    while todo:
        node, depth = todo.pop()
        count += 1
        if count > MAX_CONFIG_NODES:
            return f"more than {MAX_CONFIG_NODES:,} values"
        if depth > MAX_CONFIG_DEPTH:
            return f"values nested deeper than {MAX_CONFIG_DEPTH} levels"
        if isinstance(node, dict):
            todo.extend((v, depth + 1) for v in node.values())
        elif isinstance(node, list):
            todo.extend((v, depth + 1) for v in node)
    return None


def saved_config(path: str, state: dict | None = None) -> dict:
    """The run config a checkpoint was written with (what sampling, export, FD and resume checks read)."""
    if state is None or "config" not in state:
        state = read_train_state(path, ("step", "config"))
    return state["config"]


def read_saved_state(path: str) -> dict:
    """A checkpoint's train state holding the run's config: what the resume decisions read."""
    return read_train_state(path, ("step", "config"))


def literal_config(node):
    """A saved config with every string taken literally: `${` escaped, so that OmegaConf resolves nothing from a
    checkpoint's config (a crafted `${oc.env:...}` would copy the reader's environment into configs and logs)."""
    if isinstance(node, str):
        return node.replace("${", "\\${")
    if isinstance(node, dict):
        return {k: literal_config(v) for k, v in node.items()}
    return [literal_config(v) for v in node] if isinstance(node, list) else node


def load(path: str, model, optimizer, ema_model) -> dict:
    """Collective under a process group: model, optimizer and EMA loaded in place (resharded as needed);
    returns the train state."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

    if not is_complete(path):
        raise CheckpointError(f"{path!r} is a read-only single-file checkpoint of an earlier version (export, "
                              f"sampling and FD read it); training resumes from step_N.dcp checkpoints only")
    built = hyperparameters(optimizer)
    state = tensor_state(model, optimizer, ema_model)
    _dcp_load(state, path)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    set_model_state_dict(ema_model, state["ema"])
    keep_built_hyperparameters(optimizer, built, path)
    return read_train_state(path)


# the keys of a param group that are not the config's: its tensors, the lr the schedule sets each step (TrainState
# sets it again from the schedule on resume) and a step counter (matrix_optimizer.py)
NOT_HYPERPARAMETERS = ("params", "lr", "step")


def hyperparameters(optimizer) -> list[dict]:
    """Each param group's hyperparameters, as the run's config built them."""
    return [{k: v for k, v in group.items() if k not in NOT_HYPERPARAMETERS} for group in optimizer.param_groups]


def keep_built_hyperparameters(optimizer, built: list[dict], path: str) -> None:
    """The config is the truth: loading an optimizer's state replaces its param groups with the checkpoint's, whose
    hyperparameters (weight_decay, eps, betas, initial_lr, ...) were then used silently (a crafted weight_decay=0.9,
    eps=1.0 resumed, and the loss went from 1.36 to 8.28). One line naming the first that differs; a key the
    checkpoint lacks or adds is the config's again (torch versions differ in the keys they save)."""
    def same(a, b):
        if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
            return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
        if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
            return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
        return type(a) is type(b) and a == b

    for i, (group, config) in enumerate(zip(optimizer.param_groups, built)):
        for key, value in config.items():
            if key in group and not same(group[key], value):
                raise CheckpointError(f"checkpoint {path!r}: its optimizer state has {key}={group[key]!r} in param "
                                      f"group {i}, and this run's config gives {key}={value!r}: the config is what a "
                                      f"run trains with; resume with the config the checkpoint was written with, or "
                                      f"fork it with train.init_from=<checkpoint> (weights only)")
        for key in [k for k in group if k not in config and k not in NOT_HYPERPARAMETERS]:
            del group[key]
        group.update({k: v for k, v in config.items() if k not in group})


def load_weights(path: str, model, ema_model) -> None:
    """A fork (train.init_from): the model and EMA weights of a checkpoint, nothing else, into this run's
    (possibly sharded) models. Collective under a process group, like `load`: each rank reads only its own shards
    (resharded from however many ranks wrote them), so no rank holds a full copy (dit_15b: ~120 GB)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    if not is_complete(path):
        raise CheckpointError(f"{path!r} is not a complete step_N.dcp checkpoint; a fork starts from one")
    state = {"model": get_model_state_dict(model), "ema": get_model_state_dict(ema_model)}
    _dcp_load(state, path)
    set_model_state_dict(model, state["model"])
    set_model_state_dict(ema_model, state["ema"])


def ema_updates_of(path: str) -> int:
    """How many updates the EMA weights of a checkpoint average (a fork carries them on)."""
    value = read_train_state(path, ("step", "ema_num_updates"))["ema_num_updates"]
    if type(value) is not int or value < 0:
        raise CheckpointError(f"{os.path.join(path, TRAIN_STATE)}: ema_num_updates={value!r} is not a count of EMA "
                              f"updates (an integer >= 0); this checkpoint cannot be used: remove it, or use an "
                              f"earlier one of the run")
    return value


def stored_shapes(path: str, prefix: str) -> dict[str, tuple[int, ...]]:
    """Name (without the prefix) -> full shape of one part's tensors, from the checkpoint's metadata alone."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    head = prefix + "."
    return {k[len(head):]: tuple(m.size) for k, m in _read_metadata(path).state_dict_metadata.items()
            if k.startswith(head) and isinstance(m, TensorStorageMetadata)}


def read_tensors(path: str, prefix: str) -> dict[str, torch.Tensor]:
    """Consolidated (full, CPU) tensors of one part of a checkpoint (`prefix` "ema", "model" or "optimizer"),
    keyed without the prefix. Needs no process group: any number of ranks wrote it, one reads it."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = _read_metadata(path)
    head = prefix + "."
    out = {k: torch.empty(m.size, dtype=m.properties.dtype)
           for k, m in meta.state_dict_metadata.items()
           if k.startswith(head) and isinstance(m, TensorStorageMetadata)}
    if not out:
        raise KeyError(f"checkpoint {path!r} holds no '{prefix}' tensors")
    _dcp_load(out, path)
    return {k[len(head):]: v for k, v in out.items()}


def check_saved_model(path: str, config: dict, shapes: dict[str, tuple[int, ...]], part: str = "ema"):
    """The DiTConfig of a checkpoint's saved `config`, checked (one line) against the `shapes` its `part` tensors
    have, before any model is built: a saved config from elsewhere declaring another or an absurd model (a huge
    depth, width or image_size) is refused naming both (model/stored_shapes.py)."""
    from dit_train.model.dit import DiTConfig
    from dit_train.model.stored_shapes import check_stored_shapes

    source = os.path.join(path, TRAIN_STATE) if os.path.isdir(path) else path
    model = config.get("model")
    if not isinstance(model, dict):
        raise CheckpointError(f"{source}: its saved config has no model section; it was not written by dit_train")
    try:
        architecture = DiTConfig.from_cfg(model)
        architecture.validate()
    except ValueError as e:
        raise CheckpointError(f"{source}: {e}") from None
    try:
        check_stored_shapes(architecture, shapes, source, f"{path} ({part} tensors)")
    except ValueError as e:
        raise CheckpointError(str(e)) from None
    return architecture


def _read_legacy(path: str) -> dict:
    """A single-file checkpoint of an earlier version, as data: numpy's RNG-state arrays are the only
    non-torch objects it holds."""
    import numpy as np

    core = getattr(np, "_core", None) or np.core  # numpy 2 renamed it; files name the module that wrote them
    allowed = [core.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]
    try:
        with torch.serialization.safe_globals(allowed):
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise CheckpointError(f"checkpoint {path!r} holds objects other than tensors and plain values; "
                              f"refusing to load it (it could run code): {str(e).splitlines()[0]}") from None


def load_ema_weights(path: str) -> tuple[dict[str, torch.Tensor], dict, dict]:
    """(EMA state dict of full CPU tensors, run config as a dict, meta) from a checkpoint or a run folder.
    meta has step, active_time_s, path and format ('dcp' or the read-only 'pt')."""
    path = resolve_checkpoint(path)
    if is_complete(path):
        state = read_train_state(path, ("step", "config"))
        check_saved_model(path, saved_config(path, state), stored_shapes(path, "ema"))  # before reading them
        weights, fmt = read_tensors(path, "ema"), "dcp"
    else:
        state = _read_legacy(path)
        if "config" not in state:
            raise CheckpointError(f"checkpoint {path!r} holds no run config: it was not written by dit_train")
        weights, fmt = state["ema"]["model"], "pt"
        check_saved_model(path, state["config"], {k: tuple(v.shape) for k, v in weights.items()})
    meta = {"step": state["step"], "active_time_s": state.get("active_time_s", 0.0), "path": path, "format": fmt,
            "latents_vae": state.get("latents_vae")}  # the VAE a latent run was trained with (older ones: None)
    return weights, saved_config(path, state), meta


def load_for_inference(path: str, device="cpu"):
    """(ema_model, cfg, meta) from a checkpoint or a run folder (no process group needed)."""
    from omegaconf import OmegaConf

    from dit_train.model.dit import build_model

    weights, config, meta = load_ema_weights(path)
    cfg = OmegaConf.create(literal_config(config))
    # built on meta and given the checkpoint's tensors: no seeded init to draw and overwrite (dit_15b: minutes)
    model = build_model(cfg.model, device="meta")
    model.load_state_dict(weights, assign=True)
    model.pos_embed = torch.empty(model.pos_embed.shape)  # not in checkpoints: computed
    model.reset_buffers()
    return model.to(device).eval(), cfg, meta
