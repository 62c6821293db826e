"""Every path a run reads, opened before Hydra makes the run folder (#28 item 3): the data files of each data preset
(Fashion-MNIST's idx files, an image folder's class folders, every latent shard's header and labels), the VAE,
the FD encoder's weights and the checkpoint a fork starts from. Found later, inside the Hydra job, each left a
run folder behind. Each fault is one ConfigError line naming the path; validate() has already checked the types."""

from __future__ import annotations

import os

from dit_train.config.errors import ConfigError, invalid
from dit_train.extras import installed


# the paths a run reads that its saved config keeps (a resume continues the checkpoint's config)
READ_PATHS = ("data.root", "vae.path", "eval.encoder_path", "train.init_from")


def absolute_paths(cfg):
    """`cfg` with the paths it reads made absolute against the folder the run started in (and ~ expanded), in
    place: the checkpoint's config then finds them when the run is resumed from any other folder (a relative
    data.root was refused there as not a folder)."""
    from omegaconf import OmegaConf

    for key in READ_PATHS:
        value = OmegaConf.select(cfg, key)
        if isinstance(value, str) and value not in ("", "???"):
            OmegaConf.update(cfg, key, os.path.abspath(os.path.expanduser(value)))
    return cfg


def check_paths(cfg) -> None:
    """Raise ConfigError (one line) for the first path of `cfg` that cannot be read, or a run folder with a link
    where the run writes in place (runs/in_place_files.py). A dry run reads and writes nothing."""
    if cfg.train.get("dry_run"):
        return
    vae = cfg.vae.get("path")
    if vae is not None and not os.path.isfile(os.path.join(str(vae), "config.json")):
        raise invalid("vae.path", vae, "expected a diffusers AutoencoderKL folder (config.json + weights)")
    encoder = cfg.eval.get("encoder_path")
    if encoder is not None and not os.path.exists(str(encoder)):
        raise invalid("eval.encoder_path", encoder, "no such file or folder (the FD encoder's local weights)")
    if encoder is not None:  # a torch.hub checkout is code: refused here unless trusted, before any folder is made
        from dit_train.evaluation.fd.features import UntrustedCodeError, check_encoder_trusted, encoder_path_problem

        problem = encoder_path_problem(str(cfg.eval.encoder), str(encoder))  # an empty folder was found at the 1st FD
        if problem is not None:
            raise invalid("eval.encoder_path", encoder, problem)

        try:
            check_encoder_trusted(cfg.eval.encoder, encoder, bool(cfg.eval.get("trust_encoder_code")))
        except UntrustedCodeError as e:
            raise ConfigError(str(e)) from None
    run_dir = _explicit_run_dir(cfg)
    if run_dir is not None:  # before Hydra opens its log there, and before checkpoints/ is listed
        from dit_train.runs.in_place_files import refuse_writes_outside

        refuse_writes_outside(run_dir)
    source = cfg.train.get("init_from")
    if source is not None and not _has_checkpoints(cfg):  # a requeued fork continues from its own
        from dit_train.runs.checkpoint import CheckpointError, resolve_checkpoint

        try:
            resolve_checkpoint(str(source))
        except (FileNotFoundError, CheckpointError) as e:  # CheckpointError: e.g. its checkpoints/ is a link
            raise invalid("train.init_from", source, str(e)) from None
    check_data_files(cfg.data)
    if vae is not None and installed("diffusers"):  # its weights after the data (without diffusers: refused later)
        from dit_train.diffusion.vae_shapes import check_vae_folder

        try:
            check_vae_folder(str(vae))
        except ValueError as e:
            raise ConfigError(str(e)) from None


def _explicit_run_dir(cfg) -> str | None:
    try:
        return str(cfg.run_dir)  # the default ${hydra:...} resolves only inside Hydra: a new folder then
    except Exception:  # noqa: BLE001
        return None


def _has_checkpoints(cfg) -> bool:
    from dit_train.runs.checkpoint import list_checkpoints

    run_dir = _explicit_run_dir(cfg)
    return run_dir is not None and cfg.train.get("resume") == "auto" and \
        bool(list_checkpoints(run_dir, remove_partial=False, legacy=True))


def check_data_files(data) -> None:
    """The files of both splits, as the dataset opens them (indexes and headers; no image is decoded)."""
    from dit_train.data.fashion_mnist_files import FILES, find_file

    try:
        if data.name == "fashion_mnist":
            root = str(data.get("root"))
            if not os.path.isdir(root):
                raise invalid("data.root", root, "not a folder of the four Fashion-MNIST idx files; install them with "
                                                 "`sudo apt-get install dataset-fashion-mnist` or point data.root at them")
            for stems in FILES.values():
                for stem in stems:
                    find_file(root, stem)
        elif data.name in ("image_folder", "latents"):
            from dit_train.data.datasets import build_dataset  # torch: only for the data that needs its reader

            for split in ("train", "val"):
                build_dataset(data, split)
    except ConfigError:
        raise
    except (OSError, ValueError) as e:
        raise ConfigError(str(e)) from None
