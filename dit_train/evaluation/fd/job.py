"""Score checkpoints with a Fréchet distance (the default preset scores with Inception, offline; `--eval-preset dinov2`
for FD-DINO).

    dit-fd runs/<date>/<time>-<suffix>/checkpoints/step_00001000.dcp   # one checkpoint
    dit-fd runs/<date>/<time>-<suffix>                                 # every checkpoint of a run
    dit-fd multirun/<date>/<time>-<suffix>                             # every run of a --multirun sweep
    dit-fd sweeps/<study> --eval-preset dinov2 --encoder-path /weights/dinov2-large   # every run of a dit-study
    torchrun --nproc_per_node 8 --no-python dit-fd sweeps/<study> --eval-preset dinov2   # sampling over ranks

A folder written by dit-export is not a run: give the run folder it was exported from. For every checkpoint found
(a checkpoint; a run folder's checkpoints/step_*.dcp; or every run folder under a sweep folder) it loads the EMA
model, samples --num-samples images (Euler, --sample-steps, CFG --cfg-scale, fixed labels and noise from --seed),
encodes them and compares with the cached reference statistics of the run's own data config. Results go to
<out>/fd_results.csv and .json, one row per checkpoint: label (what the run is, from its saved config: model,
optimizer with its K and RowNorm scale, lr, seed), run (its folder), step, active_time_s, fd, encoder, num_gen,
num_ref, ref_id and the settings. They are written after each checkpoint; a checkpoint already scored with the same
settings is skipped (--force rescores). A sample grid per checkpoint goes to <out>/fd_grids/. Settings default to
the eval option --eval-preset; flags override single keys. On a terminal, progress bars count the reference
images' batches and each checkpoint's model calls (--no-progress: none).
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import sys
import time
from pathlib import Path

from dit_train.runs import checkpoint as ckpt
from dit_train.evaluation.fd.job_config import add_eval_args, dotlist, eval_cfg_from_args, in_flag_terms
from dit_train.runs.atomic_io import (atomic_write_bytes, check_folder_can_be_made, describe_os_error,
                                     refuse_links_on_the_way)
from dit_train.runs.folder_kind import no_checkpoints
from dit_train.runs.json_file import read_json
from dit_train.parallel.fsdp import init_distributed, shutdown_process_group
from dit_train.plain_text import print_error, spreadsheet_cell
from dit_train.telemetry.progress import model_call_bar, write
from dit_train.devices import check_device
from dit_train.trainer.preemption import ctrl_c_exits

COLUMNS = ["label", "run", "step", "active_time_s", "fd", "encoder", "num_gen", "num_ref", "ref_id", "sample_steps",
           "cfg_scale", "seed", "checkpoint", "eval_time_s", "scored_at"]
SETTINGS = ["encoder", "num_gen", "sample_steps", "cfg_scale", "seed", "reference"]
GRIDS = "fd_grids"
GRID_WRITER = "dit-fd's sample grid (--no-grid: none)"


def find_checkpoints(path: str | os.PathLike) -> tuple[Path, list[tuple[str, Path]]]:
    """(output root, [(run name, checkpoint)]) for a checkpoint, a run folder or a sweep folder, through the same
    listing that resume and export use (dit_train.runs.checkpoint): complete step_N.dcp folders written by any number
    of ranks, and read-only step_N.pt files of earlier versions."""
    p = Path(path).resolve()
    if ckpt.is_complete(str(p)) or (p.is_file() and ckpt.LEGACY_RE.match(p.name)):
        run_dir = p.parent.parent if p.parent.name == "checkpoints" else p.parent
        return run_dir, [(run_dir.name, p)]
    if not p.is_dir():
        raise FileNotFoundError(f"{str(path)!r} is neither a checkpoint nor a folder")

    def ckpts(run_dir: Path) -> list[Path]:
        return [Path(c) for c in ckpt.list_checkpoints(str(run_dir), remove_partial=False, legacy=True)]

    run_dir, listed = ckpt.run_checkpoints(str(p))  # a run folder or its checkpoints/, as dit-sample/dit-export
    if listed:
        return Path(run_dir), [(Path(run_dir).name, Path(c)) for c in listed]
    found = []
    for dirpath, dirnames, _ in os.walk(p):
        dirnames.sort()
        d = Path(dirpath)
        for name in dirnames:  # os.walk does not enter a linked folder: a linked run is refused, not skipped quietly
            if os.path.islink(d / name) and os.path.isdir(d / name / "checkpoints"):
                raise ckpt.CheckpointError(f"{d / name} is a symbolic link (to {os.readlink(d / name)}): runs are "
                                           f"scored only from folders of the sweep, not through a link to "
                                           f"elsewhere; replace it by the run folder itself, or name that folder")
        if "checkpoints" in dirnames:
            found += [(str(d.relative_to(p)), c) for c in ckpts(d)]
            dirnames.remove("checkpoints")
    if not found:
        raise no_checkpoints(str(path))
    return p, found


def grid_path(out: Path, run: str, step: int) -> Path:
    return out / GRIDS / run.replace(os.sep, "__") / f"step_{step:08d}.png"


def refuse_linked_grids(out: Path, todo: list[tuple[str, Path]]) -> None:
    """Before any checkpoint or encoder is loaded: the grids' folders and files under an --out from elsewhere (a
    sweep folder handed over) hold no symbolic link or FIFO (`fd_grids/<run> -> ~` put a grid in the home folder,
    replacing a file of the same name, after minutes of sampling). Checked again at each write, for the step a
    checkpoint's train state gives."""
    for run, path in todo:
        refuse_links_on_the_way(str(out), str(grid_path(out, run, 0).parent), GRID_WRITER, folder=True)
        named_step = ckpt.CKPT_RE.match(path.name) or ckpt.LEGACY_RE.match(path.name)
        if named_step:
            refuse_links_on_the_way(str(out), str(grid_path(out, run, int(named_step.group(1)))), GRID_WRITER)


def run_label(run_cfg) -> str:
    """What a run is, from its saved config: `dit_s periodic_rowwise K=3 (spectral) lr=0.002 seed=1` (a sweep's
    folders are numbers or Hydra's override strings, which say neither what was left at its default nor all)."""
    from omegaconf import OmegaConf

    from dit_train.study.report import optimizer_label

    cfg = OmegaConf.to_container(run_cfg) if OmegaConf.is_config(run_cfg) else dict(run_cfg)
    opt, parts = cfg.get("optimizer") or {}, []
    if (cfg.get("model") or {}).get("name"):
        parts.append(str(cfg["model"]["name"]))
    if opt.get("name"):
        parts.append(optimizer_label(opt))
    if isinstance(opt.get("lr"), (int, float)):
        parts.append(f"lr={opt['lr']:g}")
    if cfg.get("seed") is not None:
        parts.append(f"seed={cfg['seed']}")
    return " ".join(parts)


def named(row: dict) -> str:
    """A row's run as a log line names it: its label, and its folder (two runs may be alike)."""
    label = row.get("label")
    return f"{label} (folder {row['run']})" if label else str(row["run"])


def decoding_vae(run_cfg, data_cfg, vae_path: str | None, recorded: dict | None, checkpoint: str) -> str | None:
    """A latent run's VAE folder (--vae, or its vae.path), checked against the VAE that made its latents
    (config/latents.py: check_decoding_vae); None for image runs."""
    from omegaconf import OmegaConf

    if data_cfg.get("name") != "latents":
        if vae_path is not None:  # ignored before: the user believed the samples were decoded by it
            raise ValueError(f"--vae={vae_path!r} is not valid for checkpoint {checkpoint}: its run trained on images "
                             f"(data={data_cfg.get('name')}); only a latent run (data=latents) is decoded by a VAE")
        return None
    path = vae_path or OmegaConf.select(run_cfg, "vae.path")
    if not path:
        raise ValueError("a latent run's samples are decoded by its VAE: pass --vae /path/to/vae")
    from dit_train.config.latents import check_decoding_vae

    check_decoding_vae(path, data_cfg.get("root"), "--vae" if vae_path else "vae.path", recorded, checkpoint)
    return path


def check_vaes(todo: list[tuple[str, Path]], vae_path: str | None, data_set: list[str]) -> set[str]:
    """Before the encoder, the reference statistics or any weights (minutes with Inception on a CPU), and for
    checkpoints already scored too: the VAE of every latent run is the one that made its latents. Returns the
    checkpoints judged; a read-only .pt holds its train state beside its weights and is judged when it loads."""
    from omegaconf import OmegaConf

    checked, seen = set(), set()
    for _, path in todo:
        if not ckpt.is_complete(str(path)):
            continue
        state = ckpt.read_saved_state(str(path))
        run_cfg = OmegaConf.create(ckpt.literal_config(state["config"]))
        data_cfg = OmegaConf.merge(run_cfg.get("data") or {}, dotlist(data_set))
        key = json.dumps([OmegaConf.to_container(data_cfg), OmegaConf.select(run_cfg, "vae.path"),
                          state.get("latents_vae")], sort_keys=True, default=str)
        if key not in seen:  # a run's checkpoints share one record: judged (and warned of) once
            seen.add(key)
            decoding_vae(run_cfg, data_cfg, vae_path, state.get("latents_vae"), str(path))
        checked.add(str(path))
    return checked


def latent_decoder(run_cfg, data_cfg, vae_path: str | None, device, meta: dict | None = None,
                   checked: bool = False):
    """The decoder of a latent run's samples (None for image runs); the VAE is loaded once per folder.
    `checked`: check_vaes has judged the VAE of this checkpoint."""
    from omegaconf import OmegaConf

    meta = meta or {}
    if data_cfg.name != "latents":
        if not checked:  # a read-only .pt of an image run given --vae: refused as check_vaes refuses the others
            decoding_vae(run_cfg, data_cfg, vae_path, meta.get("latents_vae"), str(meta.get("path", "")))
        return None
    path = (vae_path or OmegaConf.select(run_cfg, "vae.path")) if checked else \
        decoding_vae(run_cfg, data_cfg, vae_path, meta.get("latents_vae"), str(meta.get("path", "")))
    if path not in _CODECS:
        from dit_train.diffusion.vae import LatentCodec

        _CODECS[path] = LatentCodec(path, device)
    return _CODECS[path].decode


_CODECS: dict = {}


def row_key(row: dict) -> tuple:
    return (str(row["run"]), Path(str(row["checkpoint"])).name) + tuple(str(row[k]) for k in SETTINGS)


def load_results(out: Path) -> list[dict]:
    f = out / "fd_results.json"
    if not f.is_file():
        return []
    return read_json(str(f), ("rows",), fix="delete it (and fd_results.csv) to score every checkpoint again")["rows"]


def write_results(out: Path, rows: list[dict]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    rows = sorted(rows, key=lambda r: (str(r["run"]), int(r["step"]), str(r["encoder"])))
    # through a temp name that is never followed if a link was planted there (a run folder from elsewhere)
    atomic_write_bytes(json.dumps({"columns": COLUMNS + ["reference"], "rows": rows}, indent=1).encode(),
                       str(out / "fd_results.json"))
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=COLUMNS + ["reference"], extrasaction="ignore")
    w.writeheader()
    w.writerows({k: spreadsheet_cell(v) for k, v in r.items()} for r in rows)  # a label "=HYPERLINK(..)" is text
    atomic_write_bytes(buf.getvalue().encode(), str(out / "fd_results.csv"))


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(prog="dit-fd", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("paths", nargs="+", help="checkpoint file(s), run folder(s) or sweep folder(s)")
    ap.add_argument("--out", help="folder for fd_results.{csv,json} (default: the first path's run/sweep folder)")
    ap.add_argument("--force", action="store_true", help="rescore checkpoints already in the results")
    ap.add_argument("--no-grid", action="store_true", help="do not save a sample grid per checkpoint")
    ap.add_argument("--data-set", nargs="*", default=[], metavar="KEY=VALUE",
                    help="overrides of each checkpoint's data config (e.g. root=/data/fmnist on another machine)")
    ap.add_argument("--vae", help="VAE folder for latent runs (default: the run's vae.path)")
    ap.add_argument("--no-progress", action="store_true", help="no progress bars (there are none when stderr is not "
                                                                  "a terminal)")
    add_eval_args(ap)
    args = ap.parse_args(argv)
    check_device(args.device)  # before the process group, checkpoints and encoder
    cfg = eval_cfg_from_args(args)

    import torch.distributed as dist
    from omegaconf import OmegaConf

    from dit_train.evaluation.fd.evaluator import FDEvaluator
    from dit_train.evaluation.fd.features import build_extractor
    from dit_train.evaluation.during_training import reference_data_config
    from dit_train.parallel.fsdp import compute_precision
    from dit_train.diffusion.sampler import make_sampler

    dist_info = init_distributed(device=args.device, timeout_minutes=args.timeout_minutes)
    device, rank = dist_info.device, dist_info.rank
    # above a progress bar, never on its line; in the words of the flags the user typed, not of config keys
    log = (lambda line: write(in_flag_terms(line))) if rank == 0 else (lambda *a, **k: None)
    progress = rank == 0 and not args.no_progress
    todo: list[tuple[str, Path]] = []
    out = None
    for p in args.paths:
        root, found = find_checkpoints(p)
        out = out or Path(args.out or root)
        todo += found
    checked = check_vaes(todo, args.vae, args.data_set)  # first: a wrong --vae is refused in seconds, never scored
    if rank == 0:
        check_folder_can_be_made(str(out))  # an unusable --out is found now, not after the first checkpoint
    rows = load_results(out) if rank == 0 else []  # a damaged results file is refused before the encoder loads
    if rank == 0 and not args.no_grid:
        refuse_linked_grids(out, todo)
    extractor = build_extractor(cfg.encoder, cfg.encoder_path, device, trust_code=cfg.trust_encoder_code)
    reference = f"{cfg.reference_split}:{cfg.reference_num}"
    settings = {"encoder": extractor.encoder_id, "num_gen": int(cfg.num_samples),
                "sample_steps": int(cfg.sample_steps), "cfg_scale": float(cfg.cfg_scale), "seed": int(cfg.seed),
                "reference": reference}

    done = {row_key(r): r for r in rows}
    skip = [(run, c) for run, c in todo if not args.force and row_key({"run": run, "checkpoint": c, **settings}) in done]
    if dist.is_initialized():  # rank 0's view of the results decides, so every rank runs the same collectives
        obj = [skip]
        dist.broadcast_object_list(obj, src=0)
        skip = obj[0]
    for run, c in skip:  # rank 0 holds the rows
        scored = done.get(row_key({"run": run, "checkpoint": c, **settings}), {"run": run})
        log(f"[fd] skip {named(scored)} {c.name}: already scored with these settings")
    todo = [t for t in todo if t not in skip]

    evaluators: dict[str, FDEvaluator] = {}
    for run, path in todo:
        t0 = time.perf_counter()
        model, run_cfg, meta = ckpt.load_for_inference(str(path), device)
        data_cfg = OmegaConf.merge(run_cfg.data, dotlist(args.data_set))
        mcfg = run_cfg.model
        if int(mcfg.get("text_dim", 0) or 0) > 0:
            raise ValueError(f"{path}: FD of text-conditioned models needs prompts; not supported by this job")
        real = reference_data_config(data_cfg)  # a latent run: the images its latents were made from
        dkey = json.dumps(OmegaConf.to_container(real, resolve=True), sort_keys=True)
        if dkey not in evaluators:
            evaluators[dkey] = FDEvaluator(cfg, real, device, extractor=extractor, log=log, progress=progress)
        ev = evaluators[dkey]
        precision = compute_precision(OmegaConf.select(run_cfg, "train.precision", default="auto"), device)
        sample = make_sampler(model, mcfg, device, int(cfg.sample_steps), float(cfg.cfg_scale), precision,
                              decode=latent_decoder(run_cfg, data_cfg, args.vae, device, meta, str(path) in checked))
        label = run_label(run_cfg)
        with model_call_bar(model, len(ev.my_batches()) * int(cfg.sample_steps),
                            f"FD {label or run} step {meta['step']}", progress):
            res = ev.evaluate(sample, int(meta["step"]))
        row = {"label": label, "run": run, "step": int(meta["step"]), "active_time_s": float(meta["active_time_s"]),
               "fd": res["fd"], "encoder": res["fd_encoder"], "num_gen": res["fd_num_gen"],
               "num_ref": res["fd_num_ref"], "ref_id": res["fd_ref_id"], "sample_steps": int(cfg.sample_steps),
               "cfg_scale": float(cfg.cfg_scale), "seed": int(cfg.seed), "checkpoint": str(path),
               "eval_time_s": round(time.perf_counter() - t0, 2), "scored_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
               "reference": reference}
        if rank == 0:
            rows = [r for r in rows if row_key(r) != row_key(row)] + [row]
            write_results(out, rows)
            if not args.no_grid and "images" in res:
                from dit_train.evaluation.grids import save_grid

                grid = grid_path(out, run, row["step"])
                refuse_links_on_the_way(str(out), str(grid), GRID_WRITER)
                grid.parent.mkdir(parents=True, exist_ok=True)
                save_grid(res["images"], str(grid), nrow=8)
            log(f"[fd] {named(row)} step {row['step']}: FD={row['fd']:.4f} ({extractor.name}, n_gen={row['num_gen']}, "
                f"n_ref={row['num_ref']}, {row['eval_time_s']} s)")
        del model

    if rank == 0 and rows:
        best: dict[str, dict] = {}
        for r in rows:
            same = all(str(r[k]) == str(settings[k]) for k in SETTINGS)  # compare only equal settings/counts
            if same and (r["run"] not in best or r["fd"] < best[r["run"]]["fd"]):
                best[r["run"]] = r
        for r in best.values():
            log(f"[fd] best {named(r)}: FD={r['fd']:.4f} at step {r['step']} "
                f"(active time {r['active_time_s']:.1f} s)")
        log(f"[fd] results: {out / 'fd_results.csv'} and {out / 'fd_results.json'}")
    shutdown_process_group()
    return rows


@ctrl_c_exits("dit-fd: interrupted; the checkpoints already scored are kept in its results: rerun the same command to score the rest")
def cli() -> int:
    """The command: a path without checkpoints or a damaged results file is one line, exit status 2."""
    try:
        main()
    except (FileNotFoundError, ValueError) as e:  # a damaged JSON file or checkpoint is a ValueError
        shutdown_process_group(failing=True)
        print_error(in_flag_terms(str(e)))
        return 2
    except OSError as e:  # --out not a folder, not writable, a full disk: the path and the operation
        shutdown_process_group(failing=True)
        print_error(describe_os_error(e))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(cli())
