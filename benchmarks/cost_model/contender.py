"""A contender of the cost model (optimizer, K, RowNorm scale, distributed mode) and the optimizer configs its
steps are counted with."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Optim:
    name: str  # adamw | muon | periodic_rowwise | rownorm
    K: int = 1
    scale: str = "spectral"  # rownorm_scale
    mode: str = "owner"  # distributed_mode

    def steps(self) -> list[str]:
        """The step kinds of one cycle: 'adamw', 'refresh' (NS5) or 'rownorm'."""
        return {"adamw": ["adamw"], "muon": ["refresh"], "rownorm": ["rownorm"],
                "periodic_rowwise": ["refresh"] + ["rownorm"] * (self.K - 1)}[self.name]

    def label(self) -> str:
        if self.name == "periodic_rowwise":
            return f"periodic_rowwise K={self.K} {self.scale} {self.mode}"
        return self.name + (f" {self.mode}" if self.name == "muon" else "")


def optimizer_config(opt: Optim) -> dict:
    """The optimizer config of a contender, as build_optimizer takes it."""
    cfg = {"name": opt.name}
    if opt.name in ("muon", "periodic_rowwise"):
        cfg["distributed_mode"] = opt.mode
    if opt.name == "periodic_rowwise":
        cfg["K"] = opt.K
    if opt.name in ("periodic_rowwise", "rownorm"):
        cfg["rownorm_scale"] = opt.scale
    return cfg


def counted_optimizer(step: str, scale: str, kernels: str) -> dict:
    """The single-process optimizer whose step of kind `step` op_cost.count_step counts (one process: W = 1)."""
    return {"adamw": {"name": "adamw"}, "refresh": {"name": "muon"},
            "rownorm": {"name": "rownorm", "rownorm_scale": scale, "compile_rownorm": kernels == "compiled"}}[step]
