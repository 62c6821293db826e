"""The config layer (dit_train/config): every shipped yaml composes and validates, defaults live once (in the
yamls), each optimizer yaml holds only its own keys, and one spelling of dtypes."""

import glob
import os

import pytest
import torch
from omegaconf import OmegaConf

from conftest import CONF_DIR, compose
from dit_train.config import ConfigError, DTYPE_NAMES, group_options, load_option, validate

GROUPS = ["model", "optimizer", "data", "eval", "logger", "experiment"]
MATRIX_OPTIMIZERS = ["muon", "periodic_rowwise", "rownorm", "mud"]


def _options():
    return [(g, o) for g in GROUPS for o in group_options(g)]


@pytest.mark.parametrize("group,option", _options())
def test_every_yaml_composes_and_validates(group, option):
    """Each option composes as `group=option` and passes the validator. dry_run skips the model-vs-data match
    (a latent preset is not meant for Fashion-MNIST); data.root stands in for the folders a user must give."""
    overrides = [f"{group}={option}", "run_dir=/tmp/unused", "train.dry_run=true"]
    cfg = compose(overrides)
    if OmegaConf.to_container(cfg.data).get("root") == "???":
        cfg = compose(overrides + ["data.root=/tmp"])
    validate(cfg)


def test_default_and_study_configs_validate_with_the_model_matching_the_data():
    validate(compose(["run_dir=/tmp/unused"]))
    for name in ("scaling_study_cpu", "lr_scan_cpu", "scaling_study_cpu_tuned", "smoke"):
        validate(compose([f"experiment={name}", "run_dir=/tmp/unused"]))


def test_shared_yamls_are_not_options():
    assert group_options("optimizer") == ["adamw", "mud", "muon", "periodic_rowwise", "rownorm"]
    assert os.path.exists(os.path.join(CONF_DIR, "_optimizer_matrix_base.yaml"))


def test_each_optimizer_yaml_holds_only_its_own_keys():
    """A key of a shared file appears in an optimizer's own yaml only to change its value (mud's gather_dtype),
    and no key is repeated with one value across all matrix optimizer yamls (it belongs in _optimizer_matrix_base.yaml)."""
    own = {name: OmegaConf.to_container(OmegaConf.load(os.path.join(CONF_DIR, "optimizer", f"{name}.yaml")))
           for name in group_options("optimizer")}
    for name, raw in own.items():
        parents = raw.pop("defaults")
        inherited = OmegaConf.to_container(load_option("optimizer", [p for p in parents if p != "_self_"][0]))
        repeated = {k for k, v in raw.items() if k != "name" and k in inherited and inherited[k] == v}
        assert not repeated, f"{name}.yaml repeats {sorted(repeated)} from its defaults"
    shared_by_all = set.intersection(*(set(own[n]) for n in MATRIX_OPTIMIZERS)) - {"name"}
    assert not {k for k in shared_by_all if len({repr(own[n][k]) for n in MATRIX_OPTIMIZERS}) == 1}
    assert set(own["rownorm"]) == {"name"} and set(own["adamw"]) == {"name"}


def test_fd_evaluator_defaults_are_the_yamls(monkeypatch):
    """No second copy of the eval defaults: the evaluator built from conf/eval/default.yaml, or from a config
    that leaves keys out, uses default.yaml's values (cfg_scale 1.5, reference_num 2000)."""
    from dit_train.evaluation.fd import evaluator as fd_evaluator
    from dit_train.evaluation.fd.job_config import load_eval_cfg

    seen = {}

    def fake_reference(extractor, dataset, split, num, cache_dir, **kw):
        seen["reference_num"] = num
        raise RuntimeError("stop here")

    monkeypatch.setattr(fd_evaluator, "load_or_compute_reference", fake_reference)
    default = OmegaConf.load(os.path.join(CONF_DIR, "eval", "default.yaml"))
    assert (default.cfg_scale, default.reference_num) == (1.5, 2000)
    for cfg in (load_eval_cfg("default", ["encoder=dinov2_random"]), {"encoder": "dinov2_random"}):
        seen.clear()
        with pytest.raises(RuntimeError, match="stop here"):
            fd_evaluator.FDEvaluator(cfg, None, "cpu", dataset=[], log=lambda *_: None)
        assert seen["reference_num"] == 2000
    from dit_train.config import check_eval

    assert check_eval({"encoder": "dinov2_random"})["cfg_scale"] == 1.5


def test_optimizer_defaults_are_the_yamls():
    """build_optimizer on a partial config fills the rest from conf/optimizer/<name>.yaml (lr 2e-3), not from a
    copy in the registry (which had drifted to 1e-3)."""
    from dit_train.optim.registry import build_optimizer

    opt = build_optimizer(torch.nn.Linear(4, 4), {"name": "muon"})
    assert {g["lr"] for g in opt.param_groups} == {load_option("optimizer", "muon").lr} == {2e-3}


def test_library_entry_points_use_the_validator():
    from dit_train.data import build_dataset
    from dit_train.model.dit import DiT, DiTConfig
    from dit_train.parallel.fsdp import DistInfo, resolve_plan

    with pytest.raises(ConfigError, match=r"^parallel.reduce_dtype='float32' is not valid: choose one of fp32, bf16$"):
        resolve_plan({"reduce_dtype": "float32"}, DistInfo())
    with pytest.raises(ConfigError, match=r"^data.num_samples=0 is not valid: expected an integer >= 1$"):
        build_dataset({"name": "synthetic", "num_samples": 0}, "train")
    with pytest.raises(ConfigError, match=r"^model.depth=0 is not valid: expected an integer >= 1$"):
        DiT(DiTConfig(depth=0))


def test_registries_and_schemas_name_the_same_things():
    from dit_train.config.schema import DATA_SCHEMAS, LR_SCHEDULES
    from dit_train.data import DATASETS
    from dit_train.optim.registry import OPTIMIZERS
    from dit_train.optim.schedule import DECAYS

    assert set(OPTIMIZERS) == set(group_options("optimizer"))
    assert set(DATASETS) == set(DATA_SCHEMAS) == set(group_options("data"))
    assert set(DECAYS) == set(LR_SCHEDULES)


def test_schemas_are_omegaconf_structured_configs():
    from dit_train.config.schema import (DATA_SCHEMAS, EvalConfig, FlowConfig, LoggerConfig, ModelConfig,
                                         ParallelConfig, TrainConfig)
    from dit_train.optim.registry import OPTIMIZERS

    for schema in [EvalConfig, FlowConfig, LoggerConfig, ModelConfig, ParallelConfig, TrainConfig,
                   *DATA_SCHEMAS.values(), *(entry.config for entry in OPTIMIZERS.values())]:
        node = OmegaConf.structured(schema)
        assert set(node) == set(schema.__dataclass_fields__)


def test_one_spelling_of_dtypes_in_every_yaml():
    """Every *dtype / precision key in conf/ says bf16, fp32 or fp64 (or auto)."""
    found = 0
    for path in glob.glob(os.path.join(CONF_DIR, "**", "*.yaml"), recursive=True):
        def walk(node, where):
            nonlocal found
            for k, v in (node.items() if isinstance(node, dict) else []):
                if isinstance(v, dict):
                    walk(v, f"{where}.{k}")
                elif str(k).endswith(("dtype", "precision")):
                    found += 1
                    assert v in (*DTYPE_NAMES, "auto"), f"{path}: {where}.{k}={v!r}"
        walk(OmegaConf.to_container(OmegaConf.load(path)), os.path.relpath(path, CONF_DIR))
    assert found >= 6
