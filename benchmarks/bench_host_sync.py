#!/usr/bin/env python
"""What host reads cost a training step: Trainer.train_step on one device, three ways, side by side in one run.

- `flags`: the step as it is, with its one host read (Trainer.step_flags: the finite check and the stop vote);
- `no_read`: the same step with step_flags answering "finite, no stop" without reading the device: the most that
  removing the last read could gain (it would need the on-device skip docs/algorithms.md §7 argues against);
- `per_step_reads`: the step followed by what the loop did on every step before: reading the loss and the gradient
  norm and a full synchronisation for the step timer.
The variants run in interleaved rounds of --steps steps (timed with one synchronisation per round, so the timing
adds no stall of its own); the table gives median seconds per step and the ratios, with their target lines.
On CPU every read is free (the work is done when the call returns): run it on a GPU.

    python -m benchmarks.bench_host_sync --model dit_s --batch-size 64 --optimizer muon
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch


from dit_train.config.files import CONF_DIR
from dit_train.config.override_text import override
from dit_train.parallel.fsdp import DistInfo
from dit_train.trainer.loop import Trainer


def compose(overrides: list[str]):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return hydra_compose(config_name="config", overrides=overrides)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="dit_s")
    ap.add_argument("--optimizer", default="muon")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--steps", type=int, default=20, help="steps per round and variant")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)

    with tempfile.TemporaryDirectory() as run_dir:
        cfg = compose([override("run_dir", run_dir), "data=synthetic", f"model={args.model}",  # TMPDIR: any path
                       f"optimizer={args.optimizer}",
                       f"train.batch_size={args.batch_size}", "train.progress=false", "eval.every_n_steps=0",
                       "model.num_classes=1000", "model.in_channels=4",
                       "train.precision=bf16" if device.type == "cuda" else "train.precision=fp32"])
        trainer = Trainer(cfg, DistInfo(device=device))
        x, y = next(iter(torch.utils.data.DataLoader(trainer.train_set, batch_size=args.batch_size)))
        x, cond = x.to(device), {"y": y.to(device)}
        read_flags = trainer.step_flags

        def flags():
            trainer.step_flags = read_flags
            trainer.train_step(x, cond)

        def no_read():
            trainer.step_flags = lambda finite, votes, scaled: (True, 0.0, True)
            trainer.train_step(x, cond)

        def per_step_reads():
            trainer.step_flags = read_flags
            out = trainer.train_step(x, cond)
            out["train/loss"].item(), out["train/grad_norm"].item()
            trainer.timer.collect()
            if device.type == "cuda":
                torch.cuda.synchronize()

        variants = {"flags": flags, "no_read": no_read, "per_step_reads": per_step_reads}
        wait = trainer.timer.clock.wait
        for step in variants.values():  # warm-up: allocator, kernels, optimizer state
            for _ in range(3):
                step()
        wait()
        times = {name: [] for name in variants}
        for _ in range(args.rounds):
            for name, step in variants.items():
                t0 = time.perf_counter()
                for _ in range(args.steps):
                    step()
                trainer.timer.take()
                wait()
                times[name].append((time.perf_counter() - t0) / args.steps)

    med = {name: statistics.median(v) for name, v in times.items()}
    print(f"device {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}), "
          f"model {args.model}, optimizer {args.optimizer}, batch {args.batch_size}, "
          f"{args.rounds} rounds x {args.steps} steps")
    for name, s in med.items():
        print(f"  {name:15s} {s * 1e3:9.3f} ms/step")
    flag_cost = med["flags"] / med["no_read"] - 1
    gain = med["per_step_reads"] / med["flags"] - 1
    print(f"- cost of the step-flags read (flags / no_read - 1): {flag_cost:+.2%}, target <= 1%: "
          f"{'met' if flag_cost <= 0.01 else 'MISSED'}")
    print(f"- what the old per-step reads cost on top (per_step_reads / flags - 1): {gain:+.2%} (>= 0 expected)")


if __name__ == "__main__":
    main()
