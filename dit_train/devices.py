"""The --device flag of the commands that sample (dit-sample, dit-fd, dit-reference-stats), checked before a
checkpoint, encoder or process group is loaded: a name torch cannot parse, or a CUDA device this machine lacks, was
torch's traceback from inside the load."""

from __future__ import annotations

import torch


def check_device(name: str | None) -> None:
    """Raise ValueError (one line) unless `name` is a device here; None is the command's own default."""
    if name is None:
        return
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"--device {name!r} is not valid: expected cpu, cuda or cuda:N") from None
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device.type == "cuda" and (device.index or 0) >= count:
        raise ValueError(f"--device {name!r} is not valid: this machine has {count} CUDA device(s)"
                         f"{'; use --device cpu' if count == 0 else f': cuda:0..cuda:{count - 1}'}")
