"""Export consolidated EMA weights as one safetensors file.

    python -m dit_train.export RUN_DIR_OR_CHECKPOINT out.safetensors [--dtype fp32|bf16|fp16]

The input is a run folder (its newest complete checkpoint) or a checkpoint folder (step_N.dcp, written by any
number of ranks; consolidated here without a process group); read-only step_N.pt files of earlier versions work
too. The file holds the EMA model's state dict under the DiT's parameter names; its metadata has the step, the
source checkpoint and the run's model config (JSON), so `DiT(DiTConfig.from_cfg(json.loads(meta["model"])))`
rebuilds the architecture.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def export_ema(source: str, out: str, dtype: str = "fp32") -> dict:
    """Write the EMA weights of `source` to `out` (atomically); returns the metadata written."""
    from safetensors.torch import save_file

    from .checkpoint import load_ema_weights

    if dtype not in DTYPES:
        raise ValueError(f"--dtype={dtype!r} is not valid: choose one of {', '.join(DTYPES)}")
    weights, config, meta = load_ema_weights(source)
    tensors = {k: v.detach().to(DTYPES[dtype]).contiguous() for k, v in weights.items()}
    metadata = {"step": str(meta["step"]), "source": os.path.abspath(meta["path"]), "format": meta["format"],
                "dtype": dtype, "model": json.dumps(config.get("model", {})),
                "config": json.dumps(config, default=str)}
    folder = os.path.dirname(os.path.abspath(out))
    os.makedirs(folder, exist_ok=True)
    tmp = f"{out}.tmp-{os.getpid()}"
    save_file(tensors, tmp, metadata=metadata)
    os.replace(tmp, out)
    return metadata


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dit_train.export", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("source", help="run folder or step_N.dcp checkpoint folder")
    ap.add_argument("out", help="output .safetensors path")
    ap.add_argument("--dtype", default="fp32", choices=sorted(DTYPES), help="weight dtype in the file (default fp32)")
    args = ap.parse_args(argv)
    try:
        meta = export_ema(args.source, args.out, args.dtype)
    except (FileNotFoundError, KeyError, ValueError) as e:  # CheckpointError is a ValueError
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}: EMA weights at step {meta['step']} ({meta['format']} checkpoint {meta['source']}, "
          f"{args.dtype})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
