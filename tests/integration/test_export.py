"""dit-export RUN OUT_DIR writes a diffusers pipeline folder (transformer/config.json + weights,
scheduler/, model_index.json), and DiT.from_pretrained(OUT_DIR) gives back the run's EMA model: the same outputs,
without diffusers or huggingface_hub (the diffusers path: tests/unit/test_diffusers_pipeline.py)."""

import json
import os
import shutil
import sys

import pytest
import torch

from conftest import compose, needs_fashion, run_entry_in_process
from dit_train.runs.checkpoint import load_for_inference
from dit_train.export import main as export_main
from dit_train.model.dit import DiT, DiTConfig
from dit_train.trainer.loop import run


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("export") / "run"
    run(compose([f"run_dir={folder}", "model.hidden_size=32", "model.depth=2", "model.num_heads=2",
                 "model.patch_size=8", "train.steps=3", "train.batch_size=8", "train.val_every=0",
                 "train.sample_every=0", "train.progress=false", "train.ema_decay=0.5"]))
    return folder


def outputs(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    x, t = torch.randn(4, 1, 32, 32, generator=g), torch.rand(4, generator=g)
    with torch.no_grad():
        return model(x, t, y=torch.tensor([0, 3, 7, 10]))


@needs_fashion
def test_export_round_trip_gives_the_same_outputs(trained_run, tmp_path, monkeypatch, capsys):
    out = tmp_path / "exported"
    assert export_main([str(trained_run), str(out)]) == 0
    assert "DiT.from_pretrained" in capsys.readouterr().out
    config = json.loads((out / "transformer" / "config.json").read_text())
    assert config["_class_name"] == "DiTTrainTransformer2DModel" and config["hidden_size"] == 32 and config["torch_dtype"] == "float32"
    assert config["dit_train"]["step"] == 3 and config["dit_train"]["run_config"]["model"]["name"] == "dit_s"
    for blocked in ("diffusers", "huggingface_hub"):  # reading an export needs neither
        monkeypatch.setitem(sys.modules, blocked, None)
    loaded = DiT.from_pretrained(str(out))
    reference, _, _ = load_for_inference(str(trained_run))
    assert not loaded.training
    assert torch.equal(outputs(loaded), outputs(reference))


@needs_fashion
def test_bf16_export_is_close_and_a_file_name_is_refused(trained_run, tmp_path, capsys):
    assert export_main([str(trained_run), str(tmp_path / "bf16"), "--dtype", "bf16"]) == 0
    reference, _, _ = load_for_inference(str(trained_run))
    torch.testing.assert_close(outputs(DiT.from_pretrained(str(tmp_path / "bf16"))), outputs(reference),
                               rtol=5e-2, atol=5e-2)
    assert export_main([str(trained_run), str(tmp_path / "ema.safetensors")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "export writes a folder" in err


def export_command(*args):
    """`dit-export *args`, in this process (what it says and writes is the subject, not the interpreter)."""
    return run_entry_in_process(export_main, *args, prog="dit-export")


@needs_fashion
def test_export_onto_a_full_disk_is_one_line_naming_the_file(trained_run, small_tmpfs):
    """A real 64 KB file system for OUT_DIR: the weights do not fit (before: safetensors' traceback)."""
    out = small_tmpfs("64k") / "exported"
    r = export_command(trained_run, out)
    assert r.returncode == 1 and r.stderr.splitlines() == [
        f"error: No space left on device (ENOSPC): '{out}/transformer/diffusion_pytorch_model.safetensors' "
        f"(in atomic_save_tensors)"], r.stderr
    # no partial file, and no model_index.json that would make it look complete
    assert [f for _, _, files in os.walk(out) for f in files] == []
    assert load_for_inference(str(trained_run))[2]["step"] == 3  # the run is only read


@needs_fashion
@pytest.mark.parametrize("damage,expected", [
    (lambda text: text[: len(text) // 2], "train_state.json is not valid JSON ("),
    (lambda text: json.dumps({k: v for k, v in json.loads(text).items() if k != "config"}),
     "train_state.json has no 'config' (it should hold step, config)"),
])
def test_a_damaged_train_state_is_one_line_naming_the_file(trained_run, tmp_path, damage, expected):
    run_dir = tmp_path / "run"
    shutil.copytree(trained_run, run_dir)
    state = next((run_dir / "checkpoints").glob("step_*.dcp")) / "train_state.json"
    state.write_text(damage(state.read_text()))
    r = export_command(run_dir, tmp_path / "out")
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1, r.stderr
    assert r.stderr.startswith(f"error: {state} ") and expected in r.stderr, r.stderr
    assert not (tmp_path / "out").exists()


@needs_fashion
def test_a_run_folder_name_with_control_characters_prints_as_escapes(trained_run, tmp_path):
    """A run from elsewhere named "run\x1b[2J\n[fd] ..." cleared the terminal and printed a line of its own."""
    run_dir = tmp_path / "run\x1b[2J\r\nerror: fake"
    shutil.copytree(trained_run, run_dir)
    r = export_command(run_dir, tmp_path / "out")
    assert r.returncode == 0 and len(r.stdout.splitlines()) == 1 and "\x1b" not in r.stdout, r.stdout
    assert "run\\x1b[2J\\r\\nerror: fake/checkpoints/step_" in r.stdout
    (tmp_path / "out" / "transformer").rename(tmp_path / "t")
    (tmp_path / "out" / "transformer").symlink_to(run_dir)  # an error naming the folder: escaped too
    r = export_command(run_dir, tmp_path / "out")
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1 and "\x1b" not in r.stderr, r.stderr
    assert "(to " + str(run_dir).replace("\x1b", "\\x1b").replace("\r", "\\r").replace("\n", "\\n") in r.stderr


@needs_fashion
@pytest.mark.parametrize("link", ["transformer", "scheduler", "vae", "transformer/config.json", "model_index.json"])
def test_a_link_in_out_dir_is_refused_before_anything_is_read_or_written(trained_run, tmp_path, link):
    """An existing OUT_DIR from elsewhere with `transformer -> /elsewhere` had /elsewhere/config.json overwritten."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "config.json").write_text("mine")
    (elsewhere / "scheduler_config.json").write_text("mine")
    out = tmp_path / "out"
    (out / ("transformer" if "/" in link else "")).mkdir(parents=True, exist_ok=True)
    (out / link).symlink_to(elsewhere if "." not in link else elsewhere / "config.json")
    r = export_command(trained_run, out)
    assert r.returncode == 2 and r.stderr.splitlines() == [
        f"error: {out / link} is a symbolic link (to {os.readlink(out / link)}): dit-export writes there, so it "
        f"would write outside {out}; remove it"], r.stderr
    assert sorted(os.listdir(elsewhere)) == ["config.json", "scheduler_config.json"]
    assert {(elsewhere / f).read_text() for f in os.listdir(elsewhere)} == {"mine"}
    assert [f for d, _, files in os.walk(out) for f in files if not os.path.islink(os.path.join(d, f))] == []


def test_save_pretrained_keeps_every_architecture_option(tmp_path):
    cfg = DiTConfig(image_size=8, in_channels=4, patch_size=2, hidden_size=32, depth=1, num_heads=2,
                    num_classes=0, qk_norm=True, swiglu=True, text_dim=12)
    model = DiT(cfg)
    with torch.no_grad():
        for p in model.parameters():  # the zero-initialised output layers would hide a wrong load
            p.normal_()
    model.save_pretrained(str(tmp_path / "m"))
    loaded = DiT.from_pretrained(str(tmp_path / "m"))
    assert loaded.config == cfg
    x, t, ctx = torch.randn(2, 4, 8, 8), torch.rand(2), torch.randn(2, 5, 12)
    with torch.no_grad():
        assert torch.equal(loaded(x, t, context=ctx), model.eval()(x, t, context=ctx))


def test_from_pretrained_names_a_folder_that_is_not_an_export(tmp_path):
    with pytest.raises(FileNotFoundError, match="has no model_index.json or config.json"):
        DiT.from_pretrained(str(tmp_path))


def test_a_missing_local_folder_is_one_line_and_only_hf_urls_reach_the_hub(tmp_path, monkeypatch):
    """`DiT.from_pretrained("exported/my_dit")` (the docs' path) with no such folder here asked the Hub for the repo
    "exported/my_dit": whoever owns that name supplied the weights."""
    import types

    asked = []
    model = DiT(DiTConfig(image_size=8, patch_size=2, hidden_size=32, depth=1, num_heads=2))
    model.save_pretrained(str(tmp_path / "snapshot"))
    hub = types.ModuleType("huggingface_hub")  # installed or not: a stand-in that records what is asked of the Hub
    hub.snapshot_download = lambda repo, **kw: asked.append(repo) or str(tmp_path / "snapshot")
    monkeypatch.setitem(sys.modules, "huggingface_hub", hub)
    monkeypatch.chdir(tmp_path)
    for path in ("exported/my_dit", "./my_dit", str(tmp_path / "my_dit"), "my_dit"):
        with pytest.raises(FileNotFoundError, match=f"^'{path}': no such folder .*loads only when named "
                                                    f"hf://OWNER/NAME$"):
            DiT.from_pretrained(path)
    assert asked == []
    loaded = DiT.from_pretrained("hf://someone/my_dit")  # the documented spelling of a Hub repo
    assert asked == ["someone/my_dit"]
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), model.state_dict().values()))
    with pytest.raises(FileNotFoundError, match="'hf://my_dit' is not valid: a Hugging Face Hub model is hf://"):
        DiT.from_pretrained("hf://my_dit")


@needs_fashion
def test_loading_for_inference_draws_no_init_and_holds_the_ema_weights(trained_run, monkeypatch):
    """The checkpoint's tensors are the weights: nothing is drawn only to be overwritten (dit_15b: minutes)."""
    from dit_train.runs import checkpoint as ckpt
    from dit_train.model.dit import sincos_pos_embed_2d

    def refuse(*a, **kw):
        raise AssertionError("the seeded init ran")

    monkeypatch.setattr(DiT, "reset_parameters", refuse)
    model, _, _ = load_for_inference(str(trained_run))
    ema = ckpt.read_tensors(ckpt.resolve_checkpoint(str(trained_run)), "ema")
    assert all(torch.equal(v, ema[k]) for k, v in model.state_dict().items())
    assert torch.equal(model.pos_embed, sincos_pos_embed_2d(model.pos_embed.shape[-1], model.grid))


@needs_fashion
def test_a_folder_given_where_the_other_kind_is_needed_is_one_line_naming_the_right_one(trained_run, tmp_path):
    """`dit-fd OUT_DIR` (and dit-sample, dit-export) on dit-export's folder said `no checkpoints under OUT_DIR`: it
    names the checkpoint the export was written from. DiT.from_pretrained(RUN) says how to make a model folder."""
    out = tmp_path / "exported"
    assert export_main([str(trained_run), str(out)]) == 0
    source = json.loads((out / "transformer" / "config.json").read_text())["dit_train"]["source"]
    from dit_train import sample
    from dit_train.evaluation.fd import job

    for entry, args in ((job.cli, [out, "--device", "cpu"]), (sample.main, [out]),
                        (export_main, [out, tmp_path / "again"])):
        r = run_entry_in_process(entry, *args)  # the commands' checks, in this process
        command = (entry.__module__, args)
        assert r.returncode == 2 and r.stderr.splitlines() == [
            f"error: {str(out)!r} is a model folder written by dit-export, not a run folder: give the run folder or "
            f"the checkpoint it was exported from: {source}"], (command, r.stderr)
    with pytest.raises(FileNotFoundError, match=rf"'{trained_run}' is a run folder: write its model folder with "
                                                rf"`dit-export {trained_run} OUT_DIR` and load OUT_DIR"):
        DiT.from_pretrained(str(trained_run))


@pytest.mark.parametrize("inside", [".", "out", "checkpoints/out"])
def test_an_out_dir_inside_the_run_folder_is_refused_before_anything_is_written(trained_run, inside):
    """Before: the export was written into the run folder (a checkpoints/out beside step_N.dcp)."""
    before = sorted(str(p) for p in trained_run.rglob("*"))
    out = os.path.normpath(os.path.join(trained_run, inside))
    for source in (trained_run, trained_run / "checkpoints"):
        r = run_entry_in_process(export_main, source, out, prog="dit-export")
        assert r.returncode == 2 and r.stderr.splitlines() == [
            f"error: OUT_DIR={out!r} is not valid: it is inside the run folder being exported ({trained_run}); "
            f"give a folder outside it"], r.stderr
    assert sorted(str(p) for p in trained_run.rglob("*")) == before
