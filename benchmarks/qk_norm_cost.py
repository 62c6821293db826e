"""Where qk_norm's time goes on the CPU: the model's forward and forward+backward at dit_m (depth 6, fp32) without
qk-norm, with it as it was (F.rms_norm on the permuted [B, H, N, hd] q/k views) and as the model runs it now
(normalised on [B, N, H, hd] views, before the permute: the same values bit for bit, tests/unit/test_qk_norm.py), eager
and, with --compile, under torch.compile. Variants are
interleaved, repeat by repeat; the time is the process's CPU time (time.process_time: on a loaded machine wall time
measures the neighbours, CPU time the work) and the minimum over repeats is printed, with the cost of qk-norm
relative to the model without it. docs/qk_norm.md holds the numbers.

    python -m benchmarks.qk_norm_cost [--repeats 3] [--batch 32] [--threads 1] [--compile]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F

import dit_train.model.dit as dit_model
from dit_train.model.dit import build_model, load_preset

VARIANTS = ("off", "permuted views (old)", "before the permute")


def permuted_views(m, x):
    """SelfAttention.forward as it was: qk-norm on the permuted views."""
    B, N, D = x.shape
    q, k, v = m.qkv(x).view(B, N, 3, m.num_heads, D // m.num_heads).permute(2, 0, 3, 1, 4)
    out = F.scaled_dot_product_attention(m.q_norm(q), m.k_norm(k), v)
    return m.proj(out.transpose(1, 2).reshape(B, N, D))


def build(variant: str, compiled: bool):
    cfg = load_preset("dit_m", depth=6)
    cfg.qk_norm = variant != "off"
    torch.manual_seed(0)
    model = build_model(cfg)
    if variant == "permuted views (old)":
        for m in model.modules():
            if isinstance(m, dit_model.SelfAttention):
                m.forward = lambda x, m=m: permuted_views(m, x)
    return torch.compile(model) if compiled else model


def timed(model, x, t, y, backward: bool) -> float:
    start = time.process_time()
    if backward:
        model(x, t, y=y).square().mean().backward()
    else:
        with torch.no_grad():
            model(x, t, y=y)
    return time.process_time() - start


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--compile", action="store_true", help="also under torch.compile (needs a C++ toolchain)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    x, t = torch.randn(args.batch, 1, 32, 32), torch.rand(args.batch)
    y = torch.randint(0, 10, (args.batch,))
    modes = [False, True] if args.compile else [False]
    models = {(v, c): build(v, c) for c in modes for v in VARIANTS}
    for (v, c), m in models.items():  # warm-up (and compilation) out of the timing
        timed(m, x, t, y, True), timed(m, x, t, y, False)
    best = {(key, bw): float("inf") for key in models for bw in (False, True)}
    for _ in range(args.repeats):
        for key, m in models.items():
            for bw in (False, True):
                m.zero_grad(set_to_none=True)
                best[key, bw] = min(best[key, bw], timed(m, x, t, y, bw))
    print(f"dit_m depth 6, batch {args.batch}, fp32, {torch.get_num_threads()} threads; CPU time, min of "
          f"{args.repeats} interleaved repeats; load {os.getloadavg()[0]:.2f}")
    print("| mode | qk-norm | forward CPU ms | forward+backward CPU ms | fwd+bwd vs qk-norm off |")
    print("| --- | --- | ---: | ---: | ---: |")
    for (v, c) in models:
        off = best[("off", c), True]
        print(f"| {'compiled' if c else 'eager'} | {v} | {best[(v, c), False] * 1e3:.0f} "
              f"| {best[(v, c), True] * 1e3:.0f} | {best[(v, c), True] / off - 1:+.1%} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
