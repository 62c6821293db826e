"""Export a run's EMA weights as a model folder that other code can load.

    python -m dit_train.export RUN_DIR_OR_CHECKPOINT OUT_DIR [--dtype fp32|bf16|fp16]

OUT_DIR gets `model.safetensors` (the EMA state dict under the DiT's parameter names) and `config.json` (the DiT's
architecture keys, and under "dit_train" the step, the source checkpoint and the run's whole config):

    from dit_train.model import DiT
    model = DiT.from_pretrained("OUT_DIR")

The input is a run folder (its newest complete checkpoint) or a checkpoint folder (step_N.dcp, written by any
number of ranks; consolidated here without a process group); read-only step_N.pt files of earlier versions work
too.
"""

from __future__ import annotations

import argparse
import os
import sys

from .pretrained import DTYPES


def export_ema(source: str, out_dir: str, dtype: str = "fp32") -> dict:
    """Write the EMA model of `source` to the folder `out_dir`; returns the provenance written to config.json."""
    from .checkpoint import load_ema_weights
    from .model import DiTConfig
    from .pretrained import save_pretrained

    if out_dir.endswith(".safetensors"):
        raise ValueError(f"OUT_DIR={out_dir!r} is not valid: export writes a folder (config.json + "
                         f"model.safetensors); give a folder path")
    if dtype not in DTYPES:
        raise ValueError(f"--dtype={dtype!r} is not valid: choose one of {', '.join(DTYPES)}")
    weights, config, meta = load_ema_weights(source)
    architecture = DiTConfig.from_cfg(config["model"])
    architecture.validate()
    provenance = {"step": meta["step"], "source": os.path.abspath(meta["path"]), "format": meta["format"],
                  "run_config": config}
    save_pretrained(weights, architecture, out_dir, dtype, provenance)
    return provenance


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dit_train.export", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("source", help="run folder or step_N.dcp checkpoint folder")
    ap.add_argument("out_dir", help="output folder (config.json + model.safetensors)")
    ap.add_argument("--dtype", default="fp32", choices=sorted(DTYPES), help="weight dtype in the file (default fp32)")
    args = ap.parse_args(argv)
    try:
        meta = export_ema(args.source, args.out_dir, args.dtype)
    except (FileNotFoundError, KeyError, ValueError) as e:  # CheckpointError is a ValueError
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a full disk or an unwritable OUT_DIR: the path and the error; the run is only read
        from .atomic_io import describe_os_error

        print(f"error: {describe_os_error(e)}", file=sys.stderr)
        return 1
    print(f"wrote {args.out_dir}: EMA weights at step {meta['step']} ({meta['format']} checkpoint {meta['source']}, "
          f"{args.dtype}); load with DiT.from_pretrained({args.out_dir!r})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
