"""Bytes each rank moves per training step, from the real preset shapes (built on the meta device), for plain FSDP
over every GPU and for HSDP (shard within a node, replicate across nodes). Runs on a CPU in seconds.

    dit-comm-volume [--presets dit_1b3 dit_4b dit_9b dit_15b] [--nodes 4] [--gpus-per-node 8] \\
        [--reduce-dtype fp32|bf16] [--no-reshard]

What is counted (per rank, per optimizer step, no gradient accumulation; bytes as the collectives' ring
implementations send them, the logical bytes of dit_train/optim/collectives.py):
- forward all-gather of the bf16 compute weights: (S - 1) / S x parameters x 2 bytes over a shard group of S ranks;
- backward all-gather: the same for every block but the last (FSDP2 keeps the last block and the root gathered
  for backward; none without resharding);
- gradient reduce-scatter within the shard group: (S - 1) / S x parameters x 4 (fp32) or 2 (bf16) bytes;
- HSDP only: the all-reduce of each rank's gradient shard across the R replicas (one per node):
  2 (R - 1) / R x parameters / S x the reduce dtype's bytes; this is the only traffic between nodes;
- optimizer: Muon / a periodic_rowwise refresh step all-gathers the bf16 momentum of every matrix-routed
  parameter within the shard group ((S - 1) / S x M x 2 bytes); owner mode sends ~2 (S - 1) / S^2 x M x 2 twice
  (to the owner and back, bf16). periodic_rowwise pays that every K-th step; RowNorm, MUD's tall matrices and
  AdamW move next to nothing.
"""

from __future__ import annotations

import argparse
import sys

from dit_train.config.schema import COMPUTE_DTYPES
from dit_train.dtypes import torch_dtype
from dit_train.parallel.comm_volume import GB, crossing_nodes, fsdp_volumes
from dit_train.trainer.preemption import ctrl_c_exits

PRESETS = ("dit_1b3", "dit_4b", "dit_9b", "dit_15b")


def preset_counts(preset: str) -> dict:
    """Parameter counts of a preset: total, per block (the FSDP units), and those routed to the matrix update."""
    from dit_train.config import check_optimizer
    from dit_train.model.dit import build_model, load_preset
    from dit_train.optim.routing import route_parameters

    model = build_model(load_preset(preset), device="meta")
    c = check_optimizer({"name": "muon"})
    routing = route_parameters(model, c["matrix_patterns"], c["adamw_patterns"])
    blocks = [sum(p.numel() for p in b.parameters()) for b in model.blocks]
    return {"params": sum(p.numel() for p in model.parameters()), "blocks": blocks,
            "matrix": sum(p.numel() for _, p in routing.matrix)}


def volumes(counts: dict, shard: int, replicas: int, reduce_bytes: int, reshard: bool) -> dict:
    """Bytes per rank per step of each collective for a shard group of `shard` ranks and `replicas` groups."""
    M, S = counts["matrix"], shard
    out = fsdp_volumes(counts["params"], counts["blocks"], shard, replicas, reduce_bytes, reshard)
    out.update(muon_gather=(S - 1) / S * M * 2, muon_owner=2 * (S - 1) / S**2 * M * 2 * 2)
    return out


def table(presets, nodes: int, gpus: int, reduce_dtype: str, reshard: bool) -> str:
    reduce_bytes = torch_dtype(reduce_dtype).itemsize
    world = nodes * gpus
    lines = [f"{nodes} nodes x {gpus} GPUs (W = {world}); GB (1e9 bytes) per rank per step; gradients reduced in "
             f"{reduce_dtype}; reshard_after_forward {str(reshard).lower()}",
             "",
             "| preset | params | layout | all-gather fwd | all-gather bwd | reduce-scatter | all-reduce across nodes "
             "| FSDP total | of which crosses nodes | Muon refresh: gather / owner |",
             "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for preset in presets:
        counts = preset_counts(preset)
        for layout, shard, replicas in (("FSDP", world, 1), ("HSDP", gpus, nodes)):
            v = volumes(counts, shard, replicas, reduce_bytes, reshard)
            crosses = crossing_nodes(v, replicas, nodes)
            g = lambda k: f"{v[k] / GB:.1f}"  # noqa: E731
            lines.append(f"| {preset} | {counts['params'] / 1e9:.2f} B | {layout} {replicas} x {shard} | "
                         f"{g('ag_fwd')} | {g('ag_bwd')} | {g('rs')} | {g('ar_replicas')} | "
                         f"**{g('fsdp_total')}** | {crosses / GB:.1f} | {g('muon_gather')} / {g('muon_owner')} |")
    return "\n".join(lines)


@ctrl_c_exits("dit-comm-volume: interrupted; it writes nothing")
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="dit-comm-volume", description=__doc__.split("\n")[0])
    ap.add_argument("--presets", nargs="+", default=list(PRESETS))
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--reduce-dtype", choices=COMPUTE_DTYPES, default="fp32")
    ap.add_argument("--no-reshard", action="store_true", help="parallel.reshard_after_forward=false")
    a = ap.parse_args(argv)
    if a.nodes < 1 or a.gpus_per_node < 1:
        ap.error(f"--nodes={a.nodes} and --gpus-per-node={a.gpus_per_node} must be >= 1")
    print(table(a.presets, a.nodes, a.gpus_per_node, a.reduce_dtype, not a.no_reshard))
    return 0


if __name__ == "__main__":
    sys.exit(main())
