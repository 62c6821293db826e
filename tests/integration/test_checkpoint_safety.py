"""Checkpoints are data, not code: a checkpoint whose pickled parts would run code when loaded is refused by every
reader (resume, export, sampling and the FD jobs all go through dit_train.runs.checkpoint), and nothing runs."""

import importlib
import io
import os
import pickle
import re

import pytest
import torch
from omegaconf import OmegaConf

from dit_train.model.dit import DiT, DiTConfig
from dit_train.runs import checkpoint as ckpt


class Payload:
    """Unpickling this calls os.makedirs(path): the side effect shows whether code ran."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return os.makedirs, (self.path,)


TINY = {"image_size": 8, "in_channels": 1, "patch_size": 2, "hidden_size": 32, "depth": 1, "num_heads": 2,
        "num_classes": 2}


def saved_run(tmp_path, model: dict | None = None):
    """A one-step checkpoint of a tiny DiT's EMA weights (seed 0), its saved config declaring `model` (TINY's keys
    by default)."""
    run_dir = str(tmp_path / "run")
    torch.manual_seed(0)
    ema = DiT(DiTConfig(**TINY)).state_dict()
    tensors = {"ema": ema, "optimizer": {"param_groups": [{"lr": 0.1}]}}
    config = {"model": {**TINY, **(model or {})}, "data": {"name": "synthetic"}}
    path = ckpt.save(run_dir, 1, tensors, {"step": 1, "active_time_s": 0.0, "config": config}, keep_last=0)
    return run_dir, path


def main_in_process(module: str, argv: list, cwd, monkeypatch, capfd) -> tuple[int, str]:
    """`python -m module *argv` by `cwd` as its main(argv) in this process: (exit code, stderr). These tests are
    about what the command answers, not about a process; a new Python importing torch is ~3 s here."""
    monkeypatch.chdir(cwd)
    capfd.readouterr()
    code = importlib.import_module(module).main(argv)
    return code, capfd.readouterr().err


def test_a_clean_checkpoint_reads_back(tmp_path):
    run_dir, path = saved_run(tmp_path)
    weights, config, meta = ckpt.load_ema_weights(run_dir)
    torch.manual_seed(0)
    ema = DiT(DiTConfig(**TINY)).state_dict()
    assert weights.keys() == ema.keys() and all(torch.equal(weights[k], ema[k]) for k in ema) \
        and meta["step"] == 1 and meta["format"] == "dcp"


def test_code_in_dcp_metadata_is_refused(tmp_path):
    run_dir, path = saved_run(tmp_path)
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(Payload(tmp_path / "pwned"), f)
    with pytest.raises(ckpt.CheckpointError, match="refusing to load"):
        ckpt.load_ema_weights(run_dir)
    assert not (tmp_path / "pwned").exists()


def test_code_in_a_dcp_non_tensor_item_is_refused(tmp_path):
    """The optimizer's param-group values are stored as pickled items; one that would run code stops resume."""
    model, ema = torch.nn.Linear(3, 1), torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    tensors = ckpt.tensor_state(model, optimizer, ema)
    tensors["optimizer"]["param_groups"][0]["lr"] = Payload(tmp_path / "pwned")
    path = ckpt.save(str(tmp_path / "run"), 1, tensors, {"step": 1, "config": {}}, keep_last=0)
    assert not (tmp_path / "pwned").exists()  # saving pickled it without running it
    with pytest.raises(ckpt.CheckpointError, match="could run code"):
        ckpt.load(path, model, optimizer, ema)  # what resume calls
    assert not (tmp_path / "pwned").exists()


def test_code_in_a_legacy_single_file_checkpoint_is_refused(tmp_path):
    folder = tmp_path / "run" / "checkpoints"
    folder.mkdir(parents=True)
    torch.save({"step": 5, "config": {}, "ema": {"model": {}}, "rng": Payload(tmp_path / "pwned")},
               folder / "step_00000005.pt")
    for reader in (ckpt.load_ema_weights, ckpt.load_for_inference):
        with pytest.raises(ckpt.CheckpointError, match="could run code"):
            reader(str(tmp_path / "run"))
    assert not (tmp_path / "pwned").exists()


# ---- the metadata pickle, attacked by name -------------------------------------------------------------------
def stack_global(module: str, name: str, call_args: tuple | None = None) -> bytes:
    """A protocol-4 pickle that looks up `module`/`name` with STACK_GLOBAL (which follows dotted names) and, with
    `call_args`, calls it (REDUCE): what a crafted `.metadata` does to reach code."""
    def text(s):
        b = s.encode()
        return b"\x8c" + bytes([len(b)]) + b if len(b) < 256 else b"X" + len(b).to_bytes(4, "little") + b

    body = text(module) + text(name) + pickle.STACK_GLOBAL
    if call_args is not None:
        body += pickle.dumps(tuple(call_args), protocol=4)[2:-1] + pickle.REDUCE  # the args tuple, unframed
    return pickle.PROTO + b"\x04" + body + pickle.STOP


DCP_FS = "torch.distributed.checkpoint.filesystem"
DOTTED_PAYLOADS = {  # the review's payloads: each reaches a callable through an allowed module by a dotted name
    "Popen": (DCP_FS, "torch._strobelight.cli_function_profiler.subprocess.Popen"),
    "FileIO": (DCP_FS, "io.FileIO"),
    "CDLL": ("torch", "ctypes.CDLL"),
    "os.system": (DCP_FS, "os.system"),
    "makedirs": ("pathlib", "os.makedirs"),
    "eval": ("collections", "_sys.modules.builtins.eval"),
}


@pytest.mark.parametrize("payload", sorted(DOTTED_PAYLOADS))
def test_dotted_names_in_metadata_reach_nothing_in_any_reader(tmp_path, payload):
    """Each payload's call would create a file if it ran; every reader (sampling/export/FD: load_ema_weights and
    load_for_inference; resume: load; fork: load_weights; read_tensors) refuses it in one line and nothing runs."""
    module, name = DOTTED_PAYLOADS[payload]
    marker = tmp_path / "pwned"
    args = {"Popen": (["sh", "-c", f"touch {marker}"],), "FileIO": (str(marker), "w"), "CDLL": (None,),
            "os.system": (f"touch {marker}",), "makedirs": (str(marker),), "eval": (f"open({str(marker)!r}, 'w')",)}
    run_dir, path = saved_run(tmp_path)
    with open(os.path.join(path, ".metadata"), "wb") as f:
        f.write(stack_global(module, name, args[payload]))
    model, ema = torch.nn.Linear(3, 1), torch.nn.Linear(3, 1)
    readers = [lambda: ckpt.load_ema_weights(run_dir), lambda: ckpt.load_for_inference(run_dir),
               lambda: ckpt.load(path, model, torch.optim.SGD(model.parameters(), lr=0.1), ema),
               lambda: ckpt.load_weights(path, model, ema), lambda: ckpt.read_tensors(path, "ema")]
    for reader in readers:
        with pytest.raises(ckpt.CheckpointError, match=f"names {module}.{name}.*refusing to load") as e:
            reader()
        assert "\n" not in str(e.value)
    assert not marker.exists()


def reachable_names():
    """(module, dotted name) pairs reachable from the modules an honest `.metadata` names: every attribute of
    those modules and every attribute of those attributes (the dotted names protocol 4 would follow)."""
    import collections
    import pathlib

    import torch.distributed.checkpoint.metadata as md

    names = set()
    for module in (md, ckpt.dcp.filesystem, torch, torch.serialization, pathlib, collections):
        for a in dir(module):
            names.add((module.__name__, a))
            obj = getattr(module, a, None)
            for b in dir(obj) if obj is not None and not isinstance(obj, (str, bytes, int, float)) else ():
                names.add((module.__name__, f"{a}.{b}"))
    return sorted(names)


def test_only_the_exact_allowed_names_resolve(tmp_path):
    """A fuzz over every name reachable from the allowed modules (tens of thousands): each is refused, except the
    exact (module, name) pairs of the allow-list, which resolve to the very object of that name."""
    from dit_train.runs import checkpoint_metadata as cm

    resolved = {}
    pairs = reachable_names() + [("builtins", "eval"), ("os", "system"), ("subprocess", "Popen"),
                                 ("torch", "load"), ("torch.serialization", "load"), ("io", "FileIO")]
    assert len(pairs) > 10000
    for module, name in pairs:
        try:
            resolved[(module, name)] = cm._Unpickler(io.BytesIO(stack_global(module, name))).load()
        except cm.RefusedMetadata:
            pass
    assert set(resolved) <= set(cm.ALLOWED)
    for (module, name), obj in resolved.items():
        target = importlib.import_module(module)
        for part in name.split("."):  # what the name means, resolved independently of the unpickler
            target = getattr(target, part)
        assert obj is target, (module, name)
    assert {n for n in cm.ALLOWED if n[0] != "torch" or n[1] == "Size"} <= set(resolved)


def test_build_may_not_set_attributes_of_our_own_code():
    """BUILD on a class, a function or an enum member would change code every later checkpoint load runs."""
    from dit_train.runs import checkpoint_metadata as cm

    targets = [("torch.distributed.checkpoint.metadata", "Metadata"), ("torch.serialization", "_get_layout"),
               ("collections", "OrderedDict")]
    for module, name in targets:
        state = pickle.dumps({"__setstate__": None, "cache": {}}, protocol=4)[2:-1]
        data = stack_global(module, name)[:-1] + state + pickle.BUILD + pickle.STOP
        with pytest.raises(cm.RefusedMetadata, match="sets attributes"):
            cm.loads(data)
    layout_cache = torch.serialization._get_layout.__dict__.get("cache")
    assert layout_cache is None or all(isinstance(v, torch.layout) for v in layout_cache.values())


def rewrite_metadata(path: str, change) -> None:
    """Edit a real checkpoint's metadata with `change(metadata)` and write it back with the standard pickler."""
    from dit_train.runs import checkpoint_metadata as cm

    metadata = cm.read(path)
    change(metadata)
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(metadata, f)


@pytest.mark.parametrize("where", ["../../../secret.distcp", "/etc/passwd", "sub/__0_0.distcp", ".hidden.distcp"])
def test_metadata_cannot_point_at_files_outside_the_checkpoint(tmp_path, where):
    run_dir, path = saved_run(tmp_path)
    (tmp_path / "secret.distcp").write_bytes(open(os.path.join(path, "__0_0.distcp"), "rb").read())

    def elsewhere(metadata):
        for info in metadata.storage_data.values():
            info.relative_path = where

    rewrite_metadata(path, elsewhere)
    with pytest.raises(ckpt.CheckpointError, match="not a shard file in its folder.*refusing"):
        ckpt.load_ema_weights(run_dir)


def test_metadata_may_not_ask_for_byte_transforms(tmp_path):
    run_dir, path = saved_run(tmp_path)

    def transformed(metadata):
        for info in metadata.storage_data.values():
            info.transform_descriptors = ["zstd"]

    rewrite_metadata(path, transformed)
    with pytest.raises(ckpt.CheckpointError, match="byte transforms"):
        ckpt.load_ema_weights(run_dir)


@pytest.mark.parametrize("name", ["__0_0.distcp", ".metadata", "train_state.json"])
@pytest.mark.parametrize("kind", ["link elsewhere", "fifo"])
def test_a_checkpoint_file_that_is_a_link_or_a_fifo_is_refused_without_reading_it(tmp_path, name, kind):
    """A shard linked to a file elsewhere was read into the weights; a FIFO in its place hung every reader
    (dit-sample waited forever). Each reader refuses it in one line, within seconds."""
    import signal

    run_dir, path = saved_run(tmp_path)
    file = os.path.join(path, name)
    os.replace(file, tmp_path / "elsewhere")
    os.symlink(tmp_path / "elsewhere", file) if kind == "link elsewhere" else os.mkfifo(file)

    def hung(*_):
        raise TimeoutError(f"the reader hung on the {kind}")

    model, ema = torch.nn.Linear(3, 1), torch.nn.Linear(3, 1)
    readers = [lambda: ckpt.load_ema_weights(run_dir), lambda: ckpt.load_for_inference(run_dir),
               lambda: ckpt.load(path, model, torch.optim.SGD(model.parameters(), lr=0.1), ema),
               lambda: ckpt.load_weights(path, model, ema)]
    previous = signal.signal(signal.SIGALRM, hung)
    try:
        for reader in readers[:1] if name == "train_state.json" else readers:  # the tensor readers skip train_state
            signal.alarm(20)
            with pytest.raises(ckpt.CheckpointError, match=f"its {re.escape(name)} is .*never holds") as e:
                reader()
            signal.alarm(0)
            assert "\n" not in str(e.value)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


# ---- damaged files: one line that says damaged, never "could run code" ----------------------------------------
@pytest.mark.parametrize("damage", ["empty metadata", "truncated metadata", "garbage metadata",
                                    "truncated shard", "missing shard", "metadata of another kind"])
def test_a_damaged_checkpoint_is_reported_as_damaged(tmp_path, damage):
    run_dir, path = saved_run(tmp_path)
    meta, shard = os.path.join(path, ".metadata"), os.path.join(path, "__0_0.distcp")
    if damage == "empty metadata":
        open(meta, "wb").close()
    elif damage == "truncated metadata":
        data = open(meta, "rb").read()
        open(meta, "wb").write(data[: len(data) // 2])
    elif damage == "garbage metadata":
        open(meta, "wb").write(os.urandom(300))
    elif damage == "truncated shard":
        os.truncate(shard, os.path.getsize(shard) // 2)
    elif damage == "missing shard":
        os.remove(shard)
    else:
        open(meta, "wb").write(pickle.dumps({"state_dict_metadata": {}}))
    with pytest.raises(ckpt.CheckpointError, match="is damaged") as e:
        ckpt.load_ema_weights(run_dir)
    assert "\n" not in str(e.value) and "could run code" not in str(e.value)


def test_sample_command_refuses_a_crafted_checkpoint_in_one_line(tmp_path, monkeypatch, capfd):
    """The user's side: `dit-sample RUN` on a run folder from elsewhere whose metadata would run a
    shell command: one line on stderr, a non-zero exit, and the command never ran."""
    run_dir, path = saved_run(tmp_path)
    marker = tmp_path / "pwned"
    with open(os.path.join(path, ".metadata"), "wb") as f:
        f.write(stack_global(*DOTTED_PAYLOADS["Popen"], (["sh", "-c", f"touch {marker}"],)))
    for module in ("dit_train.sample", "dit_train.export"):
        args = [run_dir] + ([str(tmp_path / "out")] if "export" in module else [])
        code, err = main_in_process(module, args, tmp_path, monkeypatch, capfd)
        assert code != 0 and not marker.exists()
        lines = [ln for ln in err.splitlines() if ln.strip() and "Warning" not in ln]
        assert len(lines) == 1 and "refusing to load" in lines[0], err


# ---- the JSON beside the tensors ------------------------------------------------------------------------------
@pytest.mark.parametrize("content, match", [
    (b'{"step": 1, "conf', "is not valid JSON"),
    (b'[1, 2]', "holds a JSON list"),
    (b'{"step": "1", "config": {}}', "not a dit_train train state"),
    (b'{"step": 1, "config": "model=dit_s"}', "not a dit_train train state"),
    (b'{"step": 1}', "has no 'config'"),
])
def test_a_damaged_train_state_is_one_line_naming_the_file(tmp_path, content, match):
    run_dir, path = saved_run(tmp_path)
    with open(os.path.join(path, ckpt.TRAIN_STATE), "wb") as f:
        f.write(content)
    with pytest.raises(ValueError, match=match) as e:
        ckpt.load_ema_weights(run_dir)
    assert ckpt.TRAIN_STATE in str(e.value) and "\n" not in str(e.value)


def test_a_saved_config_resolves_nothing(tmp_path, monkeypatch):
    """`${oc.env:...}` in a crafted checkpoint's config stays a literal string: the reader's environment is never
    copied into the config it hands to sampling, export or FD."""
    monkeypatch.setenv("DIT_TRAIN_TEST_SECRET", "s3cret")
    config = {"model": {"name": "${oc.env:DIT_TRAIN_TEST_SECRET}"}, "run_dir": ["${oc.env:HOME}"]}
    literal = OmegaConf.create(ckpt.literal_config(config))
    assert literal.model.name == "${oc.env:DIT_TRAIN_TEST_SECRET}" and literal.run_dir[0] == "${oc.env:HOME}"
    assert "s3cret" not in OmegaConf.to_yaml(literal, resolve=True)


def test_a_train_state_cannot_set_scheduler_attributes(tmp_path):
    """LRScheduler.load_state_dict sets every key it is given as an attribute: a crafted train state's scheduler
    entry may hold only the keys of the run's own scheduler."""
    from dit_train.diffusion.ema import EMA
    from dit_train.trainer.state import TrainState

    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    ts = TrainState(scheduler=sched, generator=torch.Generator(), ema=EMA(model, 0.9))
    state = ts.state_dict()
    state["scheduler"] = {**state["scheduler"], "optimizer": {"param_groups": []}, "step": None}
    with pytest.raises(ckpt.CheckpointError, match=r"keys \['optimizer', 'step'\]"):
        ts.load_state_dict(state)
    assert sched.optimizer is opt
    ts.load_state_dict(ts.state_dict())  # its own state loads


@pytest.mark.parametrize("content, match", [(b'{"hidden', "is not valid JSON"), (b'[]', "not a model config"),
                                            (b'{"hidden_size": "big"}', "model.hidden_size='big' is not valid")])
def test_an_exported_folder_from_elsewhere_is_checked_before_anything_is_built(tmp_path, content, match):
    from dit_train.model.dit import DiT, DiTConfig

    DiT(DiTConfig(image_size=8, patch_size=2, hidden_size=32, depth=1, num_heads=2)).save_pretrained(str(tmp_path))
    (tmp_path / "config.json").write_bytes(content)
    with pytest.raises(ValueError, match=match) as e:
        DiT.from_pretrained(str(tmp_path))
    assert "config.json" in str(e.value) and "\n" not in str(e.value)


def test_an_exported_config_declaring_a_huge_model_is_refused_before_anything_is_allocated(tmp_path):
    """config.json from elsewhere declaring hidden_size 131072 (a 69 GB first block matrix) beside small weights:
    the model was built and initialised before the weights were read (an OOM kill where the allocator gives the
    memory; here it refuses and the traceback names no file). It is built on meta, so the weights decide."""
    import json

    from dit_train.model.dit import DiT, DiTConfig

    DiT(DiTConfig(image_size=8, patch_size=2, hidden_size=32, depth=1, num_heads=2)).save_pretrained(str(tmp_path))
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "hidden_size": 131072, "num_heads": 1024}))
    with pytest.raises(ValueError, match=r"model\.safetensors' does not hold the weights of the model .*config\.json")\
            as e:
        DiT.from_pretrained(str(tmp_path))
    assert "\n" not in str(e.value)


CRAFTED_ARCHITECTURES = {  # a saved or exported config from elsewhere beside TINY's weights -> what the line names
    # no weight pins image_size: its position table (2^38 tokens x 32: 32 TiB) was allocated, then filled
    "huge image_size": ({"image_size": 2**20}, r"image_size=1048576 with patch_size=2 makes a position table of "
                                               r"8,796,093,022,208 values, more than the model's [\d,]+ parameters"),
    # 10^8 blocks were built (on meta: Python modules, gigabytes) before any shape was compared
    "huge depth": ({"depth": 10**8}, r"depth=100000000, but the weights hold 1 blocks"),
    "another width": ({"hidden_size": 64}, r": the config makes \[.*\] \([\d,]+ values\), the weights hold \["),
}


@pytest.mark.parametrize("crafted", sorted(CRAFTED_ARCHITECTURES))
def test_a_saved_config_that_disagrees_with_its_tensors_is_refused_before_anything_is_built(tmp_path, crafted):
    """The checkpoint's metadata declares the true shapes; a saved config declaring another or an absurd model is
    refused naming both by every reader that builds the model (sampling and FD: load_for_inference; export:
    load_ema_weights), before a tensor is read."""
    model, match = CRAFTED_ARCHITECTURES[crafted]
    run_dir, _ = saved_run(tmp_path, model)
    for reader in (ckpt.load_ema_weights, ckpt.load_for_inference):
        with pytest.raises(ckpt.CheckpointError, match=match) as e:
            reader(run_dir)
        assert "train_state.json" in str(e.value) and "ema tensors" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("crafted", sorted(CRAFTED_ARCHITECTURES))
def test_an_exported_config_that_disagrees_with_its_weights_is_refused_before_anything_is_built(tmp_path, crafted):
    """The same for an exported folder's config.json against the safetensors header: DiT.from_pretrained and, with
    diffusers, the transformer's and the pipeline's from_pretrained."""
    import json

    from dit_train.model.pretrained import save_export

    model, match = CRAFTED_ARCHITECTURES[crafted]
    torch.manual_seed(0)
    dit = DiT(DiTConfig(**TINY))
    save_export(dit.state_dict(), dit.config, str(tmp_path))
    config_file = tmp_path / "transformer" / "config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), **model}))
    loaders = [lambda: DiT.from_pretrained(str(tmp_path))]
    if importlib.util.find_spec("diffusers"):
        from dit_train.diffusers_pipeline import DiTTrainPipeline, DiTTrainTransformer2DModel

        loaders += [lambda: DiTTrainPipeline.from_pretrained(str(tmp_path)),
                    lambda: DiTTrainTransformer2DModel.from_pretrained(str(tmp_path), subfolder="transformer")]
    for load in loaders:
        with pytest.raises(ValueError, match=match) as e:
            load()
        assert "config.json" in str(e.value) and ".safetensors" in str(e.value) and "\n" not in str(e.value)


def test_sample_and_export_refuse_a_huge_declared_model_in_one_line(tmp_path, monkeypatch, capfd):
    """The user's side: `dit-sample RUN` / `dit-export RUN OUT` on a run folder whose saved config declares a huge
    image_size: one line, exit 2, nothing written."""
    run_dir, _ = saved_run(tmp_path, {"image_size": 2**20})
    for module in ("dit_train.sample", "dit_train.export"):
        args = [run_dir] + ([str(tmp_path / "out")] if "export" in module else [])
        code, err = main_in_process(module, args, tmp_path, monkeypatch, capfd)
        lines = [ln for ln in err.splitlines() if ln.strip() and "Warning" not in ln]
        assert code == 2 and len(lines) == 1 and "makes a position table" in lines[0], err
    assert not (tmp_path / "out").exists() and not (tmp_path / "run" / "samples.png").exists() \
        and not (tmp_path / "samples.png").exists()  # dit-sample's default grid, by the working directory


@pytest.mark.parametrize("size", [[10**12], [-1], ["3"]])
def test_a_declared_tensor_size_the_shards_cannot_hold_is_damage_found_before_allocating(tmp_path, size):
    """A `.metadata` declaring a 4 TB tensor: the export, sampling and FD readers allocated what it declared (an
    allocation failure as a traceback, or an out-of-memory where the allocator gave the memory); a negative or
    non-integer size failed inside torch. Each is one line saying the checkpoint is damaged."""
    run_dir, path = saved_run(tmp_path)

    def huge(metadata):
        metadata.state_dict_metadata["ema.final_layer.linear.bias"].size = torch.Size(size) if size != ["3"] else ("3",)

    rewrite_metadata(path, huge)
    with pytest.raises(ckpt.CheckpointError, match="is damaged: its .metadata (declares|is not a DCP)") as e:
        ckpt.load_ema_weights(run_dir)
    assert "\n" not in str(e.value)


# ---- sizes, hyperparameters and links of a checkpoint from elsewhere -------------------------------------------
def test_a_metadata_larger_than_any_checkpoints_is_refused_before_it_is_read(tmp_path, monkeypatch):
    """A sparse 3 GB `.metadata` was read whole (3.4 GB, 48 s) before it was found damaged; 30 GB was an
    out-of-memory kill. One byte over the limit is refused in one line, and the file is never opened."""
    from dit_train.runs import checkpoint_metadata as cm

    run_dir, path = saved_run(tmp_path)
    meta = os.path.join(path, ".metadata")
    os.truncate(meta, (512 << 20) + 1)  # the limit (checkpoint_metadata.py derives it) and a byte; sparse
    opened = []
    monkeypatch.setattr(cm, "open", lambda file, *a, **k: opened.append(file) or open(file, *a, **k), raising=False)
    with pytest.raises(ckpt.CheckpointError, match=f"{re.escape(path)}.* is damaged: its .metadata is "
                                                   f"536,870,913 bytes, more than the 536,870,912") as e:
        ckpt.load_ema_weights(run_dir)
    assert "\n" not in str(e.value) and meta not in opened


@pytest.mark.parametrize("config, match", [
    ({"junk": {f"k{i}": i for i in range(2000)}}, "more than 2,000 values"),
    ({"junk": [[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]}, "nested deeper than 16 levels")])
def test_a_saved_config_larger_than_any_dit_train_config_is_refused_before_omegaconf(tmp_path, monkeypatch,
                                                                                      capfd, config, match):
    """`config.junk` of 10^6 keys (within the 16 MB file cap) held dit-sample for 399 s and 3.5 GB inside
    OmegaConf.create. A config beyond any schema's size is one line naming the file, before any node is made."""
    import omegaconf

    run_dir, path = saved_run(tmp_path)
    file = os.path.join(path, ckpt.TRAIN_STATE)
    state = ckpt.read_train_state(path, ("step", "config"))
    state["config"].update(config)
    with open(file, "w") as f:
        f.write(__import__("json").dumps(state))
    made = []
    monkeypatch.setattr(omegaconf.OmegaConf, "create", lambda *a, **k: made.append(1))
    code, err = main_in_process("dit_train.sample", [run_dir], tmp_path, monkeypatch, capfd)
    lines = [ln for ln in err.splitlines() if ln.strip() and "Warning" not in ln]
    assert code == 2 and len(lines) == 1 and file in lines[0] and match in lines[0], err
    assert not made


def adamw_run(lr=0.1, weight_decay=0.01, eps=1e-8):
    """A Linear with AdamW and the project's warmup+cosine schedule, as a config would build them."""
    from dit_train.diffusion.ema import EMA
    from dit_train.optim.schedule import build_scheduler
    from dit_train.trainer.state import TrainState

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay, eps=eps)
    sched = build_scheduler(opt, total_steps=10, warmup_steps=2, kind="cosine", min_lr_ratio=0.1)
    ema = EMA(model, 0.9)
    return model, opt, sched, TrainState(scheduler=sched, generator=torch.Generator(), ema=ema), ema


def saved_adamw(tmp_path, steps=3, **crafted):
    """A checkpoint after `steps` AdamW steps, its param groups rewritten with `crafted` values before saving."""
    model, opt, sched, state, ema = adamw_run()
    for _ in range(steps):
        model(torch.ones(1, 3)).sum().backward()
        opt.step()
        sched.step()
    state.step = steps
    for group in opt.param_groups:
        group.update(crafted)
    return ckpt.save(str(tmp_path / "run"), steps, ckpt.tensor_state(model, opt, ema.model), state.state_dict(), 0)


@pytest.mark.parametrize("crafted, key", [({"weight_decay": 0.9}, "weight_decay"), ({"eps": 1.0}, "eps"),
                                          ({"betas": (0.5, 0.5)}, "betas"), ({"initial_lr": 1.0}, "initial_lr")])
def test_hyperparameters_in_a_checkpoints_optimizer_state_never_override_the_config(tmp_path, crafted, key):
    """torch's load_state_dict takes the checkpoint's param groups whole: a crafted weight_decay=0.9, eps=1.0 was
    resumed silently (the loss went from 1.36 to 8.28). The config's value is the truth; a differing one is one
    line naming the key and both values, and the run's optimizer keeps the config's."""
    path = saved_adamw(tmp_path, **crafted)
    model, opt, _, _, ema = adamw_run()
    with pytest.raises(ckpt.CheckpointError, match=rf"{re.escape(path)}.*{key}=.* and this run's config gives "
                                                   rf"{key}=") as e:
        ckpt.load(path, model, opt, ema.model)
    assert "\n" not in str(e.value)


def test_the_lr_on_resume_is_the_schedules_not_the_checkpoints(tmp_path):
    """The lr in a checkpoint's param groups is the scheduled one, and the first step after a resume used it as
    stored: a crafted lr=5.0 trained one step with it. It is set from the schedule at the loaded step (as a legit
    checkpoint holds it: bit for bit), and a crafted schedule base lr is refused."""
    from dit_train.optim.schedule import lr_multiplier

    legit = saved_adamw(tmp_path / "legit")
    model, opt, sched, state, ema = adamw_run()
    state.load_state_dict(ckpt.load(legit, model, opt, ema.model))
    kept = [g["lr"] for g in opt.param_groups]
    assert kept == [0.1 * lr_multiplier(3, 10, 2, "cosine", 0.1)] and sched.get_last_lr() == kept

    path = saved_adamw(tmp_path / "lr", lr=5.0)
    model, opt, sched, state, ema = adamw_run()
    state.load_state_dict(ckpt.load(path, model, opt, ema.model))
    assert [g["lr"] for g in opt.param_groups] == kept and sched.get_last_lr() == kept

    file = os.path.join(path, ckpt.TRAIN_STATE)
    crafted = ckpt.read_train_state(path)
    crafted["scheduler"]["base_lrs"] = [7.0]
    model, opt, sched, state, ema = adamw_run()
    with pytest.raises(ckpt.CheckpointError, match=r"base_lrs=\[7.0\], and this run's config gives \[0.1\]"):
        state.load_state_dict(crafted)


@pytest.mark.parametrize("link", ["checkpoints", "checkpoints/step_00000001.dcp"])
def test_checkpoints_are_never_read_through_a_link_to_elsewhere(tmp_path, monkeypatch, capfd, link):
    """`runA/checkpoints -> /elsewhere/run/checkpoints` (or a linked step folder): dit-fd scored the model
    elsewhere and wrote its results into the sweep, dit-sample sampled it. Each refuses in one line."""
    from dit_train.evaluation.fd.job import find_checkpoints

    elsewhere, _ = saved_run(tmp_path / "elsewhere")
    run_dir = tmp_path / "sweep" / "runA"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "checkpoints").rmdir() if link == "checkpoints" else None
    os.symlink(os.path.join(elsewhere, link), run_dir / link)
    for where in (tmp_path / "sweep", run_dir):
        with pytest.raises(ckpt.CheckpointError, match=f"{re.escape(str(run_dir / link))} is a symbolic link"):
            find_checkpoints(where)
    code, err = main_in_process("dit_train.sample", [str(run_dir)], tmp_path, monkeypatch, capfd)
    lines = [ln for ln in err.splitlines() if ln.strip() and "Warning" not in ln]
    assert code == 2 and len(lines) == 1 and "is a symbolic link" in lines[0], err


def test_a_linked_run_folder_in_a_sweep_is_refused(tmp_path):
    from dit_train.evaluation.fd.job import find_checkpoints

    elsewhere, _ = saved_run(tmp_path / "elsewhere")
    (tmp_path / "sweep").mkdir()
    saved_run(tmp_path / "sweep" / "own")
    os.symlink(elsewhere, tmp_path / "sweep" / "runA")
    with pytest.raises(ckpt.CheckpointError, match="sweep/runA is a symbolic link .*runs are scored only from"):
        find_checkpoints(tmp_path / "sweep")
