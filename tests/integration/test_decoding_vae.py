"""The VAE a latent run is decoded with (dit-sample, dit-export, dit-fd --vae) is the one that made its latents even
once the latents folder has moved: the run's checkpoints record it (TrainState.latents_vae, what latents_info.json
says of the VAE). A wrong one is one line before any weights are read or anything is written; a checkpoint from
before the record: one warning line. A folder that is not an AutoencoderKL is named for what it is. Two tiny
random-init diffusers VAEs, the first with a non-zero shift_factor, as in the new-user trial that found these."""

import json
import logging
import os
import re
import shutil

import pytest

from conftest import compose, needs_fashion, run_entry_in_process
from dit_train.data import encode
from test_latents_e2e import LATENT

pytestmark = needs_fashion

SHORT = ["train.steps=2", "train.batch_size=8", "train.warmup_steps=1", "train.log_every=1", "train.val_every=0",
         "train.sample_every=0", "train.ckpt_every=2", "train.progress=false", "eval.every_n_steps=0",
         "optimizer=adamw"]


def tiny_vae(folder, seed: int, **factors):
    import torch
    from diffusers import AutoencoderKL

    torch.manual_seed(seed)
    vae = AutoencoderKL(in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8, 8, 16),
                        down_block_types=("DownEncoderBlock2D",) * 3, up_block_types=("UpDecoderBlock2D",) * 3,
                        layers_per_block=1, norm_num_groups=4, sample_size=32, **factors)
    vae.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def moved(tmp_path_factory):
    """A latent run trained on latents of `vae` (shift 0.25), whose latents folder was then moved away."""
    from dit_train.trainer.loop import run

    root = tmp_path_factory.mktemp("vaecheck")
    vae = tiny_vae(root / "vae", 0, scaling_factor=0.5, shift_factor=0.25)
    other = tiny_vae(root / "other", 1, scaling_factor=0.5, shift_factor=0.25)  # same factors, other weights
    shifted = tiny_vae(root / "shifted", 0, scaling_factor=0.5, shift_factor=-1.0)  # same weights, other shift
    r = run_entry_in_process(encode.cli, "--vae", vae, "--data", "fashion_mnist", "--out", root / "lat",
                             "--limit", "16", "--shard-size", "16", "--batch-size", "16", prog="dit-encode-latents")
    assert r.returncode == 0, r.stderr
    run(compose(["data=latents", f"data.root={root / 'lat'}", f"vae.path={vae}", f"run_dir={root / 'run'}",
                 *LATENT, *SHORT]))
    os.rename(root / "lat", root / "lat_moved")  # the run keeps data.root pointing where nothing is now
    return {"root": root, "run": root / "run", "vae": vae, "other": other, "shifted": shifted}


def test_the_checkpoint_records_the_vae_of_its_latents(moved):
    from dit_train.runs.checkpoint import read_saved_state, resolve_checkpoint

    info = json.loads((moved["root"] / "lat_moved" / "latents_info.json").read_text())
    recorded = read_saved_state(resolve_checkpoint(str(moved["run"])))["latents_vae"]
    assert recorded == {k: info[k] for k in ("vae", "vae_files", "scaling_factor", "shift_factor")}
    assert recorded["shift_factor"] == 0.25


@pytest.mark.parametrize("wrong,why", [("other", "diffusion_pytorch_model.safetensors is not the one"),
                                       ("shifted", r"scaling/shift factors \(0.5, -1.0\) differ")])
def test_sample_refuses_a_wrong_vae_after_the_latents_moved(moved, tmp_path, monkeypatch, wrong, why):
    """Before: rc 0, PNGs decoded by the other VAE, no word. The weights are never read (load_for_inference)."""
    from dit_train import sample as sample_module

    monkeypatch.setattr(sample_module, "load_for_inference", lambda *a, **k: pytest.fail("weights read first"))
    r = run_entry_in_process(sample_module.main, moved["run"], "--vae", moved[wrong], "--device", "cpu",
                             "--out-dir", tmp_path / "x", prog="dit-sample")
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1, r.stderr
    assert r.stderr.startswith(f"error: --vae={moved[wrong]!r} is not valid: ")
    assert re.search(why, r.stderr) and "checkpoint" in r.stderr, r.stderr  # named where the record is
    assert not (tmp_path / "x").exists()


def test_sample_decodes_with_the_right_vae_after_the_latents_moved(moved, tmp_path, caplog):
    from dit_train.sample import main as sample_main

    with caplog.at_level(logging.WARNING):
        assert sample_main([str(moved["run"]), "--vae", moved["vae"], "--device", "cpu", "--classes", "0",
                            "--per-class", "1", "--steps", "1", "--out-dir", str(tmp_path / "x")]) == 0
    assert os.listdir(tmp_path / "x") and not [r for r in caplog.records if "cannot be checked" in r.message]


def test_export_refuses_a_wrong_vae_after_the_latents_moved(moved, tmp_path):
    """Before: rc 0, and the exported vae/config.json held the other VAE's factors."""
    from dit_train.export import main as export_main

    r = run_entry_in_process(export_main, moved["run"], tmp_path / "out", "--vae", moved["shifted"],
                             prog="dit-export")
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1, r.stderr
    assert f"--vae={moved['shifted']!r} is not valid: its scaling/shift factors (0.5, -1.0) differ" in r.stderr
    assert not (tmp_path / "out").exists()
    assert export_main([str(moved["run"]), str(tmp_path / "ok"), "--vae", moved["vae"]]) == 0
    assert json.loads((tmp_path / "ok" / "vae" / "config.json").read_text())["shift_factor"] == 0.25


def fd(args, monkeypatch):
    """dit-fd in this process with the encoder's build refused: whatever it says came before any encoder work."""
    from dit_train.evaluation.fd import features, job

    def no_encoder(*a, **k):
        raise ValueError("encoder built")  # the command prints it as its one line

    monkeypatch.setattr(features, "build_extractor", no_encoder)
    return run_entry_in_process(job.cli, *args, "--eval-preset", "ci", "--encoder", "dinov2_random", prog="dit-fd")


def test_fd_refuses_a_wrong_vae_first_even_when_every_checkpoint_is_scored(moved, tmp_path, monkeypatch):
    """Before: checked only after the encoder and reference statistics (minutes with Inception on a CPU), and not
    at all when every checkpoint was already scored (rc 0)."""
    from dit_train.evaluation.fd import job
    from dit_train.runs.checkpoint import resolve_checkpoint

    r = fd([moved["run"], "--vae", moved["other"], "--out", tmp_path], monkeypatch)
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1 and "encoder built" not in r.stderr, r.stderr
    assert f"--vae={moved['other']!r} is not valid: its diffusion_pytorch_model.safetensors is not the one" in r.stderr
    # every checkpoint already scored with these settings: still refused (before, skipped and rc 0)
    settings = {"encoder": "x", "num_gen": 1, "sample_steps": 1, "cfg_scale": 1.0, "seed": 0, "reference": "val:1"}
    ckpt = resolve_checkpoint(str(moved["run"]))
    job.write_results(tmp_path, [{"label": "", "run": "run", "step": 2, "active_time_s": 0.0, "fd": 1.0, "num_ref": 1,
                                  "ref_id": "", "checkpoint": ckpt, "eval_time_s": 0, "scored_at": "", **settings}])
    r = fd([moved["run"], "--vae", moved["other"], "--out", tmp_path], monkeypatch)
    assert r.returncode == 2 and "is not valid" in r.stderr and "encoder built" not in r.stderr, r.stderr


def test_fd_accepts_a_runs_checkpoints_folder_as_sample_and_export_do(moved, tmp_path, monkeypatch):
    """Before: `no checkpoints (checkpoints/step_*.dcp) under 'RUN/checkpoints'`. Past the listing and the VAE check
    it reaches the encoder (refused here)."""
    from dit_train.evaluation.fd.job import find_checkpoints

    root, found = find_checkpoints(moved["run"] / "checkpoints")
    assert root == moved["run"] and [(run, c.name) for run, c in found] == [("run", "step_00000002.dcp")]
    r = fd([moved["run"] / "checkpoints", "--vae", moved["vae"], "--out", tmp_path], monkeypatch)
    assert "encoder built" in r.stderr, r.stderr


@pytest.mark.parametrize("launcher_env, said", [({}, 1), ({"RANK": "1"}, 0)])  # others: test_launch_rank
def test_a_checkpoint_written_before_the_record_warns_in_one_line_on_the_first_rank(moved, tmp_path, caplog,
                                                                                    monkeypatch, launcher_env, said):
    """Every rank of a torchrun'd dit-fd checks the same checkpoints: the warning is said by the first rank only."""
    from dit_train.export import main as export_main
    from dit_train.runs.checkpoint import TRAIN_STATE

    old = tmp_path / "old"
    shutil.copytree(moved["run"] / "checkpoints", old / "checkpoints")
    state_file = old / "checkpoints" / "step_00000002.dcp" / TRAIN_STATE
    state = json.loads(state_file.read_text())
    del state["latents_vae"]  # as a checkpoint of an earlier version holds it
    state_file.write_text(json.dumps(state))
    for name in ("RANK", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)
    for name, value in launcher_env.items():
        monkeypatch.setenv(name, value)
    with caplog.at_level(logging.WARNING):
        assert export_main([str(old), str(tmp_path / "out"), "--vae", moved["other"]]) == 0
    lines = [r.getMessage() for r in caplog.records if "cannot be checked" in r.getMessage()]
    assert len(lines) == said and all("\n" not in line and moved["other"] in line for line in lines), lines


@pytest.fixture
def not_vaes(moved, tmp_path):
    """A transformers DINOv2 folder, a DiT transformer/ folder and a pipeline root (dit-export's)."""
    from dit_train.export import main as export_main

    dino = tmp_path / "dinov2"
    dino.mkdir()
    (dino / "config.json").write_text(json.dumps({"architectures": ["Dinov2Model"], "model_type": "dinov2",
                                                  "hidden_size": 8}))
    (dino / "model.safetensors").write_bytes(b"")
    assert export_main([str(moved["run"]), str(tmp_path / "pipe"), "--vae", moved["vae"]]) == 0
    return {"dinov2": (str(dino), "its config.json describes a transformers Dinov2Model model, not a diffusers "
                                  "AutoencoderKL"),
            "transformer": (str(tmp_path / "pipe" / "transformer"), "its config.json describes a "
                            "DiTTrainTransformer2DModel (_class_name), not a diffusers AutoencoderKL"),
            "pipeline": (str(tmp_path / "pipe"), f"it is a diffusers pipeline folder, not its VAE: pass "
                                                 f"{tmp_path / 'pipe' / 'vae'}")}


@pytest.mark.parametrize("kind", ["dinov2", "transformer", "pipeline"])
def test_a_folder_that_is_not_a_vae_is_named_for_what_it_is(moved, not_vaes, tmp_path, kind):
    """Before: "scaling/shift factors (1.0, 0.0) differ" (DINOv2 as vae.path), "save with safe_serialization"
    (DINOv2 as --vae of dit-encode-latents), "block_out_channels=[64], but the weights hold 0 blocks" (a DiT
    transformer/), "is not a diffusers AutoencoderKL folder" with no hint (a pipeline root)."""
    from dit_train.config import ConfigError
    from dit_train.config.latents import check_latent_run
    from dit_train.diffusion.vae import load_autoencoder
    from dit_train.sample import main as sample_main

    folder, says = not_vaes[kind]
    r = run_entry_in_process(encode.cli, "--vae", folder, "--data", "fashion_mnist", "--out", tmp_path / "lat",
                             "--limit", "4", prog="dit-encode-latents")
    assert r.returncode == 2 and r.stderr.splitlines() == [f"error: --vae={folder!r} is not valid: {says}"], r.stderr
    assert not (tmp_path / "lat").exists()
    r = run_entry_in_process(sample_main, moved["run"], "--vae", folder, "--device", "cpu", "--out-dir",
                             tmp_path / "x", prog="dit-sample")
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1 and says in r.stderr, r.stderr
    with pytest.raises(ConfigError, match="vae.path=.* is not valid: " + says[:20]):
        check_latent_run({"name": "dit_s", "image_size": 8}, {"root": str(moved["root"] / "lat_moved")},
                         {"path": folder}, needs_decoding=True)
    with pytest.raises(ValueError, match="AutoencoderKL|pipeline"):
        load_autoencoder(folder, "cpu")


def test_the_export_records_the_vae_of_the_latents(moved, tmp_path):
    """Before: the export's provenance did not say which VAE made the latents, so DiTTrainPipeline could not hold
    a VAE passed to it to that one."""
    from dit_train.export import main as export_main

    assert export_main([str(moved["run"]), str(tmp_path / "out"), "--vae", moved["vae"]]) == 0
    info = json.loads((moved["root"] / "lat_moved" / "latents_info.json").read_text())
    record = json.loads((tmp_path / "out" / "transformer" / "config.json").read_text())["dit_train"]["latents_vae"]
    assert {k: record[k] for k in ("vae", "scaling_factor", "shift_factor")} == \
        {k: info[k] for k in ("vae", "scaling_factor", "shift_factor")}
    assert len(record["weights_sha1"]) == 40


def test_fd_refuses_a_vae_for_an_image_run(tmp_path, monkeypatch):
    """Before: `dit-fd IMAGE_RUN --vae X` ignored X silently."""
    from dit_train.trainer.loop import run

    run(compose([f"run_dir={tmp_path / 'run'}", "model.hidden_size=32", "model.depth=1", "model.num_heads=2",
                 "model.patch_size=8", *SHORT]))
    r = fd([tmp_path / "run", "--vae", tmp_path / "vae", "--out", tmp_path / "fd"], monkeypatch)
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1 and "encoder built" not in r.stderr, r.stderr
    assert f"--vae={str(tmp_path / 'vae')!r} is not valid for checkpoint " in r.stderr
    assert "its run trained on images (data=fashion_mnist); only a latent run" in r.stderr


def test_a_vae_of_other_latent_channels_than_the_latents_is_refused_before_the_run(moved, tmp_path):
    """Latents made elsewhere (no latents_info.json to hold the VAE to) with a VAE of 8 latent channels given for
    4-channel latents: the first sample grid's decode failed on a shape, after training steps were paid for."""
    import json
    import shutil

    from dit_train.config import ConfigError
    from dit_train.config.latents import check_latent_run

    lat = tmp_path / "lat"
    shutil.copytree(moved["root"] / "lat_moved", lat)
    (lat / "latents_info.json").unlink()
    wide = tmp_path / "wide"
    shutil.copytree(moved["vae"], wide)
    config = json.loads((wide / "config.json").read_text())
    (wide / "config.json").write_text(json.dumps({**config, "latent_channels": 8}))
    check_latent_run({}, {"root": str(lat), "channels": 4}, {"path": moved["vae"]}, needs_decoding=True)
    with pytest.raises(ConfigError, match=rf"^vae.path='{re.escape(str(wide))}' is not valid: its latent_channels=8 "
                                          rf"differs from the 4 channels of the latents in {re.escape(str(lat))} "
                                          rf"\(data.channels\): pass the VAE that made them$"):
        check_latent_run({}, {"root": str(lat), "channels": 4}, {"path": str(wide)}, needs_decoding=True)
