"""The one answer to "does X run at step s?" for validation, sample grids, FD, checkpoints and logging."""

from __future__ import annotations


def every_n_steps(step: int, n: int, final_step: int | None = None) -> bool:
    """True at positive multiples of `n`, and at `final_step` when given; `n` = 0 means never (not even at the
    end). Steps count finished steps, so step 0 (nothing trained yet) never runs anything."""
    if n <= 0 or step <= 0:
        return False
    return step % n == 0 or step == final_step
