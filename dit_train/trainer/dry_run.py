"""`train.dry_run=true`: a preset built on the meta device (nothing allocated), its size and parameter groups, and
where each parameter goes."""

from __future__ import annotations

from dit_train.data.shapes import SHAPES_FROM_FILES
from dit_train.model.dit import build_model, count_parameters
from dit_train.optim.registry import build_optimizer
from dit_train.optim.routing import PER_TENSOR_HINT


def dry_run(cfg, world_size: int = 1) -> dict:
    """Build on the meta device (nothing allocated), print the size, the optimizer's parameter groups and the
    per-tensor routing; with `world_size` > 1 (the launcher's WORLD_SIZE), what was checked for it."""
    model = build_model(cfg.model, device="meta")
    n = count_parameters(model)
    optimizer = build_optimizer(model, cfg.optimizer)
    nominal = cfg.model.get("nominal_params")
    rel = f" ({n / nominal:.3f} x nominal {nominal / 1e9:.2f}B)" if nominal else ""
    print(f"model {cfg.model.name}: {n:,} parameters{rel}; depth {cfg.model.depth}, width {cfg.model.hidden_size}, "
          f"heads {cfg.model.num_heads}, patch {cfg.model.patch_size}, tokens {(cfg.model.image_size // cfg.model.patch_size) ** 2}")
    if cfg.data.name in SHAPES_FROM_FILES:  # the size above is not that of the run, which reads them
        m = cfg.model
        root = cfg.data.get("root")  # unset on the large presets' latents: `data.root=None` read as a folder
        source = f"data.root={root}" if root else "the data at data.root (not set here; a run needs it)"
        print(f"shapes: the preset's ({m.in_channels}x{m.image_size}x{m.image_size}, {m.num_classes} classes); a dry "
              f"run reads no data: the run takes channels, image size and class count from {source} (docs/data.md)")
    print(f"optimizer {optimizer.routing_table.removesuffix(PER_TENSOR_HINT)}{optimizer.routing.table()}")
    if world_size > 1:
        t = cfg.train
        micro = f", micro-batch {t.micro_batch_size}" if t.get("micro_batch_size") else ""
        print(f"world size {world_size} (WORLD_SIZE): config checked for {world_size} ranks; per-rank batch "
              f"{t.batch_size // world_size} of train.batch_size={t.batch_size}{micro}. This dry run is one process "
              f"and joins no process group; per-rank memory: dit-estimate-memory --world-size {world_size}")
    print("dry run: nothing allocated, exiting")
    return {"params": n}
