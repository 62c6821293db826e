"""dit-estimate-memory on a shrunken dit_1b3 over 8 fake ranks: the persistent bytes it reports are the exact
rank-0 shard sizes (so the FSDP2 plan and the sharded optimizer really ran), and a step needs more than that."""

import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT

WORLD = 8
SHRINK = ["model.depth=2", "model.hidden_size=256", "model.num_heads=2"]


def shrunk(depth: int) -> list[str]:
    return [o for o in SHRINK if not o.startswith("model.depth=")] + [f"model.depth={depth}"]


# Every configuration the tests below read: (optimizer, flags, shrink). Each is estimated once (several tests read
# the same one), in a process forked for it from one that imported torch and the estimator once: a fresh process
# each paid that import again (~3 s of ~7 s of CPU each), and one process running them all in turn carries state
# from one estimate to the next (periodic_rowwise's persistent bytes then differ by 52 between fake and real).
# periodic_rowwise at K=2: its three steps (refresh, RowNorm, refresh) are every step kind K=3's four are.
# AdamW's fake-against-real comparison is the one on two micro-batches (test_gradient_accumulation_...).
PERIODIC = ("periodic_rowwise", "optimizer.K=2")
CONFIGS = [
    ("adamw", (), SHRINK), ("muon", (), SHRINK), (PERIODIC[0], PERIODIC[1:], SHRINK),
    (PERIODIC[0], ("--real-tensors", *PERIODIC[1:]), SHRINK),
    ("adamw", ("--micro-batches", "2"), SHRINK), ("adamw", ("--micro-batches", "2", "--real-tensors"), SHRINK),
    ("adamw", ("parallel.blocks_per_fsdp_unit=1",), shrunk(3)),
    ("adamw", ("parallel.blocks_per_fsdp_unit=2",), shrunk(5)),
    *[("adamw", (*ac, f"parallel.blocks_per_fsdp_unit={u}"), shrunk(8))
      for u in (2, 4) for ac in ((), ("--activation-checkpointing",))],
    ("adamw", ("cuda-visible",), SHRINK),  # not a flag: the child makes torch.cuda.is_available() True first
]
# runs each argv through the command's main() in a child forked for it: one JSON line per configuration, its
# printed result or the error that stopped it (a failing configuration fails the tests that read it, not all)
DRIVER = """
import contextlib, io, json, os, sys, traceback
import torch, torch.distributed.fsdp, torch._subclasses.fake_tensor, torch.distributed._tools.fsdp2_mem_tracker
import dit_train.parallel.memory_estimate, dit_train.trainer.loop, dit_train.optim.registry
from dit_train.parallel.memory_estimate_cli import main
for argv in json.loads(sys.argv[1]):
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        if "cuda-visible" in argv:
            argv.remove("cuda-visible")
            torch.cuda.is_available = lambda: True
        out = io.StringIO()
        try:
            with contextlib.redirect_stdout(out):
                result = {"rc": main(argv), "out": out.getvalue()}
        except BaseException:
            result = {"rc": "raised", "out": traceback.format_exc()}
        with os.fdopen(w, "w") as f:
            f.write(json.dumps(result))
        os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        line = f.read()
    os.waitpid(pid, 0)
    print(line or json.dumps({"rc": "died", "out": ""}), flush=True)
"""


def argv_of(optimizer: str, flags=(), shrink=SHRINK) -> list[str]:
    return ["--preset", "dit_1b3", "--world-size", str(WORLD), "--optimizer", optimizer, "--micro-batch", "2",
            "--json", *flags, *shrink]


@pytest.fixture(scope="module")
def estimates() -> dict:
    """{(optimizer, flags, shrink) of CONFIGS: the dit-estimate-memory --json result or (exit status, output)}."""
    argvs = [argv_of(o, f, s) for o, f, s in CONFIGS]
    proc = subprocess.run([sys.executable, "-c", DRIVER, json.dumps(argvs)], capture_output=True, text=True,
                          timeout=900, env={**os.environ, "PYTHONPATH": ROOT})
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith('{"rc"')]
    out = {}
    for (o, f, s), r in zip(CONFIGS, lines + [None] * len(CONFIGS)):
        key = (o, tuple(f), tuple(s))
        if r is None:
            out[key] = ("did not run", proc.stderr[-3000:])
        elif r["rc"] != 0:
            out[key] = (r["rc"], r["out"][-3000:])
        else:
            out[key] = json.loads(r["out"].strip().splitlines()[-1])
    return out


@pytest.fixture(scope="module")
def estimate(estimates):
    """estimate(optimizer, *flags, shrink=SHRINK): the result of that configuration of CONFIGS."""
    def get(optimizer: str, *flags: str, shrink=SHRINK) -> dict:
        key = (optimizer, tuple(flags), tuple(shrink))
        assert key in estimates, f"{key} is not in CONFIGS: add it there"
        r = estimates[key]
        assert isinstance(r, dict), f"dit-estimate-memory {' '.join(argv_of(optimizer, flags, shrink))}: {r}"
        return r
    return get


@pytest.mark.parametrize("depth, per_unit, last, before_last", [(3, 1, 1, 1), (8, 2, 2, 2), (5, 2, 1, 2)])
def test_the_gathered_weights_at_peak_are_the_last_unit_and_the_prefetched_one(estimate, depth, per_unit, last,
                                                                               before_last):
    """parallel.blocks_per_fsdp_unit: the peak is at the start of backward (every activation alive), where FSDP2
    holds the last unit's bf16 weights (kept gathered from forward), the all-gather output of the unit before it
    (backward's prefetch) and the root's (embedders, final layer): 2 bytes x (last + before-last units' parameters
    + the root's), each parameter's rows padded to a multiple of W as FSDP2 pads its shards. Depth 3 by 1 leaves
    one block ungathered; depth 5 by 2 ends in
    a unit of one block: the last unit kept is one block, the prefetched one two; depth 8 by 2 leaves two of its four
    units ungathered (the estimate the formula test below reads too)."""
    from omegaconf import OmegaConf

    from dit_train.model.dit import build_model, load_preset

    shrink = shrunk(depth)
    r = estimate("adamw", f"parallel.blocks_per_fsdp_unit={per_unit}", shrink=shrink)
    model = build_model(OmegaConf.merge(load_preset("dit_1b3"), OmegaConf.from_dotlist(shrink).model), device="meta")
    padded = lambda params: sum(-(-p.shape[0] // WORLD) * WORLD * (p.numel() // p.shape[0]) for p in params)
    block = padded(model.blocks[0].parameters())  # every block has the same shapes
    root = padded(p for name, p in model.named_parameters() if not name.startswith("blocks."))
    assert r["peak"]["gathered_and_comm"] == 2 * ((last + before_last) * block + root)


@pytest.mark.parametrize("checkpointing", [False, True], ids=["no AC", "AC"])
@pytest.mark.parametrize("per_unit", [2, 4])
def test_the_formula_gathers_what_the_estimator_finds_at_its_peak(estimate, per_unit, checkpointing):
    """dit-memory-formula with parallel.blocks_per_fsdp_unit against the estimator, which runs the real plan (depth
    8: units of 2 and 4 blocks). Without activation checkpointing the peak is at the start of backward, and the
    formula's gathered weights, 2 bytes x (the largest two consecutive units' blocks + the root's), are exactly the
    estimate's gathered weights and buffers there. With it the peak is late in backward, where the estimate also
    holds a reduce-scatter input (2 + 2 x per_unit blocks' bf16 bytes in all, measured): within the formula's
    working set, which adds one unit's bf16 gradient and fp32 reduce-scatter input to the gathered weights. Counts
    are each parameter's rows padded to a multiple of W, as FSDP2 pads its shards."""
    from omegaconf import OmegaConf

    from dit_train.model.dit import build_model, load_preset
    from dit_train.parallel.memory_formula import gathered_bytes, memory

    depth = 8
    shrink = shrunk(depth)
    flags = ["--activation-checkpointing"] if checkpointing else []
    r = estimate("adamw", *flags, f"parallel.blocks_per_fsdp_unit={per_unit}", shrink=shrink)
    model = build_model(OmegaConf.merge(load_preset("dit_1b3"), OmegaConf.from_dotlist(shrink).model), device="meta")
    padded = lambda params: sum(-(-p.shape[0] // WORLD) * WORLD * (p.numel() // p.shape[0]) for p in params)
    block = padded(model.blocks[0].parameters())
    c = {"depth": depth, "P_block": block, "P_root": padded(p for name, p in model.named_parameters()
                                                            if not name.startswith("blocks.")),
         "P": 0, "P_matrix": 0, "P_block_matrix": 0, "d": 0, "tokens": 0}
    seen = r["peak"]["gathered_and_comm"]
    if not checkpointing:
        assert seen == gathered_bytes(c, per_unit) == 2 * (2 * per_unit * block + c["P_root"])
    else:
        assert seen == 2 * ((2 + 2 * per_unit) * block + c["P_root"])
        assert gathered_bytes(c, per_unit) < seen <= memory(c, WORLD, 2, "adamw", True, per_unit)["working"]


def rank0_elements():
    """(every parameter's rank-0 shard elements, the matrix-routed ones) of the shrunken model: dim-0 chunks of
    ceil(rows / W), as FSDP2 shards."""
    from omegaconf import OmegaConf

    from dit_train.model.dit import build_model, load_preset
    from dit_train.optim.routing import route_parameters

    cfg = OmegaConf.merge(load_preset("dit_1b3"), OmegaConf.from_dotlist(SHRINK).model)
    model = build_model(cfg, device="meta")
    matrix = {id(p) for _, p in route_parameters(model).matrix}
    shard = lambda p: -(-p.shape[0] // WORLD) * (p.numel() // p.shape[0])
    params = list(model.parameters())
    return [shard(p) for p in params], [shard(p) for p in params if id(p) in matrix]


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_persistent_bytes_are_the_rank0_shards(estimate, optimizer):
    r = estimate(optimizer)
    every, matrix = rank0_elements()
    n_params, rest_params = len(every), len(every) - len(matrix)
    per, peak = r["persistent"], r["peak"]
    assert per["parameters"] == 4 * sum(every)  # fp32 shards: 1/8 of the model, not all of it
    assert per["ema"] == 4 * sum(every)
    if optimizer == "adamw":  # exp_avg + exp_avg_sq, and one fp32 step counter per parameter (fused AdamW)
        assert per["optimizer_state"] == 8 * sum(every) + 4 * n_params
        assert per["optimizer_workspace"] == 0
    else:  # momentum on the matrices, AdamW on the rest; the stacked bf16 NS5 input U is kept between steps
        assert per["optimizer_state"] == 4 * sum(matrix) + 8 * (sum(every) - sum(matrix)) + 4 * rest_params
        assert per["optimizer_workspace"] == 2 * sum(matrix)
    assert per["gradients"] == 0 and per["other"] >= 0  # set_to_none: no gradients between steps
    assert peak["activations"] > 0
    assert peak["total"] > per["total"] + peak["activations"] / 2


def test_fake_tensors_count_what_real_tensors_use(estimate):
    """The same steps on real tensors (the fake process group's collectives leave their outputs unfilled, which
    changes no size): the fake run sees the same persistent bytes and, within the attention kernel's saved
    statistics, the same peak. Without StepTracker ignoring propagation the fake peak counted whole copies of the
    parameters made by DTensor's sharding propagation (AdamW's fused step: 1.8x the real peak here). periodic_rowwise
    here (NS5, RowNorm and AdamW steps); AdamW alone is compared so in test_gradient_accumulation_..., on two
    micro-batches."""
    fake, real = estimate(*PERIODIC), estimate(PERIODIC[0], "--real-tensors", *PERIODIC[1:])
    assert fake["persistent"] == real["persistent"]
    assert fake["peak"]["total"] == pytest.approx(real["peak"]["total"], rel=0.02)


def test_the_study_config_fits_an_80_gb_gpu_by_the_committed_estimate():
    """conf/experiment/scaling_study at each preset's launch size and layout (HSDP, one replica per node, for the
    multi-node presets): the estimate's peak (docs/memory_estimate.jsonl, written by `dit-estimate-memory
    --table`; docs/memory_estimate_hsdp.jsonl, single runs with parallel.replicate=N) stays under the ~74.5 GiB
    usable on an 80 GB GPU."""
    import json
    import os

    from conftest import ROOT, compose

    rows = []
    for name in ("memory_estimate.jsonl", "memory_estimate_hsdp.jsonl"):  # plain FSDP; HSDP (parallel.replicate)
        with open(os.path.join(ROOT, "docs", name)) as f:
            rows += [json.loads(line) for line in f]
    replicas = lambda r: int(next((o.split("=")[1] for o in r.get("overrides", []) if o.startswith(  # noqa: E731
        "parallel.replicate=")), 1))
    for model in ("dit_1b3", "dit_4b", "dit_9b", "dit_15b"):
        cfg = compose(["experiment=scaling_study", f"model={model}", "run_dir=/tmp/unused"])
        world = cfg.model.launch.nodes * cfg.model.launch.gpus_per_node
        for opt in cfg.study.optimizers:
            row = [r for r in rows if (r["preset"], r["optimizer"], r["world_size"], r["activation_checkpointing"])
                   == (model, opt, world, cfg.parallel.activation_checkpointing)
                   and r["micro_batch"] == cfg.train.batch_size // world and replicas(r) == cfg.parallel.replicate]
            assert row, (model, opt, world)
            assert row[-1]["peak"]["total"] < 74.5 * 2**30, (model, opt, row[-1]["peak"]["total"] / 2**30)


def test_the_estimate_runs_where_cuda_is_visible(estimate):
    """On a GPU node torch.cuda.is_available() is True, and parallelize's default mesh would be a cuda mesh that the
    estimate's fake CPU shards cannot use (every gpu_check training row failed for the estimator's sake). With
    CUDA made visible on this CPU build the estimate runs and says what it says without."""
    seen = estimate("adamw", "cuda-visible")
    assert {k: seen[k] for k in ("persistent", "peak")} == {k: v for k, v in estimate("adamw").items()
                                                             if k in ("persistent", "peak")}


def test_gradient_accumulation_keeps_only_gradient_shards(estimate):
    """train.micro_batch_size: FSDP2's no-sync mode would hold the whole unsharded fp32 gradient on every rank
    until the last micro-batch (4 bytes x parameters: +56 GiB at dit_15b); the trainer's micro_batch_sync
    reduce-scatters after every micro-batch, so a second micro-batch adds at most this rank's gradient shards
    (4 bytes x its shard elements) to the peak, besides its own inputs: the trainer's step holds the rank's whole
    batch and the noise drawn for the global batch (W ranks' images), fp32, per image a timestep, a dropout flag
    and a label, and fp32 scalars for the micro-batch losses' weighting and sum. The real-tensor run of the same
    steps agrees with the fake one."""
    from dit_train.model.dit import load_preset

    every, _ = rank0_elements()
    one, two = estimate("adamw"), estimate("adamw", "--micro-batches", "2")
    shard_grad = 4 * sum(every)
    m, micro = load_preset("dit_1b3"), 2
    second_inputs = micro * (4 * m.in_channels * m.image_size**2 * (1 + WORLD) + (4 + 1) * WORLD + 8) + 4 * 4
    assert two["peak"]["gradients"] <= shard_grad
    assert one["peak"]["total"] <= two["peak"]["total"] <= one["peak"]["total"] + shard_grad + second_inputs
    real = estimate("adamw", "--micro-batches", "2", "--real-tensors")
    assert real["persistent"] == two["persistent"]
    assert two["peak"]["total"] == pytest.approx(real["peak"]["total"], rel=0.02)


def test_the_grid_is_plain_fsdp_over_its_world_size_unless_asked():
    """The scaling study runs multi-node presets as HSDP (parallel.replicate = nodes); the estimator's grid is plain
    FSDP over --world-size (rank 0 holds 1/W), and an HSDP row is one asked for with parallel.replicate=N."""
    from dit_train.parallel import memory_estimate_cli as em

    assert em.compose("dit_15b", "adamw", True).parallel.replicate == 1
    assert em.compose("dit_15b", "adamw", True, ["parallel.replicate=4"]).parallel.replicate == 4


def test_a_bad_preset_optimizer_or_override_is_one_line_and_exit_status_2(capsys):
    """Was a traceback of Hydra's (61 lines for --preset nope, exit 1)."""
    from dit_train.parallel.memory_estimate_cli import main

    for bad in (["--preset", "nope"], ["--optimizer", "sgd"]):
        with pytest.raises(SystemExit) as stop:
            main(bad)
        assert stop.value.code == 2 and "invalid choice" in capsys.readouterr().err.splitlines()[-1]
    assert main(["--preset", "dit_xs", "model.depht=2"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "error: model.depht=2 is not valid: not a key of model; valid keys: class_dropout_prob, depth, hidden_size, "
        "image_size, in_channels, launch, mlp_ratio, name, nominal_params, num_classes, num_heads, patch_size, "
        "qk_norm, swiglu, text_dim"]


def test_a_results_file_in_a_missing_folder_is_one_line_before_the_grid_runs(tmp_path, monkeypatch, capsys):
    """--table --results in a folder that does not exist ran the first configuration (minutes for a large preset),
    then failed opening the file in a traceback (found by a new-user trial)."""
    from dit_train.parallel import memory_estimate_cli as em

    def row(cmd, **kwargs):  # a configuration's subprocess, instantly: its one JSON line
        return subprocess.CompletedProcess(cmd, 0, json.dumps(
            {"preset": "dit_xs", "optimizer": "adamw", "world_size": 8, "micro_batch": 128,
             "activation_checkpointing": False, "peak": {"total": 2 ** 30}, "seconds": 1.0}) + "\n", "")

    monkeypatch.setattr(em.subprocess, "run", row)
    missing = tmp_path / "typo" / "rows.jsonl"
    assert em.main(["--table", "--presets", "dit_xs", "--world-sizes", "8", "--optimizers", "adamw",
                    "--results", str(missing)]) == 2
    assert capsys.readouterr().err == f"error: --results {missing}: the folder {tmp_path / 'typo'} does not exist\n"
    assert not (tmp_path / "typo").exists()
