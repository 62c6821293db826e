"""A DiT config read from a file (a checkpoint's saved config, an export's config.json) checked against the tensors
stored beside it, before any model is built for real or any table allocated.

The stored shapes come from the DCP `.metadata` or the safetensors header (no tensor data is read), and they are the
truth: a config is refused in one line when
- its depth is not the number of blocks the weights hold (a meta build of a declared depth of 10^8 blocks makes
  10^8 Python modules before any shape is compared);
- any tensor it implies has another shape than the stored one, or is missing, or is extra (naming both);
- what no weight pins down, the position table (tokens x width, computed, never stored) or one sampled image
  (tokens x patch^2 x channels), is larger than the model itself (its parameter count, `count_parameters` of the
  meta build) and than MIN_TABLE_VALUES: `image_size` is free of the weights, so a crafted one asked for a table of
  terabytes when the model was loaded for sampling, export or FD.
"""

from __future__ import annotations

import math
import re
from typing import Mapping, Sequence

BLOCK = re.compile(r"^blocks\.([0-9]+)\.")  # ASCII digits: the module names torch makes
MIN_TABLE_VALUES = 2**24  # 64 MiB of fp32: never refused, whatever the model (a tiny model on large images)


def check_stored_shapes(config, stored: Mapping[str, Sequence[int]], config_file: str, weights_file: str) -> None:
    """ValueError (one line naming both files) unless the DiTConfig `config` describes exactly the tensors
    `stored` (name -> shape) and a position table of a size those tensors make plausible."""
    import torch  # here, not at the top: the command-line check reads MIN_TABLE_VALUES before torch loads

    from dit_train.model.dit import DiT, count_parameters

    def refuse(detail: str) -> ValueError:
        return ValueError(f"{weights_file!r} does not hold the weights of the model {config_file!r} describes "
                          f"({detail}); refusing it before anything is allocated")

    blocks = {int(m.group(1)) for name in stored if (m := BLOCK.match(name))}
    if config.depth != len(blocks):
        raise refuse(f"depth={config.depth}, but the weights hold {len(blocks)} blocks")
    with torch.device("meta"):  # shapes only; the depth is now that of the stored weights
        model = DiT(config)
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    for name in sorted(expected.keys() | stored.keys()):
        want, have = expected.get(name), tuple(stored[name]) if name in stored else None
        if want != have:
            raise refuse(f"{name}: the config makes {describe_shape(want)}, the weights hold {describe_shape(have)}")
    params = count_parameters(model)
    tokens = model.grid ** 2
    limit = max(params, MIN_TABLE_VALUES)
    for what, values in (("a position table", tokens * config.hidden_size),
                         ("one sampled image", tokens * config.patch_size ** 2 * config.in_channels)):
        if values > limit:
            raise refuse(f"image_size={config.image_size} with patch_size={config.patch_size} makes {what} of "
                         f"{values:,} values, more than the model's {params:,} parameters")


def describe_shape(shape) -> str:
    return "no such tensor" if shape is None else f"[{', '.join(map(str, shape))}] ({math.prod(shape):,} values)"


def safetensors_shapes(file: str) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape from a safetensors file's header (no tensor data is read)."""
    from safetensors import safe_open

    with safe_open(file, "pt") as f:
        return {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
