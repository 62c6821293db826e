"""A hardware profile of the cost model: a device's peak rates, the assumed efficiencies and its links; the
H100/H200 SXM profiles."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from benchmarks.cost_model.compute import ComputeRates, gemm_curve
from benchmarks.model_owner_schedule import Net
from benchmarks.op_cost import OpRates


GPU_OP_S = 8e-6  # a GPU op's fixed cost: eager dispatch + launch (benchmarks/host_overhead.py's --launch-us default)


@dataclass(frozen=True)
class Hardware:
    name: str
    matmul_flops: float  # dense bf16 peak per device (data sheet), or the GEMM rate measured here (CPU)
    mfu: float | None  # assumed share of matmul_flops that forward + backward reach; None where `compute` prices it
    ns5_of_peak: float  # share of matmul_flops NS5's batched GEMMs reach (CPU: 1, the rate is measured at GEMMs)
    memory_bytes_s: float  # HBM (data sheet), or fused AdamW's streaming rate measured here (CPU)
    memory_efficiency: float
    intra_bytes_s: float  # per device and direction inside a node (NVLink; CPU: gloo between processes)
    inter_bytes_s: float  # per device and direction between nodes (InfiniBand)
    link_efficiency: float
    devices_per_node: int
    latency_s: float  # fixed cost of one collective
    launch_s: float  # fixed cost of one batched NS5 call
    rownorm_kernels: str  # "compiled": fused kernels (compile_rownorm auto on CUDA); "eager": torch ops (on CPU)
    ns5_rates: tuple = ()  # measured ((r, flop/s), ...) of NS5's GEMMs by the matrix's short side (CPU); else peak
    ops: OpRates | None = None  # measured rates of each op category (CPU); None: from the fields above (GPU)
    op_s: float = GPU_OP_S  # fixed cost of one dispatched op where `ops` is None (a GPU launch)
    compute: ComputeRates | None = None  # forward + backward counted and priced per op (compute.py); None: at mfu

    def op_rates(self) -> OpRates:
        """What a counted op costs here (benchmarks/op_cost.py): measured on this host, or on a GPU every
        memory-bound category at memory_efficiency of HBM, GEMMs at ns5_of_peak of the peak, op_s per op."""
        if self.ops is not None:
            return self.ops
        hbm = self.memory_bytes_s * self.memory_efficiency
        gemm = self.ns5_rates or ((1, self.matmul_flops * self.ns5_of_peak),)  # measured by short side, else assumed
        return OpRates(hbm, hbm, hbm, hbm, self.op_s, hbm, hbm, gemm)

    def ns5_rate(self, r: int) -> float:
        """flop/s of NS5 on matrices of short side r: the measured rate of the nearest measured r at or below it
        (small GEMMs run slower), else the assumed share of the peak."""
        if not self.ns5_rates:
            return self.matmul_flops * self.ns5_of_peak
        below = [rate for side, rate in self.ns5_rates if side <= r]
        return below[-1] if below else self.ns5_rates[0][1]

    def link(self, world: int) -> float:
        """Bytes/s of a collective over `world` consecutive ranks: NVLink inside one node, else InfiniBand."""
        raw = self.intra_bytes_s if world <= self.devices_per_node else self.inter_bytes_s
        return raw * self.link_efficiency

    def net(self) -> Net:
        return Net(self.inter_bytes_s * self.link_efficiency, self.intra_bytes_s * self.link_efficiency,
                   self.devices_per_node, self.latency_s)


# Data sheets: H100 SXM5 989.4 TFLOP/s dense bf16, 3.35 TB/s HBM3; H200 SXM 989.4, 4.8 TB/s HBM3e; both NVLink 4
# (900 GB/s both ways = 450 per direction) and one 400 Gbit/s NDR InfiniBand port per GPU (50 GB/s). The
# efficiencies are assumptions until the GPU check measures them (benchmarks/gpu_check.sh prints this model beside
# its measurements): MFU 0.40, NS5 at 0.5 of peak (batched bf16 bmm of 1.5k-4k matrices), 0.8 of HBM for
# streaming elementwise kernels, 0.8 of the links for NCCL rings (bus bandwidth), 30 us per collective and per
# batched NS5 call.
_GPU = dict(mfu=0.40, ns5_of_peak=0.5, memory_efficiency=0.8, intra_bytes_s=450e9, inter_bytes_s=50e9,
            link_efficiency=0.8, devices_per_node=8, latency_s=30e-6, launch_s=30e-6, rownorm_kernels="compiled")
# H200: calibrated on the first GPU check run of 2026-12-04 (docs/gpu_check_runs/2026-12-04_1210.jsonl, torch 2.11, one H200, no network;
# tests/unit/test_cost_model_h200_calibration.py pins these to that file). Measured there:
# - ns5_rates: flop/s of the executed GEMMs (the automatic form's flops, ns5_executed_flops) by short side.
#   4096: the ns5 stage's dit_15b shapes, batch 8, auto form, 623-668 TFLOP/s (median 640);
#   256: the ns5 stage's 4096x256, batch 8: 0.96 ms for 21 GFLOP, launch-bound (22 TFLOP/s);
#   1536: NOT measured standalone; fitted so that dit_1b3's counted refresh-minus-RowNorm step difference equals the
#   one measured (317.3 - 196.2 = 121.1 ms, one step of each, compiled + AC): it holds whatever else that refresh
#   step cost, so it is the weakest of the three.
# - mfu (until the second run; now None, `compute` below): dit_1b3's RowNorm step (196.2 ms, one step) minus the counted RowNorm optimizer step, as model FLOPs
#   (forward + backward, no recompute) over the peak: it holds for compiled + activation checkpointing (its
#   recomputed forward is inside it, not counted), 32 images, one GPU, and nothing else.
# Still assumptions (nothing measured them): the links, latency_s, launch_s (nothing multi-GPU has run);
# memory_efficiency and op_s are fitted below, not measured. H100: the H200's profile with its HBM (below).
# - compute (replacing the single mfu, which held for that one configuration only and missed dit_15b by 2x in the
#   second and third runs): forward + backward counted from the model and priced per op (compute.py,
#   docs/cost_model.md "Calibrated on three GPU check runs"). The GEMM curve is not fitted to step times: it runs
#   through bf16 GEMM rates measured standalone, H200_GEMM_POINTS. SDPA's rate is an assumption (its FLOPs are
#   ~1-3% of the step's). memory_efficiency and op_s are the two parameters fitted (gpu_calibration.fit_h200) on
#   the RowNorm steps without activation checkpointing; the other points are the hold-out.
# (shortest side, flop/s): 8192: the 8192^3 GEMM of the second run's env stage (docs/gpu_check_runs/2026-12-04_1747
# .jsonl); 4096: NS5's executed GEMMs at side 4096 (ns5_rates, first run); 1536: NS5 1536x1536 plain form, batch 8,
# 469 TFLOP/s (third run, docs/gpu_check_runs/2026-12-04_1755_six_stages.md: plain executes the plain flops)
H200_GEMM_POINTS = ((8192, 688.4e12), (4096, 640e12), (1536, 469e12))
H200_SDPA_OF_PEAK = 0.4  # assumed: cuDNN attention at head dim 128, sequence 256 (not measured alone)
H200_FITTED = dict(memory_efficiency=1.0, op_s=15.5e-6)  # gpu_calibration.fit_h200's, rounded
_H200_COMPUTE = ComputeRates(*gemm_curve(H200_GEMM_POINTS), sdpa=H200_SDPA_OF_PEAK * 989.4e12, **H200_FITTED)
_H200_MEASURED = dict(mfu=None, ns5_rates=((256, 22e12), (1536, 254e12), (4096, 640e12)), compute=_H200_COMPUTE)
_H200 = Hardware("H200 SXM", 989.4e12, memory_bytes_s=4.8e12, **{**_GPU, **_H200_MEASURED})
# H100: no H100 has been measured; its profile is the H200's with the H100's HBM (3.35 TB/s against 4.8), every
# other number the H200's declaration above, carried over because the H100 SXM and the H200 SXM are the same GH100
# die at the same 989.4 TFLOP/s dense bf16 data-sheet peak and the same 700 W:
# - carried over as measured on the H200: the GEMM curve (H200_GEMM_POINTS) and NS5's GEMM rates (ns5_rates), both
#   compute-bound at the sides they were measured at; assumed: that they do not depend on the memory;
# - carried over as assumed there: SDPA at H200_SDPA_OF_PEAK of the peak, and _GPU's links, latencies and the
#   optimizer's 0.8 of HBM and 8 us per op;
# - carried over as fitted there (H200_FITTED): op_s (a launch: the host's and the driver's, not the memory's), and
#   memory_efficiency, the share of HBM the eager memory-bound ops reach, now of 3.35 TB/s: assumed the same share of
#   HBM3 as of HBM3e. Every memory-bound op (and the optimizer's) is 4.8 / 3.35 = 1.43x slower than on the H200.
# This replaced (2026-12-04) the H100's MFU 0.40 of the peak for forward + backward (an assumption nothing measured,
# and one number where the H200 runs measured 0.33-0.51 by configuration): the GPU check's line on an H100 device
# and host_overhead's GPU step now count forward + backward the same way.
_H100 = replace(_H200, name="H100 SXM", memory_bytes_s=3.35e12)
PROFILES = {"h100": _H100, "h200": _H200}


def no_network(hw: Hardware) -> Hardware:
    """The profile with free collectives: a rank whose peers are a fake process group (the GPU check's dit_15b
    stages), so only its compute and memory are priced."""
    return replace(hw, intra_bytes_s=math.inf, inter_bytes_s=math.inf, latency_s=0.0)


def ns5_from_gemm_curve(hw: Hardware, sides) -> Hardware:
    """The profile with NS5's rate at each short side in `sides` taken from its GEMM curve (a sensitivity: where no
    side was measured, ns5_rate and op_cost's gemm_rate take the nearest measured side's rate at or below, which
    prices dit_4b's 2560 and dit_9b's 3072 at the 1536 rate fitted to dit_1b3's refresh step)."""
    if hw.compute is None:
        raise ValueError(f"{hw.name} has no GEMM curve (compute None): NS5's rates cannot come from it")
    bad = [s for s in sides if not (isinstance(s, int) and s > 0)]
    if bad:
        raise ValueError(f"sides {bad} are not valid: positive integers (a matrix's short side)")
    measured = dict(hw.ns5_rates)
    added = {s: hw.compute.gemm_rate(s) for s in sides if s not in measured}
    return replace(hw, ns5_rates=tuple(sorted({**measured, **added}.items())))


def gpu_profile(device_name: str) -> Hardware | None:
    """The profile of a CUDA device by its name (H200 before H100: 'NVIDIA H200' names neither twice)."""
    for key in ("h200", "h100"):
        if key in device_name.lower():
            return PROFILES[key]
    return None


def all_reduce_seconds(hw: Hardware, nbytes: float, world: int) -> float:
    return hw.latency_s + 2 * (world - 1) / world * nbytes / hw.link(world)
