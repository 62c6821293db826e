"""Every check of a config value, in one place. `validate(cfg, world_size)` checks a composed run config before
anything heavy happens; the check_* functions check one group and are what library entry points
(build_optimizer, resolve_plan, FDEvaluator, build_dataset, DiT) call, filling missing keys from the schemas'
defaults."""

from __future__ import annotations

import os
from typing import Any, Mapping

from omegaconf import DictConfig, ListConfig, OmegaConf

from dit_train.config.errors import ConfigError, invalid
from dit_train.config.fields import check_fields
from dit_train.config.optimizers import optimizer_names, optimizer_schema
from dit_train.config.schemas import eval_schema
from dit_train.config.schema import (DATA_SCHEMAS, Architecture, FlowConfig, LoggerConfig, ModelConfig, ParallelConfig,
                     RunConfig, TrainConfig, VaeConfig)
from dit_train.config.latents import check_latent_run


def plain(node) -> dict:
    """A config node (DictConfig, dict or dataclass-like mapping) as a resolved plain dict."""
    if node is None:
        return {}
    if isinstance(node, (DictConfig, ListConfig)):
        return OmegaConf.to_container(node, resolve=True)
    return {k: OmegaConf.to_container(v, resolve=True) if isinstance(v, (DictConfig, ListConfig)) else v
            for k, v in dict(node).items()}


def _named(group: str, node, names) -> tuple[str, dict]:
    values = plain(node)
    name = values.get("name")
    if name not in names:
        raise invalid(f"{group}.name", name, f"choose one of {', '.join(sorted(names))}")
    return name, values


# ---- one group each ------------------------------------------------------------------------------------------
def check_optimizer(node) -> dict:
    """optimizer.* as a plain dict of checked values; missing keys take the optimizer schema's defaults."""
    name, values = _named("optimizer", node, optimizer_names())
    return check_fields("optimizer", optimizer_schema(name), values, what=f"optimizer {name!r}")


def check_data(node) -> dict:
    name, values = _named("data", node, DATA_SCHEMAS)
    return check_fields("data", DATA_SCHEMAS[name], values, what=f"data {name!r}")


def patch_choices(size: int, patch: int) -> list[int]:
    """The patch sizes that divide an image side of `size`, up to 8 or the one asked for (a larger patch leaves a
    few tokens: never what was meant)."""
    return [d for d in range(1, size + 1) if size % d == 0 and d <= max(patch, 8)]


def check_architecture(values: Mapping) -> None:
    """The DiT's keys, and what it needs of its shape (dit_train.model.dit.DiT calls this for a DiTConfig built in
    code)."""
    check_fields("model", Architecture, values)
    if values["image_size"] % values["patch_size"]:
        size, patch = values["image_size"], values["patch_size"]
        raise invalid("model.patch_size", patch, f"must divide model.image_size={size} (valid: "
                      f"{', '.join(map(str, patch_choices(size, patch)))})")
    if values["hidden_size"] % values["num_heads"]:
        raise invalid("model.num_heads", values["num_heads"], f"must divide model.hidden_size={values['hidden_size']}")
    if values["hidden_size"] % 4:
        raise invalid("model.hidden_size", values["hidden_size"], "must be divisible by 4 (2-D positions)")


def check_model(node) -> dict:
    values = check_fields("model", ModelConfig, plain(node))
    check_architecture({f: values[f] for f in Architecture.__dataclass_fields__})
    return values


def check_eval(node) -> dict:
    """eval.*, the registered metrics' nodes included; missing keys take the schemas' defaults."""
    values = check_fields("eval", eval_schema(), plain(node))
    from dit_train.evaluation.fd.encoders import ENCODERS

    if values["encoder"] not in ENCODERS:
        raise invalid("eval.encoder", values["encoder"], f"choose one of {', '.join(sorted(ENCODERS))}")
    return values


def check_parallel(node, world_size: int = 1) -> dict:
    """parallel.*; missing keys take ParallelConfig's defaults. Several processes need FSDP2."""
    values = check_fields("parallel", ParallelConfig, plain(node))
    if world_size > 1 and values["fsdp"] is False:
        raise ConfigError(f"parallel.fsdp=false is not valid with {world_size} processes: multi-process training "
                          f"is FSDP2 only; use parallel.fsdp=auto (or launch a single process)")
    replicas = values["replicate"]
    if world_size % replicas:
        raise invalid("parallel.replicate", replicas, f"must divide the world size {world_size} (HSDP: that many "
                                                      f"replicas of a model sharded over world / replicate ranks)")
    _check_reshard_size(values["reshard_after_forward"], world_size // replicas)
    return values


def _check_reshard_size(size, shard_ranks: int) -> None:
    """An int parallel.reshard_after_forward: FSDP2 keeps the gathered weights sharded over groups of that many
    ranks after forward, so it must split the shard group into smaller groups (1 and the whole group are what
    false and true say)."""
    if isinstance(size, bool):
        return
    sizes = [d for d in range(2, shard_ranks) if shard_ranks % d == 0]
    if size in sizes:
        return
    if not sizes:  # 1, 2 or a prime number of ranks: there is no range of divisors to name
        raise invalid("parallel.reshard_after_forward", size,
                      f"choose true or false: an integer must be a divisor of the shard group size {shard_ranks} "
                      f"other than 1 and {shard_ranks}, and {shard_ranks} has none")
    raise invalid("parallel.reshard_after_forward", size,
                  f"choose true, false or a divisor of the shard group size {shard_ranks} between 2 and "
                  f"{shard_ranks - 1} ({', '.join(map(str, sizes))})")


def split_batch(train, world_size: int) -> tuple[int, int]:
    """(images per forward, forwards per step) of each rank, as Trainer.forward_backward splits the rank's batch
    (train.batch_size / world_size) in pieces of train.micro_batch_size (null: one piece). Checked by check_train."""
    per_rank = train.batch_size // world_size
    micro = train.micro_batch_size or per_rank
    return micro, per_rank // micro


def check_train(node, world_size: int = 1) -> dict:
    values = check_fields("train", TrainConfig, plain(node))
    if values["batch_size"] % world_size:
        raise invalid("train.batch_size", values["batch_size"], f"must be divisible by the world size {world_size}")
    micro = values["micro_batch_size"]
    if micro is not None and (values["batch_size"] // world_size) % micro:
        raise invalid("train.micro_batch_size", micro, f"must divide the per-rank batch {values['batch_size'] // world_size} "
                                                      f"(train.batch_size={values['batch_size']} over {world_size} ranks)")
    resume = values["resume"]
    if resume not in (None, "auto") and not os.path.exists(resume):
        raise invalid("train.resume", resume, "expected null, 'auto' or an existing run folder / checkpoint file")
    if values["init_from"] is not None:
        if resume not in (None, "auto"):
            raise invalid("train.init_from", values["init_from"],
                          f"a fork starts from its weights, not from train.resume={resume}: use it with "
                          f"train.resume=null or auto (a requeued fork continues from its own checkpoints)")
        # with resume=auto a requeued fork continues from its own checkpoints, its parent perhaps deleted since:
        # config/paths.py checks the parent only while the run has none of its own (it knows run_dir)
        if resume is None and not os.path.exists(values["init_from"]):
            raise invalid("train.init_from", values["init_from"], "expected null or an existing run folder / checkpoint")
    return values


# ---- the whole run config ------------------------------------------------------------------------------------
def validate(cfg, world_size: int = 1) -> None:
    """Check a composed run config (no dataset read, no model built). Raises ConfigError, one line."""
    check_fields("", RunConfig, {k: _top_value(cfg, k) for k in cfg}, what="the run config")
    train = check_train(cfg.train, world_size)
    check_fields("flow", FlowConfig, plain(cfg.flow))
    check_parallel(cfg.parallel, world_size)
    check_fields("logger", LoggerConfig, plain(cfg.logger))
    check_optimizer(cfg.optimizer)
    model, data, ev = check_model(cfg.model), check_data(cfg.data), check_eval(cfg.eval)
    vae = check_fields("vae", VaeConfig, plain(cfg.vae))
    if not train["dry_run"]:
        if data["name"] == "latents":
            check_latent_run(model, data, vae, needs_decoding=bool(train["sample_every"] or ev["every_n_steps"]))
        elif data["name"] == "image_folder" and not os.path.isdir(str(data.get("root"))):
            # here, before Hydra makes the run folder (the dataset itself would find it only after)
            raise invalid("data.root", data.get("root"), "not a folder; image_folder needs root/<class>/<images>")
        _model_matches_data(model, data)


def _top_value(cfg, k: str) -> Any:
    if OmegaConf.is_interpolation(cfg, k):  # run_dir: ${hydra:...} resolves only inside a Hydra job
        return str(cfg._get_node(k)._value())
    node = cfg[k]
    return plain(node) if isinstance(node, DictConfig) else node


def _model_matches_data(model: dict, data: dict) -> None:
    """The model must consume what the dataset produces."""
    if model["in_channels"] != data["channels"]:
        raise invalid("model.in_channels", model["in_channels"], f"must equal data.channels={data['channels']}")
    if model["image_size"] != data["image_size"]:
        raise invalid("model.image_size", model["image_size"], f"must equal data.image_size={data['image_size']}")
    if model["num_classes"] and data["num_classes"] is not None and model["num_classes"] < data["num_classes"]:
        raise invalid("model.num_classes", model["num_classes"], f"must be >= data.num_classes={data['num_classes']}")
