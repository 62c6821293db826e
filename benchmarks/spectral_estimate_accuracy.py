"""How close the spectral RowNorm scale's estimate of ||R||_2 comes to the exact value on a real training run.

Trains with periodic_rowwise (or rownorm) under the spectral scale, through the real Trainer, and at every RowNorm
step reads every matrix's direction input U from the optimizer's state (U = G + mu M, as the step formed it), then
computes for it (docs/algorithms.md §4): exact, ||R||_2 of R = RowNorm(U) by SVD; and the estimate the step took
(spectral_cap.cap_factors: ROUNDS = 3 power-iteration rounds from the fixed start vector), or with `--rounds` the
estimates other round counts would give at the same U. Prints, per window of steps and round count, over the
matrices whose exact norm is above the cap (where the estimate decides the factor): the median and worst ratio
estimate / exact, how many the estimate left uncapped, and the worst operator norm of the capped direction over
the cap (exact / estimate: the estimate is a lower bound, so the cap is applied too weakly by that factor).

    python -m benchmarks.spectral_estimate_accuracy --steps 300 --rounds 3,5,8 model=dit_s optimizer.lr=1.6e-2
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import warnings

import torch


from dit_train.optim.directions import row_inv_norms
from dit_train.optim.fused_rownorm import _coefficient, _direction_input
from dit_train.optim.spectral_cap import ROUNDS, cap_factors, spectral_cap, whole_matrix_problem

PROBE = 1e-6  # a cap below any norm: factor = PROBE / sigma, so sigma = PROBE / factor


def estimates(U: torch.Tensor, eps: float, rounds: tuple[int, ...] = (ROUNDS,)) -> tuple[float, list[float], float]:
    """(exact, the estimate with each round count, cap) for one matrix's direction input U (fp64)."""
    tall = U.shape[0] > U.shape[1]
    s = row_inv_norms(U[None], eps, tall=tall)
    R = U * s[0]
    # ||R||_2 = sqrt of the largest eigenvalue of the Gram of the short side (fp64: 1e-15 of the SVD's value), 2-3x
    # faster than the SVD of R at every matrix of every RowNorm step
    exact = torch.linalg.eigvalsh(R @ R.mT if R.shape[0] <= R.shape[1] else R.mT @ R)[-1].sqrt().item()
    problem = (*whole_matrix_problem(U[None], s, tall)[:-1], PROBE)
    return exact, [PROBE / cap_factors([problem], rounds=r)[0].item() for r in rounds], spectral_cap(*sorted(U.shape))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--window", type=int, default=20, help="steps per printed row")
    ap.add_argument("--rounds", type=lambda v: [int(r) for r in v.split(",")], default=[ROUNDS],
                    help=f"power-iteration round counts to measure, comma-separated (the optimizer runs {ROUNDS})")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. model=dit_s optimizer.K=3")
    args = ap.parse_args()

    from hydra import compose, initialize_config_dir

    from dit_train.parallel.fsdp import DistInfo
    from dit_train.trainer.loop import Trainer

    conf = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "dit_train", "conf")
    with initialize_config_dir(config_dir=conf, version_base="1.3"):
        cfg = compose("config", overrides=["optimizer=periodic_rowwise", *args.overrides,
                                           "optimizer.rownorm_scale=spectral", f"train.steps={args.steps}",
                                           "train.val_every=0", "train.sample_every=0", "train.ckpt_every=0",
                                           "train.progress=false", f"run_dir={tempfile.mkdtemp()}"])
    trainer = Trainer(cfg, DistInfo())
    opt = trainer.optimizer
    group = next(g for g in opt.param_groups if g["kind"] == "matrix")
    rows: list[tuple[int, list[tuple[float, list[float], float]]]] = []
    rounds = tuple(args.rounds)
    step = opt.step

    def measured_step(*a, **k):
        t = group["step"]
        rownorm = opt.direction_at(group, t) == "rownorm"
        out = step(*a, **k)
        if rownorm:
            c = _coefficient(group["momentum"], group["nesterov"])
            per = []
            for p in group["params"]:
                if p.grad is None:
                    continue
                # the step's direction input from its gradient and the momentum buffer as the step left it
                U = _direction_input(p.grad, opt.state[p]["momentum_buffer"], c, group["nesterov"], torch.float64)
                per.append(estimates(U, group["direction_eps"], rounds))
            rows.append((t, per))
        return out

    opt.step = measured_step
    # the scheduler notices the wrapper and warns that step() was replaced; the wrapper calls it unchanged
    warnings.filterwarnings("ignore", message="Seems like `optimizer.step\\(\\)` has been overridden")
    trainer.fit()

    print(f"# spectral estimate / exact ||R||_2 (SVD) at the RowNorm steps of {cfg.model.name}, "
          f"{cfg.optimizer.name} K={cfg.optimizer.get('K', 1)}, lr {cfg.optimizer.lr}, {args.steps} steps "
          f"(trained with {ROUNDS} rounds); over the matrices whose exact norm is above the cap")
    print("| steps | RowNorm steps | matrices above the cap | rounds | estimate / exact, median | worst | "
          "left uncapped | worst ||Phi||_2 / cap |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for lo in range(0, args.steps, args.window):
        window = [per for t, per in rows if lo <= t < lo + args.window]
        above = [m for per in window for m in per if m[0] > m[2]]
        if not above:
            continue
        for k, r in enumerate(rounds):
            ratios = [ests[k] / exact for exact, ests, _ in above]
            over = max(exact / max(ests[k], cap) for exact, ests, cap in above)
            print(f"| {lo}-{lo + args.window - 1} | {len(window)} | {len(above)} | {r} | "
                  f"{statistics.median(ratios):.4f} | {min(ratios):.4f} | "
                  f"{sum(ests[k] <= cap for _, ests, cap in above)} | {over:.2f} |")


if __name__ == "__main__":
    main()
