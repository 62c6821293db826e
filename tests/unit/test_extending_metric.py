"""A metric added from outside the package, as docs/extending.md shows it: one class with its Config, registered;
nothing else is edited. It runs in a tiny training run and reaches metrics.jsonl, summary.json, the checkpoint, the
validator, --help, the resume policy and the study report."""

import json
import os
from dataclasses import dataclass

import pytest
import torch

from conftest import compose, needs_fashion
from dit_train.config import ConfigError, validate
from dit_train.config.fields import int_at_least
from dit_train.evaluation.metric import Metric, MetricConfig, register_metric, unregister_metric


# ---- the example of docs/extending.md: everything a new metric needs -------------------------------------------
@dataclass
class MeanPixelConfig(MetricConfig):
    num_images: int = int_at_least(1, default=4, doc="images sampled per measurement")
    sample_steps: int = int_at_least(1, default=2, doc="Euler steps of the sampler")


class MeanPixel(Metric):
    """|mean pixel| of a few EMA samples of class 0 (fixed noise): a toy, lower is better."""
    name = "mean_pixel"
    Config = MeanPixelConfig
    better = "lower"

    def measure(self, context):
        sample = context.sampler(self.cfg["sample_steps"], 1.0)
        labels = torch.zeros(self.cfg["num_images"], dtype=torch.long)
        images = sample(labels, torch.Generator(context.device).manual_seed(0)).float()
        return {"value": images.mean().abs().item(), "std": images.std().item()}
# -----------------------------------------------------------------------------------------------------------------


@pytest.fixture
def mean_pixel():
    register_metric(MeanPixel)
    yield MeanPixel
    unregister_metric(MeanPixel)


def tiny(tmp_path, *extra):
    return compose([f"run_dir={tmp_path / 'run'}", "experiment=debug", "model.hidden_size=32", "model.depth=1",
                    "model.num_heads=1", "model.patch_size=8", "train.steps=6", "train.batch_size=8",
                    "train.log_every=2", "train.val_every=3", "train.val_samples=16", "train.val_batch_size=8",
                    "train.sample_every=0", "train.ckpt_every=3", "train.progress=false", *extra])


@needs_fashion
def test_a_registered_metric_runs_in_training_and_reaches_metrics_summary_checkpoint_and_report(
        mean_pixel, tmp_path, one_intra_op_thread):
    from dit_train.runs import checkpoint as ckpt
    from dit_train.trainer.loop import run

    cfg = tiny(tmp_path, "eval.mean_pixel.every_n_steps=3")
    summary = run(cfg)
    rows = [json.loads(line) for line in open(os.path.join(cfg.run_dir, "metrics.jsonl"))]
    measured = [r for r in rows if "mean_pixel/value" in r]
    assert [r["step"] for r in measured] == [3, 6] and all(r["mean_pixel/std"] > 0 for r in measured)
    values = {r["step"]: r["mean_pixel/value"] for r in measured}
    best_step = min(values, key=values.get)
    written = json.load(open(os.path.join(cfg.run_dir, "summary.json")))
    assert written["metrics"]["mean_pixel"] == summary["metrics"]["mean_pixel"] == {
        "last": {"value": values[6], "std": measured[-1]["mean_pixel/std"], "step": 6},
        "best": {"value": values[best_step], "step": best_step}}
    state = ckpt.read_train_state(ckpt.list_checkpoints(cfg.run_dir)[-1])
    assert state["metric_best"]["mean_pixel"]["value"] == values[best_step]

    from dit_train.study.report import build_report

    text = build_report(os.path.dirname(cfg.run_dir), str(tmp_path / "report"))
    assert "## Other metrics" in text and "mean_pixel" in text and f"{values[best_step]:.4g}" in text


def test_its_keys_are_checked_documented_and_judged_on_resume_like_every_key(mean_pixel):
    from dit_train.config.help_text import key_docs
    from dit_train.runs.resume_policy import config_changes
    from omegaconf import OmegaConf

    cfg = compose(["run_dir=/tmp/unused"])
    assert OmegaConf.to_container(cfg.eval.mean_pixel) == {"every_n_steps": 0, "num_images": 4, "sample_steps": 2}
    validate(cfg)
    with pytest.raises(ConfigError, match=r"^eval.mean_pixel.num_images=0 is not valid: expected an integer >= 1$"):
        validate(compose(["run_dir=/tmp/unused", "eval.mean_pixel.num_images=0"]))
    with pytest.raises(ConfigError, match=r"^eval.mean_pixel.sample_steps='yes' is not valid"):
        validate(compose(["run_dir=/tmp/unused", "eval.mean_pixel.sample_steps=yes"]))
    docs = key_docs(cfg)
    assert docs["eval.mean_pixel.num_images"] == "images sampled per measurement"
    assert docs["eval.mean_pixel.every_n_steps"].startswith("measure every N training steps")
    saved = OmegaConf.to_container(cfg, resolve=False)
    cadence = json.loads(json.dumps(saved))
    cadence["eval"]["mean_pixel"]["every_n_steps"] = 5
    assert config_changes(saved, cadence) == []  # MetricConfig.every_n_steps: resume=True
    steps = json.loads(json.dumps(saved))
    steps["eval"]["mean_pixel"]["sample_steps"] = 9
    assert config_changes(saved, steps) == [("eval.mean_pixel.sample_steps", 2, 9)]


def test_unregistered_the_config_is_as_before(mean_pixel):
    unregister_metric(mean_pixel)
    try:
        assert "mean_pixel" not in compose(["run_dir=/tmp/unused"]).eval
    finally:
        register_metric(mean_pixel)


def test_a_metric_name_must_be_new():
    class Clash(Metric):
        name = "fd"

    with pytest.raises(ValueError, match="metric name 'fd'"):
        register_metric(Clash)
