"""Text-conditioned latents train and validate through the same code on any number of ranks: a plain single
process, FSDP2 on a group of one and two gloo ranks give the same train and validation losses, and the
validation loss gives the model the text."""

import pytest
import torch
from safetensors.torch import save_file

from conftest import compose
from test_fsdp_train import assert_close, losses, spawn

TEXT = ["model.text_dim=12", "model.num_classes=0", "model.in_channels=4", "model.image_size=8",
        "model.patch_size=2", "data.channels=4", "data.image_size=8"]


def write_shards(root):
    g = torch.Generator().manual_seed(0)
    for split, n in (("train", 48), ("val", 10)):
        (root / split).mkdir(parents=True, exist_ok=True)
        save_file({"latents": torch.randn(n, 4, 8, 8, generator=g),
                   "text_emb": torch.randn(n, 6, 12, generator=g),
                   "text_mask": torch.ones(n, 6, dtype=torch.bool)}, str(root / split / "s.safetensors"))


def overrides(root, run_dir):
    return ["data=latents", f"data.root={root}", f"run_dir={run_dir}", "train.sample_every=0", *TEXT]  # no VAE


@pytest.fixture(scope="module")
def text_runs(tmp_path_factory):
    from test_fsdp_train import TINY

    from dit_train.trainer.loop import run

    tmp = tmp_path_factory.mktemp("text")
    write_shards(tmp / "latents")
    out = {name: tmp / name for name in ("single", "group_of_one", "two")}
    run(compose(TINY + overrides(tmp / "latents", out["single"])))
    run(compose(TINY + overrides(tmp / "latents", out["group_of_one"]) + ["parallel.fsdp=true"]))
    spawn(2, [overrides(tmp / "latents", out["two"])])
    return out


def test_sharded_equals_single_process_on_text_conditioned_latents(text_runs):
    single = text_runs["single"]
    assert losses(text_runs["group_of_one"]) == losses(single)
    assert losses(text_runs["group_of_one"], "val/loss") == losses(single, "val/loss")
    assert_close(losses(text_runs["two"]), losses(single), rtol=1e-5)
    assert_close(losses(text_runs["two"], "val/loss"), losses(single, "val/loss"), rtol=1e-5)


def test_validation_loss_gives_the_model_the_text():
    """The condition reaches the model as keyword arguments (the single-process path used to pass the dict as
    `y`, and the model then ignored the text)."""
    from dit_train.diffusion.flow import validation_loss, validation_t_grid

    class TextEcho(torch.nn.Module):
        def forward(self, x, t, y=None, context=None, context_mask=None):
            assert y is None and context is not None and context_mask is not None
            return torch.zeros_like(x) + context.mean(dim=(1, 2)).view(-1, 1, 1, 1)

    x = torch.zeros(4, 4, 8, 8)
    mask = torch.ones(4, 6, dtype=torch.bool)
    grid = validation_t_grid(2)
    quiet = validation_loss(TextEcho(), [(x, {"context": torch.zeros(4, 6, 12), "context_mask": mask})], grid)
    loud = validation_loss(TextEcho(), [(x, {"context": torch.full((4, 6, 12), 5.0), "context_mask": mask})], grid)
    assert loud["val/loss"] > quiet["val/loss"]
