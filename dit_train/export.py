"""Export a run's EMA weights as a model folder that other code can load.

    dit-export RUN_DIR_OR_CHECKPOINT OUT_DIR [--dtype fp32|bf16|fp16] [--vae VAE_DIR]

OUT_DIR is a diffusers pipeline folder (layout in dit_train/model/pretrained.py): `transformer/` holds the EMA state dict
under the DiT's parameter names and `config.json` (the DiT's architecture keys, and under "dit_train" the step, the
source checkpoint and the run's whole config); a latent run's VAE (vae.path, or --vae) is copied to `vae/`:

    from dit_train.model.dit import DiT
    model = DiT.from_pretrained("OUT_DIR")
    from dit_train.diffusers_pipeline import DiTTrainPipeline      # the [latents] extra
    pipe = DiTTrainPipeline.from_pretrained("OUT_DIR")

The input is a run folder (its newest complete checkpoint) or a checkpoint folder (step_N.dcp, written by any
number of ranks; consolidated here without a process group); read-only step_N.pt files of earlier versions work
too.
"""

from __future__ import annotations

import argparse
import os
import sys

from dit_train.model.pretrained import DTYPES
from dit_train.plain_text import print_error, printable
from dit_train.trainer.preemption import ctrl_c_exits


def export_ema(source: str, out_dir: str, dtype: str = "fp32", vae: str | None = None) -> dict:
    """Write the EMA model of `source` to the folder `out_dir`; returns the provenance written to config.json."""
    from dit_train.runs.checkpoint import is_complete, load_ema_weights, read_saved_state, resolve_checkpoint
    from dit_train.model.dit import DiTConfig
    from dit_train.model.pretrained import refuse_links_in_export, save_export

    if out_dir.endswith(".safetensors"):
        raise ValueError(f"OUT_DIR={out_dir!r} is not valid: export writes a folder (a diffusers pipeline); give "
                         f"a folder path")
    if dtype not in DTYPES:
        raise ValueError(f"--dtype={dtype!r} is not valid: choose one of {', '.join(DTYPES)}")
    refuse_links_in_export(out_dir, with_vae=True)  # before the checkpoint is read: vae/ too, whether or not written
    path = resolve_checkpoint(source)
    refuse_out_dir_in_run(out_dir, path)
    vae_path = None
    if is_complete(path):  # the VAE judged before the weights are read (a legacy .pt holds both: judged after)
        state = read_saved_state(path)
        vae_path = latent_vae(state["config"], vae, {"latents_vae": state.get("latents_vae"), "path": path})
    weights, config, meta = load_ema_weights(path)
    if not is_complete(path):
        vae_path = latent_vae(config, vae, meta)
    architecture = DiTConfig.from_cfg(config["model"])
    architecture.validate()
    provenance = {"step": meta["step"], "source": os.path.abspath(meta["path"]), "format": meta["format"],
                  "run_config": config}
    if vae_path is not None:  # which VAE made the latents: DiTTrainPipeline refuses another one given to it
        provenance["latents_vae"] = recorded_vae(config, meta.get("latents_vae"), vae_path)
    save_export(weights, architecture, out_dir, dtype, provenance, vae_path)
    return provenance


def refuse_out_dir_in_run(out_dir: str, checkpoint: str) -> None:
    """One line when OUT_DIR is the run folder of `checkpoint` or inside it (its checkpoints/ pruned or listed by
    a resumed run, the export mistaken for a run's file), before anything is written."""
    parent = os.path.dirname(os.path.abspath(checkpoint))
    run_dir = os.path.dirname(parent) if os.path.basename(parent) == "checkpoints" else parent
    run_real, out_real = os.path.realpath(run_dir), os.path.realpath(out_dir)
    if out_real == run_real or out_real.startswith(run_real + os.sep):
        raise ValueError(f"OUT_DIR={out_dir!r} is not valid: it is inside the run folder being exported ({run_dir}); "
                         f"give a folder outside it")


def recorded_vae(config: dict, recorded: dict | None, vae_path: str) -> dict:
    """What the export records of the VAE that made the latents: their latents_info.json's entry (else the
    checkpoint's record), which the copied vae/ matches (latent_vae checked it)."""
    from dit_train.config.latents import LATENTS_INFO, read_latents_info, vae_files, vae_scaling

    root = str(config["data"].get("root") or "")
    info = read_latents_info(root) if root and os.path.isfile(os.path.join(root, LATENTS_INFO)) else {}
    source = info if "scaling_factor" in info else (recorded if isinstance(recorded, dict) else {})
    if "scaling_factor" not in source:  # a checkpoint from before the record: what was checked by hand
        scale, shift = vae_scaling(vae_path)
        source = {"vae": os.path.abspath(vae_path), "scaling_factor": scale, "shift_factor": shift,
                  "vae_files": vae_files(vae_path)}
    return {k: source[k] for k in ("vae", "scaling_factor", "shift_factor", "vae_files") if k in source}


def latent_vae(config: dict, vae: str | None, meta: dict | None = None) -> str | None:
    """The VAE folder a latent run's export includes (checked before anything is written, against the latents'
    latents_info.json, else the record in the checkpoint `meta` came from); None for image runs."""
    if config["data"].get("name") != "latents":
        if vae is not None:
            raise ValueError(f"--vae={vae!r} is not valid here: this run trained on images (data="
                             f"{config['data'].get('name')}); only a latent run's export includes a VAE")
        return None
    path = vae or (config.get("vae") or {}).get("path")
    if not path or not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"--vae={path!r} is not valid: a latent run's export includes the VAE that made its latents;"
                         f" pass --vae /path/to/vae (the AutoencoderKL folder given to dit-encode-latents --vae)")
    from dit_train.config.latents import check_decoding_vae
    from dit_train.extras import require

    meta = meta or {}
    check_decoding_vae(path, config["data"].get("root"), "--vae" if vae else "vae.path", meta.get("latents_vae"),
                       meta.get("path", ""))
    require("diffusers", "latents", "exporting a latent run's VAE")
    return path


@ctrl_c_exits("dit-export: interrupted; the output folder may be incomplete: rerun the same command")
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="dit-export", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("source", help="run folder or step_N.dcp checkpoint folder")
    ap.add_argument("out_dir", help="output folder (model_index.json, transformer/, scheduler/[, vae/])")
    ap.add_argument("--dtype", default="fp32", choices=sorted(DTYPES), help="weight dtype in the file (default fp32)")
    ap.add_argument("--vae", default=None, help="VAE folder of a latent run (default: the run's vae.path)")
    args = ap.parse_args(argv)
    try:
        meta = export_ema(args.source, args.out_dir, args.dtype, args.vae)
    except (FileNotFoundError, KeyError, ValueError) as e:  # CheckpointError is a ValueError
        print_error(str(e))
        return 2
    except OSError as e:  # a full disk or an unwritable OUT_DIR: the path and the error; the run is only read
        from dit_train.runs.atomic_io import describe_os_error

        print_error(describe_os_error(e))
        return 1
    print(printable(f"wrote {args.out_dir}: EMA weights at step {meta['step']} ({meta['format']} checkpoint "
                    f"{meta['source']}, {args.dtype}); load with DiT.from_pretrained({args.out_dir!r}) or, in "
                    f"diffusers, dit_train.diffusers_pipeline.DiTTrainPipeline.from_pretrained({args.out_dir!r})"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
