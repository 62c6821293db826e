"""The shapes a run trains on, taken from its data (#28 item 2): data.channels, data.image_size and data.num_classes
as the files hold them (dit_train.data.shapes), and model.in_channels, model.image_size and model.num_classes equal
to them. A preset's value (a data or model yaml, an experiment) gives way to the data's, and the start-up log says
so; a value the command line set, or the saved config of a run being continued, is kept, and one that disagrees
with the data is refused: every such key in one line, with the overrides that fix them all. model.patch_size is
never changed, only refused with the valid choices when it does not divide the image size."""

from __future__ import annotations

import logging

from dit_train.config.errors import ConfigError

log = logging.getLogger("dit_train")
MODEL_FOLLOWS = {"in_channels": "channels", "image_size": "image_size", "num_classes": "num_classes"}


def apply_data_shapes(cfg, overrides: list[str], continued: bool = False):
    """`cfg` with the data's shapes in it (changed in place and returned). `overrides`: the command line's;
    `continued`: cfg is a saved run's config (a resume or a fork), whose values hold like the command line's."""
    if cfg.train.get("dry_run"):  # a dry run reads no data
        return cfg
    from dit_train.config.fields import check_fields
    from dit_train.config.schema import ModelConfig
    from dit_train.config.validate import check_data, patch_choices, plain
    from dit_train.data.shapes import read_data_shapes
    from dit_train.runs.resume_config import _named_keys

    check_data(cfg.data), check_fields("model", ModelConfig, plain(cfg.model))  # types first: compared below
    held = _named_keys(overrides)
    try:
        found = read_data_shapes(plain(cfg.data))
    except ValueError as e:  # a shard that cannot be read: one line naming it
        raise ConfigError(str(e)) from None
    wrong, fixes, taken = [], {}, []
    for key, f in found.items():
        have, name = cfg.data.get(key), f"data.{key}"
        if have == f.value or (have is None and continued):  # null: the data's own (a run saved before this)
            continue
        if name in held or continued:
            if not f.suggested and not (key == "num_classes" and have is not None and have > f.value):  # labels fit
                wrong.append(f"{name}={have} ({f.source})")
                fixes[name] = f.value
            continue
        taken.append(f"{name}={f.value} ({f.source})")
        cfg.data[key] = f.value
    for mkey, dkey in MODEL_FOLLOWS.items():
        want, have, name = fixes.get(f"data.{dkey}", cfg.data.get(dkey)), cfg.model.get(mkey), f"model.{mkey}"
        if want is None or have == want:
            continue
        if name in held or continued:
            if mkey != "num_classes" or (have and have < want):  # more classes than the data has (or 0) is a choice
                wrong.append(f"{name}={have} (the data has {want})")
                fixes[name] = want
            continue
        taken.append(f"{name}={want} (data.{dkey})")
        cfg.model[mkey] = want
    size = fixes.get("model.image_size", cfg.model.image_size)
    patch = cfg.model.patch_size
    if found and size % patch:  # a size the data decided (else check_architecture says it)
        choices = patch_choices(size, patch)
        wrong.append(f"model.patch_size={patch} does not divide the image size {size} (valid: "
                     f"{', '.join(map(str, choices))})")
        fixes["model.patch_size"] = max(d for d in choices if d <= patch)
    if wrong:
        where = f"the data in {cfg.data.root}" if cfg.data.get("root") else "the data"
        where += f" ({cfg.data.name}) disagrees with"
        if continued:  # its weights have the saved shapes: no override makes them fit
            raise ConfigError(f"{where} the saved config of the run being continued: {'; '.join(wrong)}; continue "
                              f"it on the data it was trained on, or train on this data in a new run_dir")
        raise ConfigError(f"{where} the command line or the presets: {'; '.join(wrong)}; use instead: "
                          f"{' '.join(f'{k}={v}' for k, v in fixes.items())}")
    check_room(cfg, found)
    if taken:
        log.info("from the data: %s", ", ".join(taken))
    return cfg


def check_room(cfg, found: dict) -> None:
    """A shape read from a data folder from elsewhere that makes a table of the model (position table, one sampled
    image, class table) larger than its transformer blocks and than MIN_TABLE_VALUES, as model/stored_shapes.py
    refuses for a saved config: a shard of no items declaring latents of side 2^16 (no file size bounds it), a class
    count of 2^40 in latents_info.json or a label, image headers of 9000 px. The run built that model: a traceback
    asking for 563 TB, or gigabytes allocated before a step on millions of tokens. One ConfigError line."""
    from dit_train.model.stored_shapes import MIN_TABLE_VALUES

    m = cfg.model
    blocks = int(m.depth * (4 + 2 * m.mlp_ratio) * m.hidden_size ** 2)  # attention and MLP weights
    limit = max(blocks, MIN_TABLE_VALUES)
    tokens = (m.image_size // m.patch_size) ** 2
    tables = {"image_size": ("a position table", tokens * m.hidden_size),
              "channels": ("one sampled image", tokens * m.patch_size ** 2 * m.in_channels),
              "num_classes": ("a class table", (m.num_classes + 1) * m.hidden_size)}
    if tables["channels"][1] > tables["image_size"][1]:
        tables["image_size"] = tables["channels"]
    for key in ("image_size", "num_classes", "channels"):  # the side first: it makes the image large too
        f = found.get(key)
        if f is None:
            continue
        what, values = tables[key]
        if values > limit:
            raise ConfigError(f"data.{key}={f.value} ({f.source}) makes {what} of {values:,} values for "
                              f"model={m.name} (hidden_size={m.hidden_size}, patch_size={m.patch_size}), more "
                              f"than its {blocks:,} block weights and 2^24: data of this shape is not for this "
                              f"model; check the data folder, or set model.* for it in a preset of your own")
