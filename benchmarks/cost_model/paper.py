"""The paper's table (`--paper`): periodic_rowwise K=3 and K=5 against Muon at dit_1b3-15b on 8/16/32 GPUs of a
hardware profile, beside the paper's headline ranges."""

from __future__ import annotations

import time
from dataclasses import asdict

from benchmarks.cost_model.contender import Optim
from benchmarks.cost_model.hardware import Hardware
from benchmarks.cost_model.predict import predict
from benchmarks.cost_model.shapes import model_shapes
from benchmarks.cost_model.sharded import counted_ranks


PAPER_PRESETS = ("dit_1b3", "dit_4b", "dit_9b", "dit_15b")
PAPER_WORLDS = (8, 16, 32)
PAPER_GLOBAL_BATCH = 1024  # experiment=scaling_study's train.batch_size
PAPER_ACTIVATION_CHECKPOINTING = True  # experiment=scaling_study's parallel.activation_checkpointing
PAPER_HEADLINE = {"optimizer": (-54.3, -46.9), "step": (-24.3, -15.7), "bytes": (-66.7, -66.7)}


def paper_contenders(mode: str) -> list[Optim]:
    """Muon and periodic_rowwise K=3 and K=5 with each RowNorm scale, all in distributed_mode `mode`."""
    return [Optim("muon", mode=mode)] + [Optim("periodic_rowwise", K, scale, mode)
                                         for K in (3, 5) for scale in ("frobenius", "spectral")]


def paper_settings(hw: Hardware) -> str:
    """What each cell's step assumes of the scaling study's run (experiment=scaling_study), and where it differs."""
    if hw.compute is not None:
        recompute = ", with activation checkpointing's recompute (as the study)" * PAPER_ACTIVATION_CHECKPOINTING
        fb = ("forward + backward counted from the model and priced per op (compute.py), eager (parallel.compile "
              f"off, as the study){recompute}")
    else:
        fb = f"forward + backward at MFU {hw.mfu:g} of model FLOPs (activation checkpointing's recompute inside it)"
    return (f"global batch {PAPER_GLOBAL_BATCH} (1024 / W images per GPU); {fb}; FSDP2 plain over W (the study runs "
            "HSDP, parallel.replicate=nodes: dit_9b on 2 x 8 and dit_15b on 4 x 8 GPUs, one shard group per node; "
            "not modelled here: their FSDP and optimizer traffic are plain FSDP's over all W, and at 16-32 GPUs "
            "dit_1b3/4b are what-ifs, the study runs them on 8)")


def paper_table(hw: Hardware, presets=PAPER_PRESETS, worlds=PAPER_WORLDS, mode: str = "gather") -> str:
    """periodic_rowwise K=3 and K=5 (each RowNorm scale) against Muon, both in `mode`, at the scaling study's
    global batch: change of optimizer time, step time and logical optimizer bytes (rank 0's), each cell's optimizer
    counted on the sharded step at that preset and W and replayed on the hardware (sharded_optimizer), with the
    CPU seconds the counting took."""
    lines = [f"{hw.name}; {asdict(hw)}; {paper_settings(hw)}; distributed_mode {mode} for both; "
             "optimizer steps counted on the real sharded step (fake tensors, a fake process group of W) on rank 0 "
             "and the rank owning the most NS5 flops, replayed together (compute and communication streams)",
             "",
             "| preset | GPUs | Muon: fwd+bwd ms | FSDP exposed ms | optimizer ms | step ms | "
             "ranks counted (slowest) | periodic_rowwise | optimizer time | step time | logical bytes | counting s |",
             "| --- | ---: | ---: | ---: | ---: | ---: | --- | --- | ---: | ---: | ---: | ---: |"]
    total = 0.0
    for preset in presets:
        shapes = model_shapes(preset)
        for world in worlds:
            batch = PAPER_GLOBAL_BATCH // world
            contenders = paper_contenders(mode)
            start = time.process_time()
            ranks = counted_ranks(shapes, contenders, world, hw.rownorm_kernels == "compiled")
            counting = time.process_time() - start
            total += counting
            base, *others = (predict(shapes, opt, hw, world, batch,
                                     activation_checkpointing=PAPER_ACTIVATION_CHECKPOINTING) for opt in contenders)
            for opt, p in zip(contenders[1:], others):
                pct = lambda k: f"{100 * (p[k] / base[k] - 1):+.1f}%"  # noqa: E731
                slow = ", ".join(f"{k} {r}" for k, r in sorted(p["slowest"].items()))
                lines.append(f"| {preset} | {world} | {base['compute'] * 1e3:.0f} | "
                             f"{base['fsdp_exposed'] * 1e3:.0f} | {base['optimizer'] * 1e3:.0f} | "
                             f"{base['step'] * 1e3:.0f} | {', '.join(map(str, sorted(ranks[opt])))} ({slow}) | "
                             f"K={opt.K} {opt.scale} | {pct('optimizer')} | {pct('step')} | {pct('bytes')} | "
                             f"{counting:.0f} |")
    lo, hi = PAPER_HEADLINE["optimizer"], PAPER_HEADLINE["step"]
    lines.append(f"\nthe paper's headline: optimizer time {lo[0]} to {lo[1]}%, step time {hi[0]} to {hi[1]}%, "
                 f"logical communication {PAPER_HEADLINE['bytes'][0]}%")
    lines.append(f"counting: {total:.0f} s of CPU (process time) for the {len(presets) * len(worlds)} cells, every "
                 "contender's counted steps of each cell on one fake sharded model per counted rank")
    return "\n".join(lines)
