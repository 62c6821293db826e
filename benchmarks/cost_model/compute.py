"""Forward + backward of one rank's micro-batch from first principles (issue 31 items 1-2): the real model's ops
counted on fake tensors, each priced by a roofline (docs/cost_model.md, "Calibrated on three GPU check runs").

Counting: the model built on the meta device, its parameters and buffers made fake in bf16 (FSDP2's param_dtype
under parallel.mixed_precision=bf16), one forward of `images` images and the backward of a mean-square loss under
op_cost's OpCounter (benchmarks/op_cost.py: every dispatched op with the bytes it reads and writes and a matmul's
FLOPs and dims). The ops dispatched inside a DiT block's forward are marked "block_forward" (the rest "forward"
and "backward"): activation checkpointing (parallel.activation_checkpointing wraps each block) runs them once more
in backward. SDPA (the fused attention kernel: cuDNN on the H200) is one record per call with its FLOPs, forward
4 B H S L D, backward 2.5 x that (five matmuls of the recomputing flash backward against two). The count is cached
per (shapes, images): a few seconds of CPU once per configuration (the GPU check counts it in its background
prediction).

Pricing, per record (ComputeRates):
  matmul    max(its FLOPs at gemm_rate(short side), its bytes at HBM x memory_efficiency) + op_s; the GEMM rate by
            the GEMM's shortest side s (m, k or n): gemm_max x s / (s + gemm_half_side), a curve through the bf16
            GEMM rates measured on the device (not fitted here: ComputeRates' docstring says where they come from)
  SDPA      its FLOPs at `sdpa` + op_s
  any other its bytes at HBM x memory_efficiency + op_s (elementwise, norms, reductions, copies: eager, one kernel
            each)
What it leaves out: FSDP2's own copies (all-gather copy-out, reduce-scatter copy-in, the fp32 gradient cast), the
host's dispatch where it outruns the GPU (op_s is one number, fitted), and torch.compile's fusion (a compiled model
is priced as its eager ops: an upper bound on its memory traffic and launches)."""

from __future__ import annotations

import copy
import math
from collections import Counter
from dataclasses import dataclass

import torch

from benchmarks.op_cost import MATMULS, OpCounter, OpRecord, record_of

PHASES = ("forward", "block_forward", "backward")


@dataclass(frozen=True)
class ComputeRates:
    """What forward + backward's counted ops cost on a device: matmuls on the GEMM curve
    gemm_max x s / (s + gemm_half_side) by their shortest side s, SDPA at `sdpa` flop/s, every other op its bytes
    at memory_efficiency of the profile's HBM; op_s per op (a launch)."""
    gemm_max: float  # flop/s the GEMM curve tends to at large sides
    gemm_half_side: float  # the shortest side at which a GEMM reaches half of gemm_max
    sdpa: float  # flop/s of the fused attention kernel (forward and backward)
    memory_efficiency: float  # share of the HBM data-sheet bandwidth the eager memory-bound ops reach
    op_s: float  # fixed cost of one op (a launch, the gap between kernels)

    def __post_init__(self):
        bad = {k: v for k, v in vars(self).items() if not (isinstance(v, (int, float)) and v > 0)}
        if bad or self.memory_efficiency > 1:
            raise ValueError(f"ComputeRates {bad or {'memory_efficiency': self.memory_efficiency}} is not valid: "
                             "every field > 0, memory_efficiency <= 1")

    def gemm_rate(self, side: int) -> float:
        return self.gemm_max * side / (side + self.gemm_half_side)


def gemm_curve(points) -> tuple[float, float]:
    """(gemm_max, gemm_half_side) of the curve R(s) = gemm_max s / (s + half) through measured ((side, flop/s),
    ...): least squares of 1/R = 1/gemm_max + (half / gemm_max) / s, a straight line in 1/s."""
    if len({s for s, _ in points}) < 2:
        raise ValueError(f"gemm_curve {points} is not valid: at least two sides measured")
    xs, ys = [1 / s for s, _ in points], [1 / r for _, r in points]
    n, mx, my = len(xs), sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    intercept = my - slope * mx
    if intercept <= 0 or slope <= 0:
        raise ValueError(f"gemm_curve {points} is not valid: the rate rising with the side")
    return 1 / intercept, slope / intercept


class _ModelCounter(OpCounter):
    """An OpCounter that keeps SDPA as one record with its FLOPs (category "sdpa")."""

    def _observe(self, func, args, kwargs, out) -> None:
        name = func.__name__.split(".")[0]
        if "scaled_dot_product" not in name:
            super()._observe(func, args, kwargs, out)
            return
        rec = record_of(self.current, func, args, kwargs, out)
        backward = name.endswith("_backward")
        q, k = (args[1], args[2]) if backward else (args[0], args[1])
        *batch, s, d = q.shape
        flops = 4 * math.prod(batch) * s * k.shape[-2] * d * (2.5 if backward else 1)
        self.records.append(OpRecord(self.current, name, "sdpa", rec.read, rec.written, flops=int(flops)))


def count_forward_backward(model_cfg, images: int) -> tuple[OpRecord, ...]:
    """The records of one forward of `images` images and its backward, phases as in PHASES."""
    from dit_train.model.dit import build_model

    if images < 1:
        raise ValueError(f"images {images} is not valid: at least 1 image per rank")
    model = build_model(model_cfg, device="meta")
    counter = _ModelCounter(allow_non_fake_inputs=True)
    with counter:
        for module in model.modules():
            for name, p in list(module.named_parameters(recurse=False)):
                setattr(module, name, torch.nn.Parameter(torch.empty(p.shape, dtype=torch.bfloat16)))
            for name, b in list(module.named_buffers(recurse=False)):
                module._buffers[name] = torch.empty(b.shape, dtype=b.dtype)
        for block in model.blocks:
            block.register_forward_pre_hook(lambda *_: setattr(counter, "current", "block_forward"))
            block.register_forward_hook(lambda *_: setattr(counter, "current", "forward"))
        size = model_cfg.image_size
        x = torch.empty(images, model_cfg.in_channels, size, size, dtype=torch.bfloat16)
        t, y = torch.empty(images), torch.zeros(images, dtype=torch.long)
        counter.reset()
        counter.current = "forward"
        loss = model(x, t, y=y).float().square().mean()
        counter.current = "backward"
        loss.backward()
    return tuple(counter.records)


_DISTINCT: dict = {}


def records_by_depth(model_cfg, images: int) -> Counter:
    """{record: how often} of count_forward_backward at the config's depth, counted at depths 1 and 2 only: every
    block dispatches the same records, so depth D's are depth 1's + (D - 1) x what the second block added (a
    dit_15b count took 3-5 s of CPU for its 50 blocks; tested equal to a full count)."""
    depth = int(model_cfg.depth)
    if depth <= 2:
        return Counter(count_forward_backward(model_cfg, images))
    one, two = (Counter(count_forward_backward(_with_depth(model_cfg, d), images)) for d in (1, 2))
    if any(two[rec] < n for rec, n in one.items()):
        raise RuntimeError("a record counted at depth 1 is missing at depth 2: the blocks do not repeat, "
                           "count the full depth with count_forward_backward")
    return Counter({rec: one[rec] + (depth - 1) * (n - one[rec]) for rec, n in two.items()})


def _with_depth(model_cfg, depth: int):
    cfg = copy.deepcopy(model_cfg)
    cfg.depth = depth
    return cfg


def distinct_records(shapes, images: int) -> Counter:
    """The counted forward + backward of shapes.model as {record: how often} (records_by_depth): pricing (and the
    calibration's fit, which prices many times) runs over a block's worth, cached per (shapes, images, the
    config's text: two configs of equal shapes, e.g. other head counts, count apart)."""
    if shapes.model is None:
        raise ValueError("shapes without their model config: the counted forward + backward needs shapes_of(cfg)")
    key = (shapes, images, str(shapes.model))
    if key not in _DISTINCT:
        _DISTINCT[key] = records_by_depth(shapes.model, images)
    return _DISTINCT[key]


def record_seconds(rec: OpRecord, rates: ComputeRates, memory_bytes_s: float) -> dict[str, float]:
    """{part: seconds} of one record: "gemm", "sdpa" or "memory" (the roofline's time) and "launch" (op_s)."""
    hbm = rec.bytes / (memory_bytes_s * rates.memory_efficiency)
    if rec.category == "sdpa":
        return {"sdpa": rec.flops / rates.sdpa, "launch": rates.op_s}
    if rec.op in MATMULS:
        return {"gemm": max(rec.flops / rates.gemm_rate(min(rec.dims)), hbm), "launch": rates.op_s}
    return {"memory": hbm, "launch": rates.op_s}


def compute_seconds(shapes, rates: ComputeRates, memory_bytes_s: float, images: int,
                    activation_checkpointing: bool = False) -> dict[str, float]:
    """Seconds of forward + backward of `images` images on one rank: {"compute": total, "gemm", "sdpa", "memory",
    "launch": its parts, "recompute": the part activation checkpointing adds (the blocks' forward once more),
    "ops": ops counted, "gemm_flops": the matmuls' FLOPs without the recompute}."""
    parts = {"gemm": 0.0, "sdpa": 0.0, "memory": 0.0, "launch": 0.0, "recompute": 0.0}
    ops = flops = 0
    for rec, count in distinct_records(shapes, images).items():
        priced = record_seconds(rec, rates, memory_bytes_s)
        times = count * (2 if activation_checkpointing and rec.phase == "block_forward" else 1)
        for part, sec in priced.items():
            parts[part] += times * sec
        parts["recompute"] += (times - count) * sum(priced.values())
        ops += times
        flops += count * rec.flops if rec.op in MATMULS else 0
    total = parts["gemm"] + parts["sdpa"] + parts["memory"] + parts["launch"]
    return {"compute": total, **parts, "ops": ops, "gemm_flops": flops}
