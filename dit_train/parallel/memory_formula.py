"""Memory per GPU of the large presets under FSDP2, computed by hand from exact parameter counts: the cross-check of
dit-estimate-memory, which measures the same by running the trainer's code on fake tensors (docs/scaling_out.md
compares the two; this formula leaves out the optimizer's kept workspaces and MUD's Gram matrices, and its 40 d
bytes of activations per token per block are below the ~60 d measured).

    dit-memory-formula [--micro-batch 32] [--world-sizes 8 16 32 64] [--presets dit_1b3 ...] [--blocks-per-unit 1]

The batch: --micro-batch images per GPU at every world size, 32 images per GPU by default (the scaling study's
global batch of 1024 at W = 32 only). dit-estimate-memory defaults to the study's 1024 / W per GPU instead: to
compare a row of its at W GPUs, pass --micro-batch 1024/W here.

Each model is built on the meta device (nothing allocated), its parameters routed as the optimizers route them
(2-D hidden nn.Linear weights -> matrix update; the rest -> AdamW), and the bytes per GPU summed from the terms
below. Everything is an accounting of tensors the trainer keeps, not a measurement; allocator fragmentation, the
CUDA context (~0.5-1 GiB), NCCL buffers and the data pipeline come on top (budget ~10-15 %).

Per GPU, world size W, P parameters (P_m of them in matrices), blocks of P_b parameters, depth L, width d,
N tokens per image, B images per GPU (micro-batch), FSDP2 units of u blocks (parallel.blocks_per_fsdp_unit; the last
unit holds the remainder of L), G the blocks of the largest two consecutive units (2u when u divides L, L at most):
- sharded state (FSDP2 Shard(0), every term / W): fp32 master weights 4P, fp32 gradients 4P, fp32 EMA 4P;
  optimizer: AdamW 8P (exp_avg, exp_avg_sq) | Muon family 4 P_m (momentum) + 8 (P - P_m) (AdamW on the rest);
- unsharded working set: bf16 weights of two units (the one computing and the prefetched next: G blocks), the
  current unit's bf16 gradient and its fp32 reduce-scatter input (2 + 4 bytes), and the root's (embedders, final
  layer) bf16 weights, which stay gathered through forward and backward: 2 G P_b + 6 u P_b + 2 P_root;
  Muon family, gather mode: plus one gathered bf16 bucket of momentum of one block's matrices (2 P_b,m);
- activations, bf16, with memory-efficient attention (no N x N scores stored): ~20 values per token per block
  (LayerNorm/modulate inputs, q/k/v before and after qk-norm, attention output, projection output, MLP hidden
  before and after GELU (4d each), MLP output), i.e. 40 d bytes per token per block: 40 d N B L;
  with activation checkpointing only each block's input is kept (2 d N B L) plus one block recomputed (40 d N B).
"""

from __future__ import annotations

import argparse
import sys

from dit_train.trainer.preemption import ctrl_c_exits
from dit_train.plain_text import print_error

PRESETS = ("dit_1b3", "dit_4b", "dit_9b", "dit_15b")
GIB = 1024**3
ACT_VALUES_PER_TOKEN = 20  # per block, in units of the width d (see the docstring)


def counts(preset: str) -> dict:
    from dit_train.model.dit import build_model, load_preset
    from dit_train.optim.routing import route_parameters

    cfg = load_preset(preset)
    model = build_model(cfg, device="meta")
    routing = route_parameters(model)
    matrix = {id(p) for _, p in routing.matrix}
    block = model.blocks[0]
    total = sum(p.numel() for p in model.parameters())
    in_blocks = sum(p.numel() for b in model.blocks for p in b.parameters())
    return {
        "preset": preset, "P": total, "P_matrix": sum(p.numel() for _, p in routing.matrix),
        "P_block": sum(p.numel() for p in block.parameters()),
        "P_block_matrix": sum(p.numel() for p in block.parameters() if id(p) in matrix),
        "P_root": total - in_blocks, "depth": cfg.depth, "d": cfg.hidden_size,
        "tokens": (cfg.image_size // cfg.patch_size) ** 2,
    }


def gathered_blocks(depth: int, per_unit: int) -> int:
    """G: the blocks of the largest two consecutive FSDP2 units (parallel.fsdp.fsdp_units' grouping), the most
    that are gathered at once (the unit computing and the one prefetched)."""
    from dit_train.parallel.fsdp import fsdp_units

    sizes = [len(u) for u in fsdp_units(range(depth), per_unit)]
    return max(a + b for a, b in zip(sizes, sizes[1:] + [0]))


def gathered_bytes(c: dict, blocks_per_unit: int = 1) -> int:
    """The bf16 weights gathered at once: the largest two consecutive units' blocks and the root's, 2 G P_b + 2 P_root
    (tests/integration/test_memory_estimate.py: what the estimator finds gathered at its peak)."""
    return 2 * gathered_blocks(c["depth"], blocks_per_unit) * c["P_block"] + 2 * c["P_root"]


def memory(c: dict, world: int, micro_batch: int, optimizer: str, checkpointing: bool,
           blocks_per_unit: int = 1) -> dict[str, float]:
    """Bytes per GPU by term, for FSDP2 units of `blocks_per_unit` blocks."""
    P, Pm, Pb = c["P"], c["P_matrix"], c["P_block"]
    opt = 8 * P if optimizer == "adamw" else 4 * Pm + 8 * (P - Pm)
    unit = min(blocks_per_unit, c["depth"])
    out = {
        "weights+grads+ema": 12 * P / world,
        "optimizer": opt / world,
        "working": gathered_bytes(c, blocks_per_unit) + 6 * unit * Pb
                   + (2 * c["P_block_matrix"] if optimizer != "adamw" else 0),
    }
    per_block = ACT_VALUES_PER_TOKEN * 2 * c["d"] * c["tokens"] * micro_batch
    if checkpointing:
        out["activations"] = 2 * c["d"] * c["tokens"] * micro_batch * c["depth"] + per_block
    else:
        out["activations"] = per_block * c["depth"]
    return out


def gib(x: float) -> str:
    return f"{x / GIB:.1f}"


def tables(presets, worlds, micro_batch: int, blocks_per_unit: int = 1) -> str:
    lines = ["| preset | parameters | in matrices | per block | depth x width | tokens/image |",
             "| --- | ---: | ---: | ---: | --- | ---: |"]
    all_counts = [counts(p) for p in presets]
    for c in all_counts:
        lines.append(f"| {c['preset']} | {c['P']:,} | {c['P_matrix']:,} ({c['P_matrix'] / c['P']:.1%}) | "
                     f"{c['P_block']:,} | {c['depth']} x {c['d']} | {c['tokens']} |")
    unit = "block" if blocks_per_unit == 1 else f"{blocks_per_unit} blocks"
    lines += ["", f"GiB per GPU, micro-batch {micro_batch} images per GPU, FSDP2 units of {unit}; AC = activation "
              "checkpointing per block.",
              "", "| preset | GPUs | sharded state AdamW | sharded state Muon family | working set AdamW / Muon | "
              "activations | activations (AC) | total AdamW | total AdamW (AC) | total Muon | total Muon (AC) |",
              "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for c in all_counts:
        for w in worlds:
            a, a_ac, m, m_ac = (memory(c, w, micro_batch, opt, ac, blocks_per_unit)
                                for opt in ("adamw", "muon") for ac in (False, True))
            lines.append(
                f"| {c['preset']} | {w} | {gib(a['weights+grads+ema'] + a['optimizer'])} | "
                f"{gib(m['weights+grads+ema'] + m['optimizer'])} | {gib(a['working'])} / {gib(m['working'])} | "
                f"{gib(a['activations'])} | "
                f"{gib(a_ac['activations'])} | {gib(sum(a.values()))} | {gib(sum(a_ac.values()))} | "
                f"{gib(sum(m.values()))} | {gib(sum(m_ac.values()))} |")
    return "\n".join(lines)


@ctrl_c_exits("dit-memory-formula: interrupted; it writes nothing")
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="dit-memory-formula", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--micro-batch", type=int, default=32,
                    help="images per GPU per step at every world size (default 32; not 1024 / W)")
    ap.add_argument("--world-sizes", type=int, nargs="+", default=[8, 16, 32, 64])
    ap.add_argument("--presets", nargs="+", default=list(PRESETS))
    ap.add_argument("--blocks-per-unit", type=int, default=1,
                    help="consecutive blocks per FSDP2 unit (parallel.blocks_per_fsdp_unit; default 1)")
    args = ap.parse_args(argv)
    # before any work: a world size of 0 divided by zero in a traceback
    for flag, values in (("--world-sizes", args.world_sizes), ("--micro-batch", [args.micro_batch])):
        bad = [v for v in values if v < 1]
        if bad:
            print_error(f"{flag} {bad[0]}: must be an integer >= 1")
            return 2
    if args.blocks_per_unit < 1:
        ap.error(f"--blocks-per-unit: {args.blocks_per_unit} is not a number of blocks (an integer >= 1)")
    print(tables(args.presets, args.world_sizes, args.micro_batch, args.blocks_per_unit))
    return 0


if __name__ == "__main__":
    sys.exit(main())
