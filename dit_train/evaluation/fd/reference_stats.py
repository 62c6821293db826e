"""Compute (or find in the cache) the reference statistics of a dataset split for an encoder.

    dit-reference-stats --data fashion_mnist --encoder inception --reference-num 2000
    dit-reference-stats --data image_folder --data-set root=/data/imgs num_classes=10 \\
        --encoder dinov2 --encoder-path /weights/dinov2-large --reference-num 50000 --device cuda
    torchrun --nproc_per_node 8 --no-python dit-reference-stats ...     # sharded over ranks

Writes <cache_dir>/ref_<dataset>_<split>_<encoder>_<key>.npz (mean, cov, count, labels, encoder id, dataset id,
preprocessing); the key hashes all of those, so it is recomputed only when one changes (or with --recompute).
Defaults come from the eval option --eval-preset; every flag overrides one key. Prints the file and its summary.
The shapes the data's files decide (an image folder's classes and common square size) are taken as a run on
that data takes them, so the file is the one its FD reads; a --data-set KEY=VALUE keeps its value. --data latents
reads the images the latents were made from (latents_info.json), as a latent run's FD does.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

from dit_train.evaluation.fd.job_config import add_eval_args, eval_cfg_from_args, in_flag_terms, load_data_cfg
from dit_train.parallel.fsdp import init_distributed, shutdown_process_group
from dit_train.devices import check_device
from dit_train.trainer.preemption import ctrl_c_exits
from dit_train.plain_text import print_error


def data_cfg_from_args(args):
    """--data with --data-set, and the shapes its files decide where --data-set does not set them, as a run on that
    data takes them: the statistics are those a run's FD compares with (its dataset id names the size). For
    latents, the images latents_info.json records, which a latent run's FD reads (the latents themselves were
    refused: 'FD needs an image dataset')."""
    from omegaconf import OmegaConf

    from dit_train.data.shapes import with_data_shapes

    cfg = load_data_cfg(args.data, args.data_set)
    if cfg.name == "latents":  # a latent run's FD compares with the images its latents were made from
        from dit_train.config.latents import LATENTS_INFO
        from dit_train.evaluation.during_training import reference_data_config

        if not cfg.root or not os.path.isfile(os.path.join(str(cfg.root), LATENTS_INFO)):
            given = f"--data-set root={cfg.root} is not valid" if cfg.root else "--data latents needs --data-set root=DIR"
            raise ValueError(f"{given}: the reference of latents is the images they were made from, named by the "
                             f"{LATENTS_INFO} dit-encode-latents writes beside the shards in DIR")
        source = reference_data_config(cfg)
        return source, [f"the images the latents were made from ({cfg.root}/{LATENTS_INFO}: {source.name} "
                        f"{source.get('root', '')} at {source.image_size} px)"]
    cfg, taken = with_data_shapes(OmegaConf.to_container(cfg, resolve=True),
                                  {kv.split("=", 1)[0] for kv in args.data_set})
    return OmegaConf.create(cfg), taken


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="dit-reference-stats", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default="fashion_mnist", help="a data option (default fashion_mnist)")
    ap.add_argument("--data-set", nargs="*", default=[], metavar="KEY=VALUE", help="overrides of the data config")
    ap.add_argument("--recompute", action="store_true", help="ignore an existing cache file")
    ap.add_argument("--num-workers", type=int, default=0)
    add_eval_args(ap)
    args = ap.parse_args(argv)
    check_device(args.device)  # before the process group, checkpoints and encoder
    cfg = eval_cfg_from_args(args)

    from dit_train.data.datasets import build_dataset
    from dit_train.evaluation.fd.features import build_extractor
    from dit_train.evaluation.fd.reference import load_or_compute_reference

    dist = init_distributed(device=args.device, timeout_minutes=args.timeout_minutes)
    device, rank = dist.device, dist.rank
    data_cfg, taken = data_cfg_from_args(args)
    log = (lambda line: print(in_flag_terms(line))) if rank == 0 else (lambda *a, **k: None)  # the flags' words
    if taken:
        log(f"[fd] from the data: {', '.join(taken)}")
    extractor = build_extractor(cfg.encoder, cfg.encoder_path, device, trust_code=cfg.trust_encoder_code)
    dataset = build_dataset(data_cfg, cfg.reference_split)
    ref = load_or_compute_reference(extractor, dataset, cfg.reference_split, int(cfg.reference_num), cfg.cache_dir,
                                    data_cfg=data_cfg, batch_size=int(cfg.batch_size), num_workers=args.num_workers,
                                    recompute=args.recompute, progress=True, log=log)
    summary = {"path": str(ref.path), "ref_id": ref.ref_id, "count": ref.count, "dim": ref.stats.dim,
               "encoder_id": ref.encoder_id, "dataset_id": ref.dataset_id, "split": ref.split,
               "preprocessing": ref.preprocessing, "subset": ref.subset,
               "class_counts": {int(k): int(v) for k, v in zip(*np.unique(ref.labels, return_counts=True))}}
    log(json.dumps(summary, indent=1))
    shutdown_process_group()
    return summary


@ctrl_c_exits("dit-reference-stats: interrupted; statistics are cached only when complete: rerun the same command")
def cli() -> int:
    """The command (main returns the summary to callers; a console script exits with what it returns): a bad flag
    or data path is one line, exit status 2."""
    try:
        main()
    except (FileNotFoundError, ValueError) as e:
        shutdown_process_group(failing=True)
        print_error(in_flag_terms(str(e)))
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(cli())
