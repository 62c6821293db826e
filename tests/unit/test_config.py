"""The config layer (dit_train/config): every option composes and validates, each key is declared once (its schema:
default, type, rule, doc, resume rule), the yamls are presets, and one spelling of dtypes."""

import glob
import os

import pytest
import torch
from omegaconf import OmegaConf

from conftest import CONF_DIR, compose
from dit_train import dtypes
from dit_train.config import ConfigError, group_options, load_option, validate

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


def test_optimizer_options_are_the_schemas_and_conf_has_no_shared_files():
    assert group_options("optimizer") == ["adamw", "mud", "muon", "periodic_rowwise", "rownorm"]
    assert not glob.glob(os.path.join(CONF_DIR, "_*.yaml")) and not os.path.exists(os.path.join(CONF_DIR, "optimizer"))


def test_a_schema_redeclares_an_inherited_key_only_to_change_its_default():
    """mud's gather_dtype (fp32) is the one inherited key a subclass declares again; `name` names each optimizer."""
    import dataclasses

    from dit_train.config.optimizers import optimizer_names, optimizer_schema

    OPTIMIZER_SCHEMAS = {name: optimizer_schema(name) for name in optimizer_names()}

    redeclared = {}
    for name, schema in OPTIMIZER_SCHEMAS.items():
        declaring = {}  # key -> the defaults of the classes (the composed one and its bases) that declare it
        for cls in reversed(schema.__mro__):
            if dataclasses.is_dataclass(cls):
                for k in cls.__dict__.get("__annotations__", {}):
                    declaring.setdefault(k, []).append(cls.__dataclass_fields__[k].default)
        redeclared.update({(name, k): tuple(d) for k, d in declaring.items() if len(d) > 1 and k != "name"})
    assert redeclared == {("mud", "gather_dtype"): ("bf16", "fp32")}


def test_every_key_of_every_schema_has_a_one_line_doc():
    from dit_train.config.fields import walk
    from dit_train.config.optimizers import optimizer_names, optimizer_schema

    OPTIMIZER_SCHEMAS = {name: optimizer_schema(name) for name in optimizer_names()}
    from dit_train.config.schema import DATA_SCHEMAS, SECTIONS, EvalConfig, LoggerConfig, ModelConfig, RunConfig

    schemas = [RunConfig, *SECTIONS.values(), EvalConfig, LoggerConfig, ModelConfig, *DATA_SCHEMAS.values(),
               *OPTIMIZER_SCHEMAS.values()]
    groups = set(SECTIONS) | {"model", "optimizer", "data", "eval", "logger"}  # RunConfig's nodes: their own schemas
    undocumented = [(s.__name__, path) for s in schemas for path, f, _ in walk(s)
                    if not f.metadata.get("doc") and not (s is RunConfig and path in groups)]
    assert not undocumented
    docs = [f.metadata["doc"] for s in OPTIMIZER_SCHEMAS.values() for _, f, _ in walk(s)]
    assert all("\n" not in d for d in docs)


def test_a_data_set_value_yaml_reads_as_another_folder_is_refused_with_the_quoted_form():
    """dit-fd / dit-reference-stats / dit-encode-latents --data-set KEY=VALUE: YAML values, so `root=/data/run #2`
    read /data/run (the rest a comment: silently another folder) and `root=/data/a: b` a mapping. Refused in one line
    naming the form that reads back; a folder YAML reads as typed (`=`, `,`, a quote, non-ASCII) is taken as it is."""
    from dit_train.evaluation.fd.job_config import load_data_cfg

    for typed in ("/data/run #2", "/data/a: b", "/data/ü #x: y"):
        with pytest.raises(ConfigError) as e:
            load_data_cfg("fashion_mnist", [f"root={typed}"])
        said = str(e.value)
        assert said.startswith(f"--data-set root={typed}: YAML reads root=") and "\n" not in said
        assert load_data_cfg("fashion_mnist", [said.split("in YAML quotes: ", 1)[1]]).root == typed
    for typed in ("/data/a=1,b 2", "/data/it's ü", "/data/back\\slash", "/data/x#1"):
        assert load_data_cfg("fashion_mnist", [f"root={typed}"]).root == typed
    assert load_data_cfg("fashion_mnist", ["image_size=16"]).image_size == 16  # YAML still types the value


def test_fd_evaluator_defaults_are_the_schemas(monkeypatch):
    """No second copy of the eval defaults: the evaluator built from eval=default, or from a config that leaves
    keys out, uses EvalConfig's values (cfg_scale 1.5, reference_num 2000)."""
    from dit_train.evaluation.fd import evaluator as fd_evaluator
    from dit_train.evaluation.fd.job_config import load_eval_cfg

    seen = {}

    def fake_reference(extractor, dataset, split, num, cache_dir, **kw):
        seen["reference_num"] = num
        raise RuntimeError("stop here")

    monkeypatch.setattr(fd_evaluator, "load_or_compute_reference", fake_reference)
    default = load_option("eval", "default")
    assert (default.cfg_scale, default.reference_num) == (1.5, 2000)
    for cfg in (load_eval_cfg("default", ["encoder=dinov2_random"]), {"encoder": "dinov2_random"}):
        seen.clear()
        with pytest.raises(RuntimeError, match="stop here"):
            fd_evaluator.FDEvaluator(cfg, None, "cpu", dataset=[], log=lambda *_: None)
        assert seen["reference_num"] == 2000
    from dit_train.config import check_eval

    assert check_eval({"encoder": "dinov2_random"})["cfg_scale"] == 1.5


def test_optimizer_defaults_are_the_schemas():
    """build_optimizer on a partial config fills the rest from the optimizer's schema (lr 2e-3), not from a copy in
    the registry (which had drifted to 1e-3)."""
    from dit_train.optim.registry import build_optimizer

    opt = build_optimizer(torch.nn.Linear(4, 4), {"name": "muon"})
    assert {g["lr"] for g in opt.param_groups} == {load_option("optimizer", "muon").lr} == {2e-3}


def test_library_entry_points_use_the_validator():
    from dit_train.data.datasets import build_dataset
    from dit_train.model.dit import DiT, DiTConfig
    from dit_train.parallel.fsdp import DistInfo, resolve_plan

    with pytest.raises(ConfigError, match=r"^parallel.reduce_dtype='float32' is not valid: choose one of bf16, fp32$"):
        resolve_plan({"reduce_dtype": "float32"}, DistInfo())
    with pytest.raises(ConfigError, match=r"^data.num_samples=0 is not valid: expected an integer >= 1$"):
        build_dataset({"name": "synthetic", "num_samples": 0}, "train")
    with pytest.raises(ConfigError, match=r"^model.depth=0 is not valid: expected an integer >= 1$"):
        DiT(DiTConfig(depth=0))


def test_registries_and_schemas_name_the_same_things():
    from dit_train.config.schema import DATA_SCHEMAS, LR_SCHEDULES
    from dit_train.data.datasets import DATASETS
    from dit_train.optim.registry import OPTIMIZERS
    from dit_train.optim.schedule import DECAYS

    assert set(OPTIMIZERS) == set(group_options("optimizer"))
    assert set(DATASETS) == set(DATA_SCHEMAS) == set(group_options("data"))
    assert set(DECAYS) == set(LR_SCHEDULES)


def test_every_encoder_name_has_a_builder_and_every_builder_a_name():
    from dit_train.evaluation.fd.encoders import ENCODERS
    from dit_train.evaluation.fd.features import available_extractors

    assert sorted(ENCODERS) == available_extractors()


def test_shipped_directions_name_the_configs_the_catalog_composes():
    from dit_train.optim.catalog import DIRECTION_CONFIGS
    from dit_train.optim.registry import DIRECTIONS

    assert set(DIRECTIONS) == set(DIRECTION_CONFIGS)
    assert all(DIRECTIONS[n].Config is DIRECTION_CONFIGS[n] for n in DIRECTIONS)


def test_schemas_are_omegaconf_structured_configs():
    from dit_train.config.schema import (DATA_SCHEMAS, EvalConfig, FlowConfig, LoggerConfig, ModelConfig,
                                         ParallelConfig, TrainConfig)
    from dit_train.optim.registry import OPTIMIZERS

    for schema in [EvalConfig, FlowConfig, LoggerConfig, ModelConfig, ParallelConfig, TrainConfig,
                   *DATA_SCHEMAS.values(), *(entry.config for entry in OPTIMIZERS.values())]:
        node = OmegaConf.structured(schema)
        assert set(node) == set(schema.__dataclass_fields__)


def test_every_dtype_key_takes_the_declared_names_only_and_lists_them_in_one_order():
    """Each *dtype / precision key accepts a subset of dit_train.dtypes' names (or auto) and refuses torch's
    spellings in one line that lists its names in the declared order (reduce_dtype listed 'fp32, bf16' and
    gather_dtype 'bf16, fp32': the names were declared in four places)."""
    from dit_train.config.fields import accepted
    from dit_train.config.schemas import every_key
    from dit_train.dtypes import DTYPE_NAMES

    keys = [(path, f, tp) for path, f, tp in every_key() if path.endswith(("dtype", "precision"))]
    assert {p for p, _, _ in keys} >= {"train.precision", "parallel.mixed_precision", "parallel.reduce_dtype",
                                       "optimizer.gather_dtype", "optimizer.ns_dtype"}
    for path, f, tp in keys:
        rule = f.metadata["rule"]
        names = [n for n in DTYPE_NAMES if rule.ok(n)]
        assert names and all(not rule.ok(v) for v in ("bfloat16", "torch.bfloat16", "BF16", "float32", "half")), path
        said = accepted(f, tp)
        assert [n for n in DTYPE_NAMES if n in said] == names, (path, said)
        assert sorted(names, key=said.index) == names, (path, said)  # the declared order


def test_one_spelling_of_dtypes_in_every_option():
    """Every *dtype / precision key of every option (schemas and preset yamls) says bf16, fp32 or fp64 (or auto)."""
    found = 0
    options = [(f"{g}={o}", OmegaConf.to_container(load_option(g, o))) for g in ("optimizer", "data", "eval")
               for o in group_options(g)]
    options.append(("the run config", OmegaConf.to_container(compose(["run_dir=/tmp/unused"]))))
    options += [(os.path.relpath(path, CONF_DIR), OmegaConf.to_container(OmegaConf.load(path)))
                for path in glob.glob(os.path.join(CONF_DIR, "**", "*.yaml"), recursive=True)]

    def walk(node, where):
        nonlocal found
        for k, v in (node.items() if isinstance(node, dict) else []):
            if isinstance(v, dict):
                walk(v, f"{where}.{k}")
            elif str(k).endswith(("dtype", "precision")):
                found += 1
                assert v in (*dtypes.DTYPE_NAMES, "auto"), f"{where}.{k}={v!r}"

    for where, node in options:
        walk(node, where)
    assert found >= 6


def test_sweeps_expand_to_the_jobs_hydra_runs_in_its_order():
    """--multirun lists expand to their product in command-line order (the first key slowest, as Hydra's basic
    sweeper runs them; swept values in Hydra's spelling, 1e-3 -> 0.001), quoting kept; a sweep Hydra's basic
    sweeper cannot run is one line."""
    from dit_train.config.command_line import job_overrides

    assert job_overrides(["model=dit_xs", "optimizer.lr=1e-3"]) == [["model=dit_xs", "optimizer.lr=1e-3"]]
    assert job_overrides(["optimizer=adamw,muon", "seed=0", "optimizer.lr=1e-3,3e-3"]) == [
        ["optimizer=adamw", "seed=0", "optimizer.lr=0.001"], ["optimizer=adamw", "seed=0", "optimizer.lr=0.003"],
        ["optimizer=muon", "seed=0", "optimizer.lr=0.001"], ["optimizer=muon", "seed=0", "optimizer.lr=0.003"]]
    assert job_overrides(["seed=range(0,2)", "logger.wandb.name='a b'"]) == [
        ["seed=0", "logger.wandb.name='a b'"], ["seed=1", "logger.wandb.name='a b'"]]
    with pytest.raises(ConfigError, match=r"^optimizer.lr: only lists of values"):
        job_overrides(["optimizer.lr=interval(0.1,0.2)"])


@pytest.mark.parametrize("seed", [-1, -(2 ** 80), 2 ** 80])
def test_any_integer_is_a_seed_and_the_help_says_so(seed):
    """`seed`'s --help line did not say a negative or huge seed works (a new-user trial asked): every stream's seed
    is a 63-bit hash of it (dit_train/seeds.py), so any integer is valid and gives streams of its own."""
    from dit_train import seeds
    from dit_train.config.help_text import key_docs

    cfg = compose([f"seed={seed}", "run_dir=/tmp/x"])
    validate(cfg, 1)
    assert cfg.seed == seed
    drawn = {s: seeds.seed_for("train_noise", s) for s in (seed, 0)}
    assert drawn[seed] != drawn[0] and all(0 <= v < 2 ** 63 for v in drawn.values())
    assert "any integer, negative or large too" in key_docs(cfg)["seed"]
