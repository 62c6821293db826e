#!/usr/bin/env python
"""Behaviour fingerprint of this checkout, for refactors that must change nothing: run it before and after, and the
two outputs are equal line for line exactly when every number below is bit-identical.

    python -m benchmarks.fingerprint > before.txt   # ... refactor ...   python -m benchmarks.fingerprint > after.txt

Lines (a sha256 of the numbers' exact float text, and the values that matter to a reader):
  demo        the CPU demo (`python -m dit_train`) cut to 40 steps: every loss, grad norm, lr, validation loss and
              the sample grid's pixels
  debug       `experiment=debug`: the same
  rowwise_2r  two gloo ranks under dit_train.torchrun, periodic_rowwise K=3 on experiment=debug: the same
  report/<s>  each published study's report.md, rebuilt from its committed records (dit-report, or
              dit-paired-report for a two-phase study)
Timings, throughput and wall-clock fields are left out: they are not behaviour.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile

from dit_train.config.override_text import override, shell_command

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KEPT = ("train/loss", "train/grad_norm", "train/skipped", "lr", "val/")


def numbers(run_dir: str) -> tuple[str, str]:
    """(sha256 of every kept metric in order + the grids' bytes, the last train and validation loss)."""
    digest, last = hashlib.sha256(), {}
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for line in f:
            row = json.loads(line)
            kept = {k: v for k, v in row.items() if k == "step" or k.startswith(KEPT)}
            digest.update(json.dumps(kept, sort_keys=True).encode())
            last.update({k: v for k, v in kept.items() if k in ("train/loss", "val/loss")})
    samples = os.path.join(run_dir, "samples")
    for name in sorted(os.listdir(samples)) if os.path.isdir(samples) else []:
        with open(os.path.join(samples, name), "rb") as f:
            digest.update(f.read())
    return digest.hexdigest()[:16], " ".join(f"{k}={v!r}" for k, v in sorted(last.items()))


def run(cmd: list[str], label: str) -> None:
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"error: {label} failed ({r.returncode}): {r.stderr.strip().splitlines()[-1:]}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--skip-runs", action="store_true", help="only the reports")
    args = p.parse_args(argv)
    py = sys.executable
    with tempfile.TemporaryDirectory() as tmp:
        if not args.skip_runs:
            trainings = {
                "demo": [py, "-m", "dit_train", "train.steps=40", "train.val_every=20", "train.sample_every=40",
                         "train.sample_steps=10", "train.ckpt_every=40"],
                "debug": [py, "-m", "dit_train", "experiment=debug"],
                "rowwise_2r": [py, "-m", "dit_train.torchrun", "--standalone", "--nproc_per_node", "2", "-m",
                               "dit_train", "experiment=debug", "optimizer=periodic_rowwise", "optimizer.K=3"],
            }
            for label, cmd in trainings.items():
                run_dir = os.path.join(tmp, label)
                run([*cmd, override("run_dir", run_dir)], label)  # a TMPDIR with `,` or a space
                digest, last = numbers(run_dir)
                print(f"{label:12s} {digest} {last}", flush=True)
        results = os.path.join(ROOT, "docs", "results")
        for study in sorted(os.listdir(results)):
            runs = os.path.join(results, study, "runs")
            if not os.path.isdir(runs):
                continue
            with open(os.path.join(runs, "study.json")) as f:
                paired = "lr_selection" in json.load(f)
            out = os.path.join(tmp, "report", study)
            module = "dit_train.study.paired_report" if paired else "dit_train.study.report"
            run([py, "-m", module, runs, "--out", out], f"report {study}")
            with open(os.path.join(out, "report.md")) as f:
                # its "Built by" command names this checkout's runs folder and the temporary folder (the records'
                # own command lines may name a checkout too, and are data)
                text = f.read().replace(shell_command([runs, "--out", out]), "RUNS --out OUT")
            print(f"report/{study} {hashlib.sha256(text.encode()).hexdigest()[:16]}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
