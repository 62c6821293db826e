"""dit-sample: EMA samples of a run as a grid and/or a folder of PNGs through the one sampler
(the run's own last grid, pixel for pixel, with its settings); latent runs are decoded by their VAE
(tests/integration/test_latents_e2e.py); and our Euler steps equal diffusers' FlowMatchEulerDiscreteScheduler bit
for bit."""

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from PIL import Image

from conftest import compose, needs_fashion
from dit_train.diffusion.flow import euler_sample
from dit_train.model.dit import DiT, DiTConfig
from dit_train.sample import latent_codec, main as sample_main
from dit_train.trainer.loop import run


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("sample") / "run"
    run(compose([f"run_dir={folder}", "model.hidden_size=32", "model.depth=2", "model.num_heads=2",
                 "model.patch_size=8", "train.steps=3", "train.batch_size=8", "train.val_every=0",
                 "train.sample_every=3", "train.samples_per_class=2", "train.sample_steps=3", "seed=5",
                 "train.progress=false", "train.ema_decay=0.5"]))
    return folder


def pixels(path):
    return np.asarray(Image.open(path))


@needs_fashion
def test_default_sample_is_the_runs_last_grid(trained_run, tmp_path, capsys):
    """No flags: the run's grid (its classes, train.samples_per_class=2, steps, guidance and seed)."""
    assert sample_main([str(trained_run), "--grid", str(tmp_path / "grid.png")]) == 0
    out = capsys.readouterr().out
    assert "20 samples" in out and "seed 5" in out and "3 Euler steps" in out, out
    assert np.array_equal(pixels(tmp_path / "grid.png"), pixels(trained_run / "samples" / "step_00000003.png"))
    assert sample_main([str(trained_run), "--per-class", "2", "--seed", "6", "--grid", str(tmp_path / "g6.png")]) == 0
    assert not np.array_equal(pixels(tmp_path / "g6.png"), pixels(tmp_path / "grid.png"))


@needs_fashion
def test_folder_of_pngs_for_chosen_classes(trained_run, tmp_path, capsys):
    out = tmp_path / "pngs"
    assert sample_main([str(trained_run), "--classes", "1", "4", "--per-class", "3", "--steps", "2",
                        "--cfg-scale", "1", "--out-dir", str(out), "--batch-size", "4"]) == 0
    names = sorted(p.name for p in out.iterdir())
    assert names == [f"class{c:03d}_{i:04d}.png" for c in (1, 4) for i in range(3)]
    assert pixels(out / names[0]).shape == (32, 32)
    assert not (tmp_path / "samples.png").exists()  # --out-dir alone writes no grid
    assert "6 samples" in capsys.readouterr().out


@needs_fashion
@pytest.mark.parametrize("args, message", [
    (["--classes", "10"], "--classes 10 is not valid: this model has classes 0..9"),
    # each flag alone: was `--steps=0 / --cfg-scale=2.5 is not valid`, naming a scale that was not typed
    (["--steps", "0"], "error: --steps=0 is not valid: expected an integer >= 1\n"),
    (["--cfg-scale", "nan"], "error: --cfg-scale=nan is not valid: expected a finite scale >= 0\n"),
    (["--cfg-scale", "inf"], "error: --cfg-scale=inf is not valid: expected a finite scale >= 0\n"),
])
def test_bad_arguments_are_one_line(trained_run, tmp_path, capsys, args, message):
    assert sample_main([str(trained_run), "--grid", str(tmp_path / "g.png"), *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err


@needs_fashion
def test_a_sweep_folder_is_refused_naming_its_runs(trained_run, tmp_path, capsys):
    """A --multirun sweep folder (multirun/<date>/<time>/ with 0/, 1/) given as the run: was `no checkpoints
    (checkpoints/step_*.dcp) under 'SWEEP'`, true but silent on what to give. Now the line names the run folders it
    holds and one to give; nothing is written; that one samples."""
    import shutil

    sweep = tmp_path / "sweep"
    for job in ("0", "1"):
        shutil.copytree(trained_run, sweep / job)
    (sweep / "multirun.yaml").write_text("hydra: {}\n")
    assert sample_main([str(sweep), "--grid", str(tmp_path / "g.png")]) == 2
    err = capsys.readouterr().err
    assert err == (f"error: no checkpoints (checkpoints/step_*.dcp) under {str(sweep)!r}: it holds run folders "
                   f"(0, 1); give one of them, e.g. {str(sweep / '0')!r}\n"), err
    assert not (tmp_path / "g.png").exists()
    assert sample_main([str(sweep / "0"), "--grid", str(tmp_path / "g.png")]) == 0


@needs_fashion
@pytest.mark.parametrize("key, value, message", [
    ("samples_per_class", 10**12, "train.samples_per_class=1000000000000 is not valid (expected an integer in "
                                  "1..1024 (one grid row per class)); pass --per-class and --batch-size"),
    ("sample_steps", 10**12, "train.sample_steps=1000000000000 is not valid (expected an integer in 1..1000000); "
                             "pass --steps"),
    ("cfg_scale", "2.5", "train.cfg_scale='2.5' is not valid"),
    ("precision", "fp8", "train.precision='fp8' is not valid (choose auto"),
])
def test_a_saved_config_asking_for_absurd_sampling_is_one_line_before_the_weights_load(
        trained_run, tmp_path, capsys, monkeypatch, key, value, message):
    """A run folder from elsewhere whose checkpoint's saved config asks for 10^12 images per class (or 10^12
    Euler steps, a scale that is a string, a precision that does not exist): `dit-sample RUN` drew 10^12 noise
    images (a traceback or an out-of-memory), ran for ever, or was a traceback. The run's own settings are checked
    against their schema from the train state, before the weights are read: one line naming the value, what is
    valid and the flag that chooses it, exit 2, nothing written."""
    import json
    import shutil

    from dit_train import sample

    copy = tmp_path / "copy"
    shutil.copytree(trained_run, copy)
    for state_file in copy.glob("checkpoints/*.dcp/train_state.json"):
        state = json.loads(state_file.read_text())
        state["config"]["train"][key] = value
        state_file.write_text(json.dumps(state))
    monkeypatch.setattr(sample, "load_for_inference", lambda *a, **k: pytest.fail("the weights were read"))
    assert sample_main([str(copy), "--grid", str(tmp_path / "g.png")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "g.png").exists()


def test_a_latent_run_without_a_vae_says_what_to_pass():
    with pytest.raises(ValueError, match="trained on latents .* pass --vae"):
        latent_codec(OmegaConf.create({"data": {"name": "latents"}, "model": {"name": "dit_1b3"},
                                         "vae": {"path": None}}), None, "cpu")
    assert latent_codec(OmegaConf.create({"data": {"name": "fashion_mnist"}, "model": {"name": "dit_s"}}),
                          None, "cpu") is None


@pytest.mark.parametrize("cfg_scale", [1.0, 2.5])
def test_euler_sampler_equals_diffusers_flow_match_euler_scheduler(cfg_scale):
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(0)
    model = DiT(DiTConfig(image_size=8, in_channels=1, patch_size=2, hidden_size=32, depth=1, num_heads=2,
                          num_classes=10)).eval()
    with torch.no_grad():
        for p in model.parameters():  # non-zero everywhere (adaLN-Zero starts as the identity)
            p.normal_(0, 0.2)
    steps, noise, y = 7, torch.randn(3, 1, 8, 8), torch.tensor([0, 4, 9])
    scheduler = diffusers.FlowMatchEulerDiscreteScheduler(shift=1.0)
    scheduler.set_timesteps(sigmas=torch.linspace(1, 0, steps + 1)[:-1].numpy(), device="cpu")
    x, drop = noise, torch.tensor([False] * 3 + [True] * 3)
    with torch.no_grad():
        for i, timestep in enumerate(scheduler.timesteps):
            t = scheduler.sigmas[i].expand(3)  # our t is the scheduler's sigma (1 = noise), not its 0..1000 timestep
            if cfg_scale == 1.0:
                v = model(x, t, y=y)
            else:
                v_c, v_u = model(torch.cat([x, x]), torch.cat([t, t]), y=torch.cat([y, y]), drop_mask=drop).chunk(2)
                v = v_u + cfg_scale * (v_c - v_u)
            x = scheduler.step(v, timestep, x).prev_sample
        ours = euler_sample(model, noise, y=y, steps=steps, cfg_scale=cfg_scale)
    assert torch.equal(ours, x)


@pytest.mark.parametrize("vae,what", [("/nonexistent", "does not exist"), ("empty", "has no config.json")])
def test_a_vae_that_is_not_a_local_folder_is_one_line_and_never_a_hub_download(tmp_path, monkeypatch, vae, what):
    """`dit-sample RUN --vae /nonexistent` on a latent run: before, diffusers took the path for a
    Hub repo id (51 lines, a network attempt). The command runs in this process with every name lookup and socket
    connection refused and recorded: any attempt fails the test (checked: huggingface_hub's download is recorded)."""
    import os
    import socket

    from conftest import run_entry_in_process
    from dit_train.runs import checkpoint as ckpt
    from dit_train.model.dit import build_model
    from dit_train.sample import main as sample_main

    mcfg = dict(name="t", image_size=8, in_channels=4, patch_size=2, hidden_size=16, depth=1, num_heads=2,
                num_classes=10)
    config = {"model": mcfg, "data": {"name": "latents"}, "vae": {"path": None}, "seed": 0,
              "train": {"sample_steps": 2, "cfg_scale": 1.0, "precision": "fp32"}}
    ckpt.save(str(tmp_path / "run"), 1, {"ema": build_model(OmegaConf.create(mcfg)).state_dict()},
              {"step": 1, "config": config}, keep_last=0)
    if vae == "empty":
        vae = str(tmp_path / "empty")
        os.makedirs(vae)
    attempts = []

    def no_network(self, address, *a, **kw):
        attempts.append(address)
        raise ConnectionRefusedError(f"no network in this test: {address}")

    def no_name_lookup(host, *a, **kw):  # before any connection: where DNS fails, connect is never reached
        attempts.append(host)
        raise socket.gaierror(f"no network in this test: {host}")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setattr(socket.socket, "connect_ex", no_network)
    monkeypatch.setattr(socket, "getaddrinfo", no_name_lookup)
    monkeypatch.setenv("HF_HUB_ETAG_TIMEOUT", "1")
    r = run_entry_in_process(sample_main, str(tmp_path / "run"), "--vae", vae, "--device", "cpu", "--grid",
                             str(tmp_path / "grid.png"), prog="dit-sample")
    assert attempts == []
    assert r.returncode == 2 and r.stderr.splitlines() == [
        f"error: VAE folder {vae!r} {what}: expected a local diffusers AutoencoderKL folder (config.json and its "
        f"weights), the one given to dit-encode-latents --vae"], r.stderr
    assert not (tmp_path / "grid.png").exists()


@needs_fashion
def test_a_run_folder_name_with_control_characters_prints_as_escapes(trained_run, tmp_path, capsys):
    """A run from elsewhere named "run\\x1b[2J\\n..." cleared the terminal and printed a line of its own."""
    import shutil

    copy = tmp_path / "run\x1b[2J\r\nerror: fake"
    shutil.copytree(trained_run, copy)
    assert sample_main([str(copy), "--classes", "0", "--per-class", "1", "--steps", "1",
                        "--grid", str(tmp_path / "g.png")]) == 0
    out = capsys.readouterr().out
    assert len(out.splitlines()) == 1 and "\x1b" not in out and "run\\x1b[2J\\r\\nerror: fake/checkpoints" in out, out


@needs_fashion
def test_a_vae_for_an_image_run_is_one_line_before_the_weights_are_read(trained_run, tmp_path, monkeypatch, capsys):
    """Before: `dit-sample IMAGE_RUN --vae X` ignored X silently (the user believed it decoded the images)."""
    from dit_train import sample

    monkeypatch.setattr(sample, "load_for_inference", lambda *a, **k: pytest.fail("the weights were read"))
    assert sample_main([str(trained_run), "--vae", str(tmp_path / "vae"), "--grid", str(tmp_path / "g.png")]) == 2
    err = capsys.readouterr().err
    assert err.splitlines() == [f"error: --vae={str(tmp_path / 'vae')!r} is not valid here: this run trained on "
                                f"images (data=fashion_mnist); only a latent run (data=latents) is decoded by a VAE"]
    assert not (tmp_path / "g.png").exists()
