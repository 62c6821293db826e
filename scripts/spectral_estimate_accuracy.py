"""How close the spectral RowNorm scale's two estimates of ||R||_2 come to the exact value on a real training run.

Trains with periodic_rowwise (or rownorm) under the persistent estimate, through the real Trainer, and at every
RowNorm step reads every matrix's direction input U from the optimizer's state (U = G + mu M, as the step formed
it), then computes for it (docs/algorithms.md §4):
- exact: ||R||_2 of R = RowNorm(U) by SVD;
- persistent: the estimate the step took (one round from the carried vector; 3 rounds on the run's first RowNorm
  step), recomputed from the vector the step started from;
- restart: 3 rounds from the fixed start vector (what `spectral_estimate=restart` would have taken at this U).
Prints, per window of steps, the median and worst ratio estimate / exact over the matrices whose exact norm is
above the cap (where the estimate decides the factor), and how many of those the estimate left uncapped.
Both estimates are lower bounds, so a ratio below 1 is an under-estimate: the cap is applied too weakly.

    python scripts/spectral_estimate_accuracy.py --steps 200 model=dit_s
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dit_train.optim.directions import row_inv_norms  # noqa: E402
from dit_train.optim.matrix_optimizer import VECTOR_STATE  # noqa: E402
from dit_train.optim.spectral_cap import (cap_factors, persistent_cap_factors, spectral_cap,  # noqa: E402
                                          whole_matrix_problem)

PROBE = 1e-6  # a cap below any norm: factor = PROBE / sigma, so sigma = PROBE / factor


def estimates(U: torch.Tensor, v: torch.Tensor, eps: float, first: bool) -> tuple[float, float, float, float]:
    """(exact, persistent, restart, cap) for one matrix's direction input U (fp64) and the step's start vector v."""
    tall = U.shape[0] > U.shape[1]
    s = row_inv_norms(U[None], eps, tall=tall)
    exact = torch.linalg.matrix_norm(U[None] * s, ord=2).item()
    (f, _, _), = persistent_cap_factors([(U[None], s, tall, v[None], None, PROBE)], first_rounds=2 if first else 0)
    problem = whole_matrix_problem(U[None], s, tall)
    (g,) = cap_factors([(*problem[:-1], PROBE)])
    return exact, PROBE / f.item(), PROBE / g.item(), spectral_cap(*sorted(U.shape))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--window", type=int, default=20, help="steps per printed row")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. model=dit_s optimizer.K=3")
    args = ap.parse_args()

    from hydra import compose, initialize_config_dir

    from dit_train.parallel import DistInfo
    from dit_train.train import Trainer

    conf = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "dit_train", "conf")
    with initialize_config_dir(config_dir=conf, version_base="1.3"):
        cfg = compose("config", overrides=["optimizer=periodic_rowwise", *args.overrides,
                                           "optimizer.rownorm_scale=spectral", "optimizer.spectral_estimate=persistent",
                                           "optimizer.compile_rownorm=false", f"train.steps={args.steps}",
                                           "train.val_every=0", "train.sample_every=0", "train.ckpt_every=0",
                                           "train.progress=false", f"run_dir={tempfile.mkdtemp()}"])
    trainer = Trainer(cfg, DistInfo())
    opt = trainer.optimizer
    group = next(g for g in opt.param_groups if g["kind"] == "matrix")
    first_step = opt._first_rownorm_step(group)
    rows: list[tuple[int, list[tuple[float, float, float, float]]]] = []
    step = opt.step

    def measured_step(*a, **k):
        t = group["step"]
        rownorm = opt.direction_at(group, t) == "rownorm"
        starts = {p: opt.state[p][VECTOR_STATE].clone() for p in group["params"] if VECTOR_STATE in opt.state[p]}
        out = step(*a, **k)
        if rownorm:
            mu, c = group["momentum"], group["momentum"] / (1 - group["momentum"])
            per = []
            for p in group["params"]:
                if p.grad is None:
                    continue
                buf = opt.state[p]["momentum_buffer"]  # (1 - mu) M after the step's update
                U = (p.grad + c * buf if group["nesterov"] else buf / (1 - mu)).double()
                v = starts.get(p)
                v = opt._new_vector(p) if v is None else v
                per.append(estimates(U, v.double(), group["direction_eps"], t == first_step))
            rows.append((t, per))
        return out

    opt.step = measured_step
    trainer.fit()

    print(f"# spectral estimates / exact ||R||_2 (SVD) at the RowNorm steps of {cfg.model.name}, "
          f"{cfg.optimizer.name} K={cfg.optimizer.get('K', 1)}, lr {cfg.optimizer.lr}, {args.steps} steps; "
          "over the matrices whose exact norm is above the cap")
    print("| steps | RowNorm steps | matrices above the cap | persistent median | persistent worst | "
          "persistent left uncapped | restart median | restart worst | restart left uncapped |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for lo in range(0, args.steps, args.window):
        window = [per for t, per in rows if lo <= t < lo + args.window]
        above = [m for per in window for m in per if m[0] > m[3]]
        if not above:
            continue
        line = [f"{lo}-{lo + args.window - 1}", str(len(window)), str(len(above))]
        for k in (1, 2):
            ratios = [m[k] / m[0] for m in above]
            line += [f"{statistics.median(ratios):.4f}", f"{min(ratios):.4f}",
                     str(sum(m[k] <= m[3] for m in above))]
        print("| " + " | ".join(line) + " |")


if __name__ == "__main__":
    main()
