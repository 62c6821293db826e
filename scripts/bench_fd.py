"""Feature-extraction throughput (images/s) of each FD encoder on this machine, preprocessing included.

    python scripts/bench_fd.py                       # all encoders, batch 32, 32x32 grayscale inputs, CPU
    python scripts/bench_fd.py --encoders inception --batch-size 64 --device cuda

DINOv2 ViT-B/14 and ViT-L/14 are timed with random-init weights of the real architecture (same FLOPs as the
pretrained ones) when no weights are on the machine; the table says which. Also times the FD itself
(eigendecompositions, float64) at each feature dimension.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from dit_train.evaluation.fd.features import (DinoV2Extractor, MissingWeightsError, build_extractor,  # noqa: E402
                                   random_dinov2)
from dit_train.evaluation.fd.frechet import frechet_distance  # noqa: E402

ARCH = {  # Dinov2Config overrides for the real architectures (hub names)
    "dinov2_vitb14": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072),
    "dinov2_vitl14": dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096),
}


def get_extractor(name: str, device: str):
    try:
        ex = build_extractor(name, None, device)
        return ex, ("random-init (tests only)" if name == "dinov2_random" else "pretrained")
    except MissingWeightsError:
        if name not in ARCH:
            raise
        net = random_dinov2(**ARCH[name])
        ex = DinoV2Extractor(net, kind="hf", name=name, encoder_id=f"{name}[random-init]",
                             feature_dim=ARCH[name]["hidden_size"], device=device)
        return ex, "random-init (no weights here; same FLOPs)"


def bench(ex, batch: int, n_batches: int, size: int, channels: int, device: str) -> float:
    x = torch.rand(batch, channels, size, size, device=device) * 2 - 1
    ex(x)  # warm-up
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n_batches):
        ex(x)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return batch * n_batches / (time.perf_counter() - t)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--encoders", nargs="+", default=["dinov2_random", "inception", "dinov2_vitb14", "dinov2_vitl14"])
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--batches", type=int, default=2)
    ap.add_argument("--image-size", type=int, default=32)
    ap.add_argument("--channels", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()

    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, device {args.device}, "
          f"input {args.batch_size}x{args.channels}x{args.image_size}x{args.image_size}, "
          f"load average at start {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print("| encoder | weights | input | feature dim | images/s | FD of two stats at this dim (s) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name in args.encoders:
        ex, weights = get_extractor(name, args.device)
        ips = bench(ex, args.batch_size, args.batches, args.image_size, args.channels, args.device)
        d = ex.feature_dim
        a = np.cov(np.random.default_rng(0).normal(size=(d + 10, d)), rowvar=False)
        t = time.perf_counter()
        frechet_distance(np.zeros(d), a, np.zeros(d), a)
        fd_s = time.perf_counter() - t
        print(f"| {name} | {weights} | {ex.input_size}x{ex.input_size} | {d} | {ips:.2f} | {fd_s:.2f} |", flush=True)
    print(f"load average at end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
