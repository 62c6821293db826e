"""Reference-statistics cache, the in-training FDEvaluator end to end with a random-init DINOv2, and the
evaluation jobs (dit-reference-stats, dit-fd) on tiny checkpoints."""

import csv
import importlib
import json
import math
import os
import sys
import warnings

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from conftest import needs_fashion, run_entry_in_process
from dit_train.config import ConfigError
from dit_train.evaluation.fd import reference as refmod
from dit_train.evaluation.fd.job_config import load_data_cfg, load_eval_cfg
from dit_train.evaluation.during_training import update_best_fd
from dit_train.evaluation.fd import job
from dit_train.evaluation.fd.evaluator import FDEvaluator, generation_labels
from dit_train.evaluation.fd.features import build_extractor
from dit_train.evaluation.fd.frechet import RankDeficientWarning
from dit_train.evaluation.fd.reference import load_or_compute_reference, load_reference

# tiny sample counts on purpose (the warning itself is tested in test_fd_frechet.py)
pytestmark = pytest.mark.filterwarnings("ignore::dit_train.evaluation.fd.frechet.RankDeficientWarning")


def toy_images(labels: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """A class-dependent stripe pattern plus noise, 1x32x32 in [-1, 1]."""
    n = labels.shape[0]
    cols = torch.linspace(-1, 1, 32)
    base = torch.stack([torch.sin(cols * (2 + int(c)) * math.pi).expand(32, 32) for c in labels.cpu()])[:, None]
    noise = torch.randn(n, 1, 32, 32, generator=generator, device=generator.device if generator else "cpu")
    return (0.7 * base + 0.2 * noise.cpu()).clamp(-1, 1)


class ToyDataset(torch.utils.data.Dataset):
    def __init__(self, n=96, seed=0, dataset_id="toy:v1"):
        self.labels = torch.arange(n) % 4
        self.x = toy_images(self.labels, torch.Generator().manual_seed(seed))
        self.dataset_id = dataset_id

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return self.x[i], int(self.labels[i])


def eval_cfg(tmp_path, **kw):
    base = dict(every_n_steps=5, num_samples=40, batch_size=16, sample_steps=2, cfg_scale=1.0,
                encoder="dinov2_random", encoder_path=None, reference_split="train", reference_num=64,
                cache_dir=str(tmp_path / "cache"), seed=0)
    return OmegaConf.create({**base, **kw})


@pytest.fixture(scope="module")
def extractor():
    return build_extractor("dinov2_random")


def test_reference_cache_reuses_and_invalidates(tmp_path, extractor, monkeypatch):
    ds = ToyDataset()
    ref = load_or_compute_reference(extractor, ds, "train", 64, tmp_path, batch_size=32, log=lambda *_: None)
    assert ref.count == 64 and ref.path.is_file() and ref.stats.dim == 32 and len(ref.labels) == 64
    on_disk = load_reference(ref.path)
    np.testing.assert_array_equal(on_disk.stats.cov, ref.stats.cov)
    assert (on_disk.encoder_id, on_disk.dataset_id, on_disk.preprocessing) == (
        extractor.encoder_id, "toy:v1", extractor.preprocessing)
    with np.load(ref.path) as z:
        assert {"mean", "cov", "count", "encoder_id", "dataset_id", "preprocessing", "labels"} <= set(z.files)

    calls = []
    real = refmod.compute_reference
    monkeypatch.setattr(refmod, "compute_reference", lambda *a, **k: calls.append(1) or real(*a, **k))
    again = load_or_compute_reference(extractor, ds, "train", 64, tmp_path, log=lambda *_: None)
    assert calls == [] and again.key == ref.key  # a cache hit
    variants = [
        dict(dataset=ToyDataset(dataset_id="toy:v2"), split="train", num=64),  # another dataset
        dict(dataset=ds, split="val", num=64),  # another split
        dict(dataset=ds, split="train", num=48),  # another count
    ]
    keys = {ref.key}
    for v in variants:
        r = load_or_compute_reference(extractor, v["dataset"], v["split"], v["num"], tmp_path, log=lambda *_: None)
        keys.add(r.key)
    assert len(calls) == 3 and len(keys) == 4
    monkeypatch.setattr(extractor, "preprocessing", extractor.preprocessing + ">changed")
    changed = load_or_compute_reference(extractor, ds, "train", 64, tmp_path, log=lambda *_: None)
    assert len(calls) == 4 and changed.key != ref.key
    load_or_compute_reference(extractor, ds, "train", 48, tmp_path, recompute=True, log=lambda *_: None)
    assert len(calls) == 5


@pytest.mark.parametrize("tamper", ["not_psd", "not_symmetric", "short_labels"])
def test_a_cached_reference_with_invalid_statistics_is_recomputed(tmp_path, extractor, monkeypatch, tamper):
    """A cache file whose covariance is no covariance (negative eigenvalue, asymmetric) or whose labels are short was
    used as is: its FD meant nothing (even negative). It is recomputed, the log line saying why."""
    ds = ToyDataset()
    ref = load_or_compute_reference(extractor, ds, "train", 64, tmp_path, log=lambda *_: None)
    with np.load(ref.path) as z:
        members = dict(z)
    cov = members["cov"]
    if tamper == "not_psd":
        members["cov"] = cov - 2 * np.trace(cov) * np.eye(len(cov))
    elif tamper == "not_symmetric":
        members["cov"] = cov + np.triu(np.full_like(cov, np.abs(cov).max()), 1)
    else:
        members["labels"] = members["labels"][:-1]
    np.savez(ref.path, **members)
    calls, lines = [], []
    real = refmod.compute_reference
    monkeypatch.setattr(refmod, "compute_reference", lambda *a, **k: calls.append(1) or real(*a, **k))
    again = load_or_compute_reference(extractor, ds, "train", 64, tmp_path, log=lines.append)
    assert calls == [1] and any("recomputing" in line for line in lines), lines
    np.testing.assert_allclose(again.stats.cov, cov)
    np.testing.assert_allclose(load_reference(ref.path).stats.cov, cov)  # the file is rewritten


def test_generation_labels_keep_the_reference_class_mix():
    ref = np.repeat(np.arange(5), [10, 20, 30, 20, 20])
    lab = generation_labels(ref, 200, seed=0)
    assert lab.dtype == torch.long and len(lab) == 200
    assert np.bincount(lab.numpy()).tolist() == [20, 40, 60, 40, 40]
    assert torch.equal(lab, generation_labels(ref, 200, seed=0))
    assert not torch.equal(generation_labels(ref, 50, seed=0), generation_labels(ref, 50, seed=1))


def test_evaluator_end_to_end_with_random_dinov2(tmp_path, extractor):
    ev = FDEvaluator(eval_cfg(tmp_path), None, "cpu", extractor=extractor, dataset=ToyDataset(),
                     log=lambda *_: None)
    seen = []

    def good(labels, generator):
        seen.append((labels.clone(), generator.initial_seed()))
        return toy_images(labels, generator)

    def bad(labels, generator):
        return torch.rand(labels.shape[0], 1, 32, 32, generator=generator) * 2 - 1

    best = None
    r1 = ev.evaluate(bad, step=5)
    best = update_best_fd(best, r1, 5, 1.0)
    r2 = ev.evaluate(good, step=10)
    best = update_best_fd(best, r2, 10, 2.0)
    r3 = ev.evaluate(bad, step=15)
    best = update_best_fd(best, r3, 15, 3.0)
    assert r2["fd"] < 0.5 * r1["fd"] and r3["fd"] == pytest.approx(r1["fd"], rel=1e-9)  # fixed noise and labels
    for r in (r1, r2):
        assert r["fd_encoder"] == extractor.encoder_id and r["fd_num_gen"] == 40 and r["fd_num_ref"] == 64
        assert r["fd_ref_id"].startswith("toy:v1:train:n64:") and r["fd_time_s"] >= 0
    assert r2["images"].shape == (16, 1, 32, 32) and r2["images"].abs().max() <= 1
    assert best == {"fd": r2["fd"], "step": 10, "active_time_s": 2.0, "encoder": extractor.encoder_id,
                    "ref_id": r2["fd_ref_id"], "num_gen": 40}
    # batches of 16, 16, 8 with fixed labels and per-batch seeds
    assert [len(lab) for lab, _ in seen] == [16, 16, 8] and len({s for _, s in seen}) == 3

    # a best FD is compared only with values measured the same way (here: another sample count)
    ev3 = FDEvaluator(eval_cfg(tmp_path, num_samples=32), None, "cpu", extractor=extractor, dataset=ToyDataset(),
                      log=lambda *_: None)
    r_other = ev3.evaluate(bad, step=12)
    assert r_other["fd"] > r2["fd"] and update_best_fd(best, r_other, 12, 2.5)["step"] == 12

    # a diverged model: non-finite FD, best unchanged
    r4 = ev.evaluate(lambda lab, g: torch.full((lab.shape[0], 1, 32, 32), float("nan")), 20)
    assert math.isnan(r4["fd"]) and update_best_fd(best, r4, 20, 4.0)["step"] == 10


@needs_fashion
def test_evaluator_builds_encoder_and_dataset_from_configs(tmp_path):
    cfg = load_eval_cfg("ci", [f"cache_dir={tmp_path}", "reference_split=val", "num_samples=20", "reference_num=40"])
    data_cfg = load_data_cfg("fashion_mnist")
    ev = FDEvaluator(cfg, data_cfg, "cpu", log=lambda *_: None)
    assert ev.reference.dataset_id == "fashion_mnist:val:32px" and ev.reference.count == 40
    res = ev.evaluate(lambda lab, g: torch.rand(lab.shape[0], 1, 32, 32, generator=g) * 2 - 1, 10)
    assert math.isfinite(res["fd"]) and res["fd_num_gen"] == 20


def _fake_run(run_dir, steps, hidden=16, legacy=False, **saved):
    """Checkpoints in the trainer's format (dit_train.runs.checkpoint: EMA tensors, step, active_time_s, config), or
    the read-only single files of earlier versions; `saved`: more of the run's config (optimizer, seed)."""
    from dit_train.runs import checkpoint as ckpt
    from dit_train.model.dit import build_model

    mcfg = dict(name="t", image_size=32, in_channels=1, patch_size=8, hidden_size=hidden, depth=1, num_heads=2,
                num_classes=10)
    cfg = {"model": mcfg, "data": OmegaConf.to_container(load_data_cfg("fashion_mnist")), **saved}
    (run_dir / "checkpoints").mkdir(parents=True)
    for s in steps:
        torch.manual_seed(s)
        model = build_model(OmegaConf.create(mcfg))
        for p in model.parameters():  # leave adaLN-Zero's zero init so samples differ per checkpoint
            p.data.normal_(0, 0.05)
        state = {"config": cfg, "step": s, "active_time_s": 1.5 * s}
        if legacy:
            torch.save({**state, "ema": {"model": model.state_dict()}}, run_dir / "checkpoints" / f"step_{s:08d}.pt")
        else:
            ckpt.save(str(run_dir), s, {"ema": model.state_dict()}, state, keep_last=0)


@needs_fashion
def test_fd_dino_job_scores_a_sweep_and_skips_scored_checkpoints(tmp_path, capsys):
    sweep = tmp_path / "sweep"
    _fake_run(sweep / "0", [3, 6])
    _fake_run(sweep / "1", [6], legacy=True)
    from dit_train.evaluation.fd import job

    args = ["--eval-preset", "ci", "--cache-dir", str(tmp_path / "cache"), "--reference-split", "val",
            "--num-samples", "16", "--batch-size", "8", "--reference-num", "32", "--sample-steps", "2"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rows = job.main([str(sweep)] + args)
    # 16 samples < 32 features: said once, as an [fd] line (it also came as a Python warning per checkpoint)
    assert not [w for w in caught if issubclass(w.category, RankDeficientWarning)]
    assert [(r["run"], r["step"]) for r in rows] == [("0", 3), ("0", 6), ("1", 6)]
    assert all(math.isfinite(r["fd"]) and r["num_gen"] == 16 and r["num_ref"] == 32 for r in rows)
    assert rows[1]["active_time_s"] == 9.0 and rows[0]["fd"] != rows[1]["fd"]
    assert (sweep / "fd_results.csv").read_text().splitlines()[0].startswith("label,run,step,active_time_s,fd,")
    assert len(json.loads((sweep / "fd_results.json").read_text())["rows"]) == 3
    assert (sweep / "fd_grids" / "0" / "step_00000003.png").is_file()
    said = capsys.readouterr().out  # labelled [fd] whatever the encoder (was [fd_dino], for Inception too)
    assert "[fd] t (folder 0) step 3: FD=" in said and "[fd] best t (folder 0): FD=" in said, said
    assert "[fd_dino]" not in said, said
    assert said.count("[fd] --num-samples=16 < feature dim 32") == 1, said  # the flag typed, not eval.num_samples
    assert said.count("[fd] --reference-num=32 = feature dim 32") == 1, said  # rank 31 of 32: singular too

    again = job.main([str(sweep)] + args)  # nothing new to score
    assert "skip t (folder 1) step_00000006.pt" in capsys.readouterr().out
    assert [r["fd"] for r in again] == [r["fd"] for r in rows]
    more = job.main([str(sweep / "0" / "checkpoints" / "step_00000003.dcp"), "--out", str(sweep)] + args
                    + ["--seed", "1"])  # another seed is another setting: scored, kept beside the first
    assert len(more) == 4
    # --data-set reaches the data config through job_config.dotlist: a folder YAML would read as another is refused
    with pytest.raises(ConfigError, match=r"^--data-set root=/data/run #2: YAML reads root='/data/run'"):
        job.main([str(sweep), "--force", "--data-set", "root=/data/run #2"] + args)


@needs_fashion
def test_fd_of_a_local_dinov2_folder_is_labelled_by_what_it_holds(tmp_path, capsys):
    """`dit-fd RUN --eval-preset dinov2 --encoder-path FOLDER` with a folder that is not ViT-L/14: every line and the
    results say the network loaded (it said dinov2_vitl14, the preset's encoder)."""
    from dit_train.evaluation.fd import job
    from dit_train.evaluation.fd.features import random_dinov2

    random_dinov2().save_pretrained(tmp_path / "dino")  # hidden 32, 2 layers, patch 14
    _fake_run(tmp_path / "run", [3])
    capsys.readouterr()
    job.main([str(tmp_path / "run"), "--eval-preset", "dinov2", "--encoder-path", str(tmp_path / "dino"),
              "--cache-dir", str(tmp_path / "cache"), "--reference-split", "val", "--num-samples", "8",
              "--batch-size", "8", "--reference-num", "16", "--sample-steps", "1", "--no-progress"])
    said, bars = capsys.readouterr()
    assert "(dinov2_h32_l2_p14, n_gen=8" in said and "vitl14" not in said, said
    assert "Loading weights" not in bars, bars  # transformers' bar over the folder's 43 tensors, at every load
    row = json.loads((tmp_path / "run" / "fd_results.json").read_text())["rows"][0]
    assert row["encoder"].startswith("dinov2_h32_l2_p14["), row
    assert ["_dinov2_h32_l2_p14_" in p.name for p in (tmp_path / "cache").glob("*.npz")] == [True]


@needs_fashion
def test_reference_stats_job(tmp_path):
    from dit_train.evaluation.fd import reference_stats as job

    args = ["--data", "fashion_mnist", "--encoder", "dinov2_random", "--reference-split", "val",
            "--reference-num", "24", "--batch-size", "12", "--cache-dir", str(tmp_path)]
    out = job.main(args)
    assert out["count"] == 24 and out["dataset_id"] == "fashion_mnist:val:32px" and os.path.isfile(out["path"])
    assert sum(out["class_counts"].values()) == 24
    assert job.main(args)["path"] == out["path"]


def test_reference_stats_of_an_image_folder_are_those_its_runs_compare_with(tmp_path, capsys):
    """`dit-reference-stats --data image_folder --data-set root=DIR` of 16 px images read them at the preset's 64
    px: a cache file no run uses (a run takes the size from the folder, config/data_shapes.py), found following
    docs/fd_evaluation.md with a folder of one's own. A size given with --data-set is kept."""
    from PIL import Image

    from conftest import compose
    from dit_train.config.data_shapes import apply_data_shapes
    from dit_train.data.datasets import build_dataset
    from dit_train.evaluation.fd import reference_stats as job

    for c in ("a", "b"):
        os.makedirs(tmp_path / "img" / c)
        for i in range(4):
            Image.new("RGB", (16, 16), (60 * i, 100 if c == "a" else 200, 0)).save(tmp_path / "img" / c / f"{i}.png")
    root = str(tmp_path / "img")
    run = apply_data_shapes(compose(["data=image_folder", f"data.root={root}", f"run_dir={tmp_path / 'run'}"]),
                            ["data=image_folder", f"data.root={root}"])
    args = ["--data", "image_folder", "--encoder", "dinov2_random", "--reference-num", "4", "--batch-size", "4",
            "--cache-dir", str(tmp_path / "cache"), "--data-set", f"root={root}"]
    out = job.main(args)
    assert out["dataset_id"] == build_dataset(run.data, "train").dataset_id and out["dataset_id"].endswith(":16px")
    assert f"[fd] from the data: data.num_classes=2 ({root}: 2 class folders, labels 0=a 1=b), data.image_size=16 " \
           f"({root}: 16x16 images)" in capsys.readouterr().out
    assert job.main([*args, "image_size=24"])["dataset_id"].endswith(":24px")


def test_reference_stats_of_latents_are_of_the_images_they_were_made_from(tmp_path, capsys):
    """`dit-reference-stats --data latents --data-set root=LATENTS`, to cache a latent run's FD reference, fed the
    4-channel latents to the encoder ('FD needs an image dataset'); it now reads the images latents_info.json
    records, the dataset a latent run's FD compares with (reference_data_config), at the size they were encoded."""
    from test_encode_latents import image_folder, save_tiny_vae

    from dit_train.data.encode import main as encode
    from dit_train.evaluation.fd import reference_stats as job

    save_tiny_vae(tmp_path / "vae")
    image_folder(tmp_path / "img")  # 20x18 images: encoded at --image-size 16
    encode(["--vae", str(tmp_path / "vae"), "--images", str(tmp_path / "img"), "--out", str(tmp_path / "lat"),
            "--image-size", "16"])
    capsys.readouterr()
    out = job.main(["--data", "latents", "--data-set", f"root={tmp_path / 'lat'}", "--encoder", "dinov2_random",
                    "--reference-num", "4", "--batch-size", "4", "--cache-dir", str(tmp_path / "cache")])
    assert out["dataset_id"] == f"image_folder:{tmp_path / 'img'}:5:16px", out  # 6 images, 1 held out as val
    assert f"[fd] from the data: the images the latents were made from ({tmp_path / 'lat'}/latents_info.json: " \
           f"image_folder {tmp_path / 'img'} at 16 px)" in capsys.readouterr().out
    with pytest.raises(ValueError, match=r"^--data-set root=.*/img is not valid: the reference of latents is the images"):
        job.main(["--data", "latents", "--data-set", f"root={tmp_path / 'img'}", "--encoder", "dinov2_random"])
    with pytest.raises(ValueError, match=r"^--data latents needs --data-set root=DIR: the reference of latents"):
        job.main(["--data", "latents", "--encoder", "dinov2_random"])


@pytest.mark.parametrize("name,args", [("job", ["some_run"]), ("reference_stats", [])])
def test_eval_jobs_wait_for_peers_as_long_as_training(name, args, monkeypatch):
    """Their process group gets parallel.timeout_minutes (training's default, or --timeout-minutes)."""
    from conftest import compose
    from dit_train.evaluation.fd.job_config import training_timeout_minutes

    assert training_timeout_minutes() == compose().parallel.timeout_minutes
    job = importlib.import_module(f"dit_train.evaluation.fd.{name}")
    seen = []

    def record(**kwargs):
        seen.append(kwargs["timeout_minutes"])
        raise KeyboardInterrupt  # stop before any work

    monkeypatch.setattr(job, "init_distributed", record)
    for extra, expected in (([], training_timeout_minutes()), (["--timeout-minutes", "90"], 90.0)):
        with pytest.raises(KeyboardInterrupt):
            job.main(args + extra)
        assert seen.pop() == expected


@pytest.mark.parametrize("case", ["no checkpoints", "torn results"])
def test_fd_dino_command_errors_are_one_line(tmp_path, case):
    """`dit-fd FOLDER` on a folder without checkpoints, or with an fd_results.json cut short by a
    crash: one line naming the folder / file, exit 2 (both were tracebacks), before any encoder is loaded."""

    run_dir = tmp_path / "run"
    if case == "no checkpoints":
        run_dir.mkdir()
        expected = f"error: no checkpoints (checkpoints/step_*.dcp) under {str(run_dir)!r}"
    else:
        _fake_run(run_dir, [3])
        (run_dir / "fd_results.json").write_text('{"columns": ["run"], "rows": [{"run": "r')
        expected = (f"error: {run_dir / 'fd_results.json'} is not valid JSON (Unterminated string starting at: "
                    f"line 1 column 39): the file is damaged (cut short by a crash or edited); delete it (and "
                    f"fd_results.csv) to score every checkpoint again")
    r = run_entry_in_process(job.cli, str(run_dir), "--device", "cpu", prog="dit-fd")
    assert r.returncode == 2 and r.stderr.splitlines() == [expected], r.stderr


@pytest.mark.parametrize("attack", ["wrong shapes", "non-finite", "zip bomb"])
def test_a_crafted_cached_reference_is_recomputed_not_used(tmp_path, extractor, monkeypatch, attack):
    """A cache file from elsewhere (a shared cache_dir) under the right name and key, holding statistics of another
    shape, NaNs, or a covariance member that decompresses to 128 MB: it was used as it was (an FD of wrong
    numbers, or an error mid-run), the bomb read whole. Each is reported and recomputed; the bomb is not read."""
    import tracemalloc

    ds = ToyDataset()
    ref = load_or_compute_reference(extractor, ds, "train", 64, tmp_path, batch_size=32, log=lambda *_: None)
    with np.load(ref.path) as z:
        fields = {k: z[k] for k in z.files}
    d = {"wrong shapes": 8, "non-finite": 32, "zip bomb": 4000}[attack]
    fields.update(mean=np.zeros(d), cov=np.full((d, d), np.nan if attack == "non-finite" else 0.0))
    with open(ref.path, "wb") as f:
        np.savez_compressed(f, **fields)
    calls, said = [], []
    real = refmod.compute_reference
    monkeypatch.setattr(refmod, "compute_reference", lambda *a, **k: calls.append(1) or real(*a, **k))
    tracemalloc.start()
    try:
        again = load_or_compute_reference(extractor, ds, "train", 64, tmp_path, batch_size=32, log=said.append)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert calls == [1] and again.stats.dim == 32 and np.isfinite(again.stats.cov).all()
    assert any("could not read cached reference" in line for line in said), said
    assert peak < 64 * 10**6  # bytes: the 128 MB member was never decompressed


@pytest.mark.parametrize("name", ["fd_results.json", "fd_results.csv"])
def test_fd_results_are_never_written_through_a_link_planted_at_their_temp_name(tmp_path, name):
    """A run folder from elsewhere with `fd_results.json.tmp-<pid> -> ~/.bashrc` (links for every likely pid cost
    nothing in a tarball): dit-fd wrote its results through the link, overwriting the user's file. The temp name is
    removed first and created exclusively; the link's target is untouched."""
    from dit_train.evaluation.fd.job import write_results

    victim = tmp_path / "bashrc"
    victim.write_text("export PATH=/usr/bin\n")
    os.symlink(victim, tmp_path / f"{name}.tmp-{os.getpid()}")
    write_results(tmp_path, [{"run": "r", "step": 1, "encoder": "inception", "fd": 1.0}])
    assert victim.read_text() == "export PATH=/usr/bin\n"
    assert "inception" in (tmp_path / name).read_text()


@pytest.mark.parametrize("plant", ["fd_grids", "fd_grids/run", "fd_grids/run/step_00000002.png", "fifo"])
def test_fd_grids_under_a_received_folder_with_a_link_or_fifo_are_refused_before_any_work(tmp_path, monkeypatch,
                                                                                         capsys, plant):
    """A run folder from elsewhere (dit-fd writes into it by default) with `fd_grids/<run> -> ~` (or `fd_grids`, or
    the grid's own name, linked): the grid went into the link's target, replacing a file of that name, after the
    checkpoint was sampled; a FIFO at its name was a traceback after the work. Refused in one line naming the link,
    exit 2, before the encoder or a checkpoint loads; the link's target untouched."""
    from dit_train.evaluation.fd import job

    run = tmp_path / "run"
    _fake_run(run, [2])
    victim = tmp_path / "home"
    victim.mkdir()
    (victim / "step_00000002.png").write_bytes(b"the user's file")
    (run / "fd_grids" / "run").mkdir(parents=True)
    if plant == "fifo":
        os.mkfifo(run / "fd_grids" / "run" / "step_00000002.png")
    else:
        os.rmdir(run / "fd_grids" / "run")
        if plant == "fd_grids":
            os.rmdir(run / "fd_grids")
            os.symlink(victim, run / "fd_grids")
            (victim / "run").mkdir()
            (victim / "run" / "step_00000002.png").write_bytes(b"the user's file")
        elif plant == "fd_grids/run":
            os.symlink(victim, run / "fd_grids" / "run")
        else:
            (run / "fd_grids" / "run").mkdir()
            os.symlink(victim / "step_00000002.png", run / plant)
    from dit_train.evaluation.fd import features

    monkeypatch.setattr(features, "build_extractor", lambda *a, **k: pytest.fail("the encoder loaded"))
    monkeypatch.setattr(sys, "argv", ["dit-fd", str(run), "--eval-preset", "ci", "--no-progress"])
    assert job.cli() == 2
    err = capsys.readouterr().err
    what = "is not a regular file" if plant == "fifo" else f"{run / plant} is a symbolic link"
    assert err.count("\n") == 1 and what in err and "dit-fd's sample grid" in err, err
    assert {p.read_bytes() for p in victim.rglob("*.png")} == {b"the user's file"}
    assert not (run / "fd_results.json").exists()


@needs_fashion
def test_the_runs_of_a_sweep_are_named_by_what_they_are(tmp_path, capsys):
    """`dit-fd multirun/<date>/<time>` named its runs by their folders, Hydra's job numbers (`0`, `1`) or override
    strings that leave out every default: each is labelled from its saved config (model, optimizer with K and
    RowNorm scale, lr, seed) in the lines and the results, its folder kept beside the label."""
    from dit_train.evaluation.fd import job

    sweep = tmp_path / "sweep"
    _fake_run(sweep / "0", [2], optimizer={"name": "muon", "lr": 0.002}, seed=1)
    _fake_run(sweep / "1", [2], optimizer={"name": "periodic_rowwise", "K": 3, "rownorm_scale": "spectral",
                                           "lr": 0.003}, seed=0)
    job.main([str(sweep), "--eval-preset", "ci", "--cache-dir", str(tmp_path / "cache"), "--reference-split", "val",
              "--num-samples", "8", "--batch-size", "8", "--reference-num", "16", "--sample-steps", "1",
              "--no-grid", "--no-progress"])
    said = capsys.readouterr().out
    assert "[fd] t muon lr=0.002 seed=1 (folder 0) step 2: FD=" in said, said
    assert "[fd] --num-samples=8 < feature dim 32" in said and "[fd] --reference-num=16 < feature dim 32" in said
    assert "[fd] best t periodic_rowwise K=3 (spectral) lr=0.003 seed=0 (folder 1): FD=" in said, said
    with open(sweep / "fd_results.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["label"], r["run"]) for r in rows] == [("t muon lr=0.002 seed=1", "0"),
                                                     ("t periodic_rowwise K=3 (spectral) lr=0.003 seed=0", "1")]


@pytest.mark.parametrize("flags,expected", [
    (["--num-samples", "0"], "error: --num-samples=0 is not valid: "),
    (["--encoder", "dinov3"], "error: --encoder='dinov3' is not valid: choose one of "),
    (["--eval-preset", "dinov2", "--encoder-path", "{tmp}/none"], "error: DINOv2 weights for dinov2_vitl14 not "
                                                                  "found (--encoder-path='{tmp}/none') "),
])
def test_dit_fd_names_the_flags_the_user_typed(tmp_path, flags, expected):
    """`dit-fd RUN --num-samples 0` said `eval.num_samples=0 is not valid` (a training key the user never typed),
    after loading the encoder and the checkpoint; now the flag, before either."""
    _fake_run(tmp_path / "run", [3])
    flags = [f.format(tmp=tmp_path) for f in flags]
    r = run_entry_in_process(job.cli, str(tmp_path / "run"), "--device", "cpu", "--cache-dir", str(tmp_path / "cache"),
                             *flags, prog="dit-fd")
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1, r.stderr
    assert r.stderr.startswith(expected.format(tmp=tmp_path)) and "eval." not in r.stderr, r.stderr


def test_dit_fd_help_shows_paths_a_user_has(monkeypatch):
    """Its examples named runs/2025-01-01/12-00-00, a folder no run has (runs are runs/<date>/<time>-<suffix>),
    and no dit-study sweep (sweeps/<study>)."""
    monkeypatch.setenv("COLUMNS", "120")
    r = run_entry_in_process(job.cli, "--help", prog="dit-fd")
    assert r.returncode == 0
    assert "dit-fd runs/<date>/<time>-<suffix>/checkpoints/step_00001000.dcp" in r.stdout
    assert "dit-fd runs/<date>/<time>-<suffix> " in r.stdout and "dit-fd sweeps/<study> " in r.stdout
    assert "2025-01-01" not in r.stdout and "multirun/..." not in r.stdout
