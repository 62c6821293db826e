"""`train.dry_run=true`: a preset built on the meta device (nothing allocated), its size and parameter groups, and
where each parameter goes."""

from __future__ import annotations

from dit_train.data.shapes import SHAPES_FROM_FILES
from dit_train.model.dit import build_model, count_parameters
from dit_train.optim.registry import build_optimizer
from dit_train.optim.routing import PER_TENSOR_HINT


def dry_run(cfg) -> dict:
    """Build on the meta device (nothing allocated), print the size, the optimizer's parameter groups and the
    per-tensor routing."""
    model = build_model(cfg.model, device="meta")
    n = count_parameters(model)
    optimizer = build_optimizer(model, cfg.optimizer)
    nominal = cfg.model.get("nominal_params")
    rel = f" ({n / nominal:.3f} x nominal {nominal / 1e9:.2f}B)" if nominal else ""
    print(f"model {cfg.model.name}: {n:,} parameters{rel}; depth {cfg.model.depth}, width {cfg.model.hidden_size}, "
          f"heads {cfg.model.num_heads}, patch {cfg.model.patch_size}, tokens {(cfg.model.image_size // cfg.model.patch_size) ** 2}")
    if cfg.data.name in SHAPES_FROM_FILES:  # the size above is not that of the run, which reads them
        m = cfg.model
        print(f"shapes: the preset's ({m.in_channels}x{m.image_size}x{m.image_size}, {m.num_classes} classes); a dry "
              f"run reads no data: the run takes channels, image size and class count from data.root="
              f"{cfg.data.get('root')} (docs/data.md)")
    print(f"optimizer {optimizer.routing_table.removesuffix(PER_TENSOR_HINT)}{optimizer.routing.table()}")
    print("dry run: nothing allocated, exiting")
    return {"params": n}
