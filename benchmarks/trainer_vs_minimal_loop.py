"""Images/s of the trainer (`python -m dit_train`) against a minimal training loop on the same model, side by side in
one run: interleaved pairs (trainer, minimal, trainer, minimal, ...), each a fresh process, so load that changes
over the run hits both. The trainer's overhead is the ratio (issue 31 item 6; docs/qk_norm.md holds the numbers).

    python -m benchmarks.trainer_vs_minimal_loop [--pairs 2] [--steps 12] [--window 4] \\
        [--qk-norm true|false] [--minimal-qk-norm true|false]

Both: dit_m with depth 6, batch 128, AdamW (fused, lr 2e-3), fp32 on the CPU, torch's default threads.
  trainer  every feature on except validation, grids and mid-run checkpoints (train.val_every=0,
           train.sample_every=0, train.ckpt_every=0): Fashion-MNIST, EMA, gradient clipping, the LR schedule,
           metrics.jsonl. Its rate: the mean imgs_per_s of its log windows after the first (warm-up) one.
  minimal  the same DiT class on one in-memory batch, t ~ U(0, 1), the velocity loss, AdamW; no EMA, no clipping,
           no logging. Its rate: the images of the steps after the first window over their wall time.
--minimal-qk-norm false times the minimal loop without qk-norm (the issue's "minimal model").
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from dit_train.config.override_text import override

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = ["model=dit_m", "model.depth=6"]
BATCH, LR = 128, 2e-3


def trainer_rate(steps: int, window: int, qk_norm: bool) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "dit_train", *MODEL, f"model.qk_norm={str(qk_norm).lower()}", "optimizer=adamw",
               f"optimizer.lr={LR}", f"train.batch_size={BATCH}", f"train.steps={steps}", f"train.log_every={window}",
               "train.val_every=0", "train.sample_every=0", "train.ckpt_every=0", "train.progress=false",
               override("run_dir", f"{tmp}/run")]  # a TMPDIR with `,` or a space is one value
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        if proc.returncode != 0:
            sys.exit(f"error: the trainer failed: {proc.stderr.strip()[-2000:]}")
        with open(os.path.join(tmp, "run", "metrics.jsonl")) as f:
            rows = [json.loads(line) for line in f]
        rates = [r["imgs_per_s"] for r in rows if "imgs_per_s" in r]
        return statistics.mean(rates[1:])


def minimal_rate(steps: int, window: int, qk_norm: bool) -> float:
    import torch
    import torch.nn.functional as F

    from dit_train.model.dit import build_model, load_preset

    cfg = load_preset("dit_m", depth=6)
    cfg.qk_norm = qk_norm
    torch.manual_seed(0)
    model = build_model(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, fused=True)
    x = torch.rand(BATCH, cfg.in_channels, cfg.image_size, cfg.image_size) * 2 - 1
    y = torch.randint(0, cfg.num_classes, (BATCH,))
    start = None
    for step in range(steps):
        if step == window:
            start = time.perf_counter()
        t, eps = torch.rand(BATCH), torch.randn_like(x)
        xt = (1 - t[:, None, None, None]) * x + t[:, None, None, None] * eps
        loss = F.mse_loss(model(xt, t, y=y), eps - x)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return (steps - window) * BATCH / (time.perf_counter() - start)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pairs", type=int, default=2)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--window", type=int, default=4, help="steps per timing window; the first is warm-up")
    p.add_argument("--qk-norm", choices=("true", "false"), default="true", help="the trainer's model.qk_norm")
    p.add_argument("--minimal-qk-norm", choices=("true", "false"), default=None, help="default: as --qk-norm")
    p.add_argument("--minimal", action="store_true", help=argparse.SUPPRESS)  # one minimal run, rate on stdout
    args = p.parse_args(argv)
    if args.steps < 2 * args.window or args.window < 1:
        p.error(f"--steps {args.steps} must be at least two windows of --window {args.window} (the first is warm-up)")
    minimal_qk = (args.minimal_qk_norm or args.qk_norm) == "true"
    if args.minimal:
        print(minimal_rate(args.steps, args.window, minimal_qk))
        return 0
    print(f"load before: {os.getloadavg()[0]:.2f}", flush=True)
    ratios = []
    for i in range(args.pairs):
        trainer = trainer_rate(args.steps, args.window, args.qk_norm == "true")
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--minimal", "--steps", str(args.steps),
                               "--window", str(args.window), "--minimal-qk-norm", str(minimal_qk).lower()],
                              cwd=ROOT, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ROOT})
        if proc.returncode != 0:
            sys.exit(f"error: the minimal loop failed: {proc.stderr.strip()[-2000:]}")
        minimal = float(proc.stdout.strip().splitlines()[-1])
        ratios.append(trainer / minimal)
        print(f"pair {i + 1}: trainer {trainer:.1f} imgs/s (qk_norm {args.qk_norm}), minimal {minimal:.1f} imgs/s "
              f"(qk_norm {str(minimal_qk).lower()}): {trainer / minimal:.3f}x  (load {os.getloadavg()[0]:.2f})",
              flush=True)
    print(f"trainer / minimal: {' '.join(f'{r:.3f}' for r in ratios)}; median {statistics.median(ratios):.3f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
