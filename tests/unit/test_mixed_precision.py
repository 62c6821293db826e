"""Under FSDP2 with bf16 compute weights, float conditioning reaches the model in fp32: the timestep embedder sees
the exact t (a bf16 cast rounds 0.9987 to 1.0) and computes what the single process computes under autocast."""

import torch
import torch.distributed as dist

from dit_train.model.dit import DiT, DiTConfig
from dit_train.parallel.fsdp import ParallelPlan, autocast, parallelize, shutdown_process_group


def capture_timestep_path(model):
    seen = {}
    model.t_embedder.register_forward_hook(lambda mod, args, out: seen.update(t=args[0].detach().clone(),
                                                                              emb=out.detach().float().clone()))
    return seen


def test_sharded_bf16_forward_keeps_t_in_fp32_and_embeds_it_as_the_single_process():
    cfg = DiTConfig(image_size=8, in_channels=4, patch_size=2, hidden_size=32, depth=2, num_heads=2, num_classes=10)
    torch.manual_seed(0)
    single = DiT(cfg)
    sharded = DiT(cfg)
    sharded.load_state_dict(single.state_dict())
    x, y = torch.randn(3, 4, 8, 8), torch.tensor([1, 2, 3])
    t = torch.tensor([0.9987, 0.5004, 0.0021])
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        parallelize(sharded, ParallelPlan(sharded=True, param_dtype=torch.bfloat16))
        got = capture_timestep_path(sharded)
        with torch.no_grad():
            out = sharded(x, t, y=y)
    finally:
        shutdown_process_group()
    want = capture_timestep_path(single)
    with torch.no_grad(), autocast("bf16", "cpu"):
        ref = single(x, t, y=y)
    assert got["t"].dtype == torch.float32 and torch.equal(got["t"], t)
    torch.testing.assert_close(got["emb"], want["emb"], rtol=0, atol=0)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all()
    torch.testing.assert_close(out.float(), ref.float(), rtol=0.05, atol=0.05)
