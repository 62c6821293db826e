"""The optimizer registry (docs/algorithms.md §2, §4, §5): config validation, exact update maths, parity with
torch.optim.Muon / torch.optim.AdamW, the periodic schedule, state_dict round trips, LR schedules, training."""

import copy
import io
import json
import math

import pytest
import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from dit_train.model.dit import DiT, DiTConfig
from dit_train.optim import fused_rownorm
from dit_train.optim.directions import NS5, RowNorm
from dit_train.optim.matrix_optimizer import MatrixOptimizer, update_scale
from dit_train.optim.hooks import hooks_of
from dit_train.optim.registry import OPTIMIZERS, build_optimizer

NAMES = ["adamw", "muon", "periodic_rowwise", "rownorm", "mud"]


pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


def tiny_dit(seed=0, perturb=False, **kw):
    """A small DiT. perturb=True moves the adaLN-Zero weights off zero so every matrix has a gradient at step 0."""
    torch.manual_seed(seed)
    cfg = dict(image_size=8, in_channels=1, patch_size=2, hidden_size=32, depth=2, num_heads=2, num_classes=4)
    cfg.update(kw)
    model = DiT(DiTConfig(**cfg))
    if perturb:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.05 * torch.randn_like(p))
    return model


def flow_batch(seed, n=8, size=8):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 1, size, size, generator=g)
    return x, torch.rand(n, generator=g), torch.randn(n, 1, size, size, generator=g), torch.randint(0, 4, (n,), generator=g)


def flow_loss(model, batch):
    x, t, eps, y = batch
    tt = t.view(-1, 1, 1, 1)
    return ((model((1 - tt) * x + tt * eps, t, y) - (eps - x)) ** 2).mean()


def train(model, opt, steps, seed=0, sched=None):
    losses = []
    for s in range(steps):
        loss = flow_loss(model, flow_batch(seed * 1000 + s))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if sched is not None:
            sched.step()
        losses.append(loss.item())
    return losses


def params_of(model):
    return [p.detach().clone() for p in model.parameters()]


# ---- registry and config validation ----------------------------------------------------------------------------
def test_registry_names_and_unknown_name():
    assert sorted(OPTIMIZERS) == sorted(NAMES)
    with pytest.raises(ValueError) as e:
        build_optimizer(tiny_dit(), {"name": "lion"})
    msg = str(e.value)
    assert "\n" not in msg and "'lion'" in msg and all(n in msg for n in NAMES)


@pytest.mark.parametrize("name,key,value,valid", [
    ("periodic_rowwise", "K", 0, "integer >= 1"),
    ("periodic_rowwise", "K", 2.5, "integer >= 1"),
    ("periodic_rowwise", "K", True, "integer >= 1"),
    ("periodic_rowwise", "K", "3", "integer >= 1"),
    ("muon", "lr", 0.0, "> 0"),
    ("adamw", "lr", -1e-3, "> 0"),
    ("muon", "momentum", 1.0, "[0, 1)"),
    ("muon", "scale", "kimi", "moonlight, keller, none"),
    ("muon", "ns_dtype", "int8", "bf16, fp32, fp64"),
    ("muon", "ns_steps", 0, "integer >= 1"),
    ("mud", "mud_passes", 0, "integer >= 1"),
    ("mud", "mud_solve", "qr", "triangular, inverse"),
    ("adamw", "betas", [0.9], "two numbers"),
    ("rownorm", "weight_decay", -0.1, ">= 0"),
    ("rownorm", "nesterov", "yes", "true or false"),
    ("muon", "matrix_patterns", "blocks", "list of dotted name patterns"),
])
def test_bad_values_are_one_line_errors_naming_key_value_and_valid_range(name, key, value, valid):
    with pytest.raises(ValueError) as e:
        build_optimizer(tiny_dit(), {"name": name, key: value})
    msg = str(e.value)
    assert "\n" not in msg and f"optimizer.{key}={value!r}" in msg and valid in msg, msg


@pytest.mark.parametrize("name,key", [("muon", "weight_decy"), ("rownorm", "K"), ("adamw", "momentum")])
def test_unknown_keys_are_rejected_with_the_valid_ones(name, key):
    with pytest.raises(ValueError) as e:
        build_optimizer(tiny_dit(), {"name": name, key: 1})
    msg = str(e.value)
    assert "\n" not in msg and f"optimizer.{key}" in msg and "valid keys: " in msg and "lr" in msg


@pytest.mark.parametrize("name", NAMES)
def test_config_files_compose_and_build(name):
    """The optimizer's schema composes through Hydra as `optimizer=<name>`, lists every hyperparameter the
    builder accepts, and builds an optimizer with a routing table and step_info."""
    from conftest import compose

    from dit_train.config import load_option
    from dit_train.optim.registry import config_class

    raw = load_option("optimizer", name)
    assert raw.name == name
    assert set(raw) == set(config_class(name).__dataclass_fields__)
    cfg = compose([f"optimizer={name}"]).optimizer
    opt = build_optimizer(tiny_dit(), cfg)
    assert isinstance(opt, torch.optim.Optimizer)
    assert "| matrix |" in opt.routing_table and isinstance(hooks_of(opt).step_info(), dict)
    assert all("lr" in g for g in opt.param_groups)


def test_added_optimizer_is_one_registry_line(monkeypatch):
    """Any torch optimizer (Entry: its Config and a builder) and a new matrix schedule (matrix(...)) are one line
    each; a plain torch optimizer gets the no-op trainer hooks."""
    from dit_train.config import load_option
    from dit_train.optim.directions import MUD
    from dit_train.optim.optimizer_config import AdamWConfig
    from dit_train.optim.registry import Entry, matrix

    monkeypatch.setitem(OPTIMIZERS, "sgd", Entry(AdamWConfig, lambda model, c: torch.optim.SGD(model.parameters(),
                                                                                               lr=c["lr"])))
    opt = build_optimizer(tiny_dit(), {"name": "sgd", "lr": 0.1, "weight_decay": 0.0, "betas": [0.9, 0.999],
                                       "eps": 1e-8, "adamw_impl": "fused"})
    assert isinstance(opt.routing_table, str) and hooks_of(opt).step_info() == {}

    monkeypatch.setitem(OPTIMIZERS, "periodic_mud", matrix("periodic_mud", MUD, between=RowNorm))
    model = tiny_dit(perturb=True)
    opt = build_optimizer(model, {**load_option("optimizer", "mud"), "name": "periodic_mud", "K": 2})
    train(model, opt, 3)
    assert opt.step_info() == {"opt/refresh": 1.0} and "mud when step % 2 == 0" in opt.routing_table


def test_a_placement_key_declared_once_reaches_the_sharded_optimizer(monkeypatch):
    """A key declared with placement=True in an optimizer's Config is passed to the sharded implementation, and only
    there, with no list to extend: a toy key on a new optimizer. The real keys are exactly the sharded optimizer's
    keyword-only arguments (its signature, not a copy of the list)."""
    import inspect
    from dataclasses import dataclass

    from dit_train.config.fields import int_at_least
    from dit_train.optim import registry
    from dit_train.optim.directions import NS5
    from dit_train.optim.sharded_optimizer import ShardedMatrixOptimizer

    keywords = {n for n, p in inspect.signature(ShardedMatrixOptimizer.__init__).parameters.items()
                if p.kind is inspect.Parameter.KEYWORD_ONLY}
    assert set(registry.placement_keys(OPTIMIZERS["muon"].config)) == keywords
    assert registry.placement_keys(OPTIMIZERS["adamw"].config) == ()

    @dataclass(kw_only=True)
    class ChunkedConfig(OPTIMIZERS["muon"].config):
        exchange_chunks: int = int_at_least(1, default=2, placement=True, doc="a toy placement key")

    class Stop(Exception):
        pass

    seen = {}

    class Recorder(ShardedMatrixOptimizer):  # records what the registry passes, builds nothing
        def __init__(self, params, *, exchange_chunks, **kwargs):
            seen.update(kwargs, exchange_chunks=exchange_chunks)
            raise Stop

    monkeypatch.setattr(registry, "ShardedMatrixOptimizer", Recorder)
    monkeypatch.setitem(OPTIMIZERS, "chunked", registry.Entry(ChunkedConfig, lambda model, c: registry.build_matrix(
        model, c, name="chunked", direction=NS5.from_config(c))))
    cfg = {"name": "chunked", "exchange_chunks": 5, "distributed_mode": "gather"}
    single = build_optimizer(tiny_dit(), cfg)  # one process: plain MatrixOptimizer, which takes no such keyword
    assert type(single) is MatrixOptimizer
    sharded = tiny_dit()
    for p in sharded.parameters():  # what the registry looks for on FSDP2's DTensor shards
        p.to_local = lambda: None
    with pytest.raises(Stop):
        build_optimizer(sharded, cfg)
    assert seen["exchange_chunks"] == 5 and seen["distributed_mode"] == "gather"
    assert {"bucket_mb", "gather_dtype", "overlap_exchange"} <= set(seen)


# ---- exact update maths ------------------------------------------------------------------------------------------
def _rownorm_ref(U):
    """Independent RowNorm: rows of the min(m, n) side."""
    if U.shape[0] > U.shape[1]:
        return (U.T / U.T.norm(dim=1, keepdim=True)).T
    return U / U.norm(dim=1, keepdim=True)


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("scale", ["moonlight", "keller", "none"])
def test_momentum_nesterov_scale_and_weight_decay_exact(nesterov, scale):
    """rownorm has a closed form, so the whole matrix step is checked in fp64 against the spec: M = mu M + G,
    U = G + mu M (or M), W <- (1 - lr wd) W - lr s(W) R(U)."""
    shapes = [(6, 20), (20, 6), (8, 8)]
    W0 = [torch.randn(*s, dtype=torch.float64) for s in shapes]
    params = [nn.Parameter(w.clone()) for w in W0]
    lr, wd, mu = 0.03, 0.1, 0.9
    opt = MatrixOptimizer([{"params": params, "kind": "matrix"}], lr=lr, weight_decay=wd, momentum=mu,
                          nesterov=nesterov, scale=scale, direction=RowNorm("frobenius"))
    W, M = [w.clone() for w in W0], [torch.zeros_like(w) for w in W0]
    g = torch.Generator().manual_seed(3)
    for _ in range(4):
        grads = [torch.randn(*s, generator=g, dtype=torch.float64) for s in shapes]
        for p, gr in zip(params, grads):
            p.grad = gr.clone()
        opt.step()
        for i, (m, n) in enumerate(shapes):
            M[i] = mu * M[i] + grads[i]
            U = grads[i] + mu * M[i] if nesterov else M[i]
            s = {"moonlight": 0.2 * math.sqrt(max(m, n)), "keller": math.sqrt(max(1, m / n)), "none": 1.0}[scale]
            W[i] = (1 - lr * wd) * W[i] - lr * s * _rownorm_ref(U)
        for p, w in zip(params, W):
            torch.testing.assert_close(p.detach(), w, atol=1e-12, rtol=1e-12)
    assert update_scale("moonlight", 512, 2048) == pytest.approx(0.2 * math.sqrt(2048))
    assert update_scale("keller", 2048, 512) == 2.0 and update_scale("keller", 512, 2048) == 1.0



@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_without_nesterov_the_direction_input_is_the_momentum_itself(compiled):
    """U = M without Nesterov, formed from the stored (1 - mu) M as buffer / (1 - mu). The directions ignore U's
    scale except at their eps floor, so the check sits there: after one step M = G, and rows of norm 5e-7 (above
    RowNorm's eps 1e-7) come out unit rows; the buffer (1 - mu) G, of norm 5e-8, would be floored at eps."""
    if compiled and fused_rownorm.cpp_compiler() is None:
        pytest.skip("no C++ compiler on PATH: inductor cannot build the CPU kernels")
    lr = 0.01
    G = torch.randn(4, 16, generator=torch.Generator().manual_seed(0))
    G = 5e-7 * G / G.norm(dim=1, keepdim=True)
    p = nn.Parameter(torch.zeros(4, 16))
    opt = MatrixOptimizer([p], lr=lr, momentum=0.9, nesterov=False, scale="none",
                          direction=RowNorm("frobenius", compiled))
    p.grad = G.clone()
    opt.step()
    torch.testing.assert_close(p.detach(), -lr * G / G.norm(dim=1, keepdim=True))


def test_a_group_added_later_joins_at_the_current_step():
    """add_param_group after two steps: the new group's counter starts at 2, so its periodic schedule stays the
    others' (K = 3: the next step is a between step for both, not a refresh for the new one)."""
    a, b = nn.Parameter(torch.randn(8, 8)), nn.Parameter(torch.randn(8, 8))
    opt = MatrixOptimizer([{"params": [a], "kind": "matrix"}], lr=1e-3, direction=NS5(),
                          between=RowNorm("frobenius"), refresh_every=3)
    for _ in range(2):
        a.grad = torch.randn(8, 8)
        opt.step()
    opt.add_param_group({"params": [b], "kind": "matrix"})
    assert [g["step"] for g in opt.param_groups] == [2, 2]
    a.grad, b.grad = torch.randn(8, 8), torch.randn(8, 8)
    opt.step()
    assert opt.step_info() == {"opt/refresh": 0.0} and [g["step"] for g in opt.param_groups] == [3, 3]

@pytest.mark.parametrize("scale,adjust_lr_fn", [("keller", "original"), ("moonlight", "match_rms_adamw")])
@pytest.mark.parametrize("nesterov", [True, False])
def test_muon_parity_with_torch_optim_muon(scale, adjust_lr_fn, nesterov):
    """Same gradients, step for step: our muon equals torch.optim.Muon within bf16 tolerance. torch keeps its
    momentum as an EMA (lerp: B = (1 - mu) M), which NS5's normalisation cancels; what remains is bf16 rounding
    (torch's own result moves by ~2% when its input is scaled by 0.05)."""
    shapes = [(32, 96), (96, 32), (48, 48), (32, 96), (64, 256)]
    W0 = [torch.randn(*s) * 0.1 for s in shapes]
    ours_p = [nn.Parameter(w.clone()) for w in W0]
    ref_p = [nn.Parameter(w.clone()) for w in W0]
    ours = MatrixOptimizer([{"params": ours_p, "kind": "matrix"}], lr=0.02, weight_decay=0.1, scale=scale,
                           nesterov=nesterov)
    ref = torch.optim.Muon(ref_p, lr=0.02, weight_decay=0.1, nesterov=nesterov, adjust_lr_fn=adjust_lr_fn)
    g = torch.Generator().manual_seed(1)
    for _ in range(6):  # two independent runs on the same gradient sequence
        grads = [torch.randn(*s, generator=g) for s in shapes]
        before_ours = [p.detach().clone() for p in ours_p]
        before_ref = [p.detach().clone() for p in ref_p]
        for a, b, gr in zip(ours_p, ref_p, grads):
            a.grad, b.grad = gr.clone(), gr.clone()
        ours.step()
        ref.step()
        for a, b, wa, wb in zip(ours_p, ref_p, before_ours, before_ref):
            d_ours, d_ref = a.detach() - wa, b.detach() - wb
            assert ((d_ours - d_ref).norm() / d_ref.norm()).item() < 0.05
    for a, b, w in zip(ours_p, ref_p, W0):  # and where the six steps ended up
        assert ((a.detach() - b.detach()).norm() / (b.detach() - w).norm()).item() < 0.03
        # both keep the momentum as the EMA (1 - mu) M, updated by the same lerp: bit for bit equal
        assert torch.equal(ours.state[a]["momentum_buffer"], ref.state[b]["momentum_buffer"])


def test_muon_parity_fails_for_the_wrong_scale_rule():
    """The parity check can fail: moonlight against torch's 'original' rule is far off."""
    W0 = torch.randn(32, 96) * 0.1
    a, b = nn.Parameter(W0.clone()), nn.Parameter(W0.clone())
    ours = MatrixOptimizer([a], lr=0.02, scale="moonlight")
    ref = torch.optim.Muon([b], lr=0.02, weight_decay=0.0, adjust_lr_fn="original")
    a.grad = b.grad = torch.randn(32, 96)
    ours.step()
    ref.step()
    assert ((a - W0).norm() / (b - W0).norm()).item() > 1.5


@pytest.mark.parametrize("impl", ["fused", "foreach", "single"])
def test_adamw_equals_torch_adamw_exactly(impl):
    m1, m2 = tiny_dit(1), tiny_dit(1)
    ours = build_optimizer(m1, {"name": "adamw", "lr": 3e-3, "weight_decay": 0.05, "betas": [0.9, 0.99],
                                "adamw_impl": impl})
    kw = {"fused": {"fused": True}, "foreach": {"foreach": True}, "single": {"foreach": False}}[impl]
    ref = torch.optim.AdamW(m2.parameters(), lr=3e-3, weight_decay=0.05, betas=(0.9, 0.99), **kw)
    train(m1, ours, 4)
    train(m2, ref, 4)
    for a, b in zip(m1.parameters(), m2.parameters()):
        assert torch.equal(a, b)


def test_matrix_groups_reject_fsdp_shards_with_a_clear_error():
    class Shard(nn.Parameter):  # stands in for a DTensor (has to_local)
        def to_local(self):
            return self

    with pytest.raises(TypeError, match="sharded implementation"):
        MatrixOptimizer([{"params": [Shard(torch.zeros(4, 4))], "kind": "matrix"}], lr=1e-3)
    MatrixOptimizer([{"params": [Shard(torch.zeros(4, 4))], "kind": "adamw"}], lr=1e-3)  # AdamW groups are fine


def test_matrix_and_adamw_groups_share_lr_and_wd():
    model = tiny_dit()
    opt = build_optimizer(model, {"name": "muon", "lr": 2e-3, "weight_decay": 0.02})
    kinds = {g["kind"]: g for g in opt.param_groups}
    assert set(kinds) == {"matrix", "adamw"}
    assert kinds["matrix"]["lr"] == kinds["adamw"]["lr"] == 2e-3
    assert kinds["matrix"]["weight_decay"] == kinds["adamw"]["weight_decay"] == 0.02
    opt = build_optimizer(model, {"name": "muon", "lr": 2e-2, "scale": "keller", "adamw_lr": 3e-4})
    assert {g["kind"]: g["lr"] for g in opt.param_groups} == {"matrix": 2e-2, "adamw": 3e-4}


# ---- periodic_rowwise --------------------------------------------------------------------------------------------
def test_periodic_k1_is_muon_exactly():
    m1, m2 = tiny_dit(2), tiny_dit(2)
    o1 = build_optimizer(m1, {"name": "muon"})
    o2 = build_optimizer(m2, {"name": "periodic_rowwise", "K": 1})
    train(m1, o1, 5)
    train(m2, o2, 5)
    for a, b in zip(m1.parameters(), m2.parameters()):
        assert torch.equal(a, b)
    assert o2.step_info() == {"opt/refresh": 1.0}


def _matrix_row_norms_exact(model, before, lr):
    """True if every matrix update (wd = 0) has all rows of its min side at norm lr * s: a RowNorm step."""
    out = []
    for (name, p), w in zip(model.named_parameters(), before):
        if name == "blocks.0.attn.qkv.weight":
            d = (p.detach() - w).double()
            d = d.T if d.shape[0] > d.shape[1] else d
            s = update_scale("moonlight", *p.shape)
            out.append(torch.allclose(d.norm(dim=1), torch.full((d.shape[0],), lr * s, dtype=torch.float64),
                                      rtol=1e-4))
    return all(out)


def test_periodic_schedule_and_its_step_counter_survive_state_dict():
    """K = 3: refresh (NS5) at t = 0, 3, 6, RowNorm otherwise; resuming from a state_dict saved after t = 1
    continues the same schedule and reproduces the uninterrupted run bit for bit."""
    lr = 1e-3  # frobenius: every row of a RowNorm update has norm lr * s exactly (spectral may scale it down)
    cfg = {"name": "periodic_rowwise", "K": 3, "lr": lr, "weight_decay": 0.0, "rownorm_scale": "frobenius"}
    model = tiny_dit(3, perturb=True)
    opt = build_optimizer(model, cfg)
    flags, rownorm_like = [], []
    for s in range(7):
        before = params_of(model)
        train(model, opt, 1, seed=s)
        flags.append(opt.step_info()["opt/refresh"])
        rownorm_like.append(_matrix_row_norms_exact(model, before, lr))
    assert flags == [1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 1.0]
    assert rownorm_like == [f == 0.0 for f in flags]  # the non-refresh steps really are RowNorm steps

    ref_model = tiny_dit(3)
    ref_opt = build_optimizer(ref_model, cfg)
    model = tiny_dit(3)
    opt = build_optimizer(model, cfg)
    for s in range(2):
        train(ref_model, ref_opt, 1, seed=s)
        train(model, opt, 1, seed=s)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    model2 = tiny_dit(99)
    model2.load_state_dict(saved["model"])
    opt2 = build_optimizer(model2, cfg)
    opt2.load_state_dict(saved["opt"])
    flags2 = []
    for s in range(2, 7):
        train(ref_model, ref_opt, 1, seed=s)
        train(model2, opt2, 1, seed=s)
        flags2.append(opt2.step_info()["opt/refresh"])
    assert flags2 == flags[2:]
    for a, b in zip(ref_model.parameters(), model2.parameters()):
        assert torch.equal(a, b)


# ---- every optimizer: state_dict, LR schedule, zero gradients, training -----------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_state_dict_round_trip(name):
    cfg = {"name": name, "lr": 3e-3, "weight_decay": 0.01}
    if name == "periodic_rowwise":
        cfg["K"] = 2
    m1 = tiny_dit(4)
    o1 = build_optimizer(m1, cfg)
    train(m1, o1, 3)
    m2 = copy.deepcopy(m1)
    o2 = build_optimizer(m2, cfg)
    buf = io.BytesIO()
    torch.save(o1.state_dict(), buf)
    buf.seek(0)
    o2.load_state_dict(torch.load(buf, weights_only=True))
    groups = o1.state_dict()["param_groups"]
    assert o2.state_dict()["param_groups"] == groups
    json.dumps(groups)  # plain values only (no torch objects): safe for DCP, logs and weights_only loads
    train(m1, o1, 3, seed=7)
    train(m2, o2, 3, seed=7)
    for a, b in zip(m1.parameters(), m2.parameters()):
        assert torch.equal(a, b)
    # and a fresh optimizer (no state) does not reproduce it: the state really matters
    m3 = copy.deepcopy(m2)
    train(m3, build_optimizer(m3, cfg), 1, seed=9)
    train(m2, o2, 1, seed=9)
    assert any(not torch.equal(a, b) for a, b in zip(m2.parameters(), m3.parameters()))


@pytest.mark.parametrize("name", NAMES)
def test_lambda_lr_schedule_drives_every_group(name):
    model = tiny_dit(5, perturb=True)
    scale = {"rownorm_scale": "frobenius"} if name in ("rownorm", "periodic_rowwise") else {}  # exact row norms
    opt = build_optimizer(model, {"name": name, "lr": 1e-2, "weight_decay": 0.0, **scale})
    sched = LambdaLR(opt, lambda s: 0.5 ** s)
    assert all(g["initial_lr"] == 1e-2 for g in opt.param_groups)
    train(model, opt, 2, sched=sched)
    assert all(g["lr"] == pytest.approx(1e-2 * 0.25) for g in opt.param_groups)
    if name in ("rownorm", "periodic_rowwise"):  # the update size follows the scheduled lr exactly
        before = params_of(model)
        train(model, opt, 1, seed=5)
        if name == "rownorm" or opt.step_info()["opt/refresh"] == 0.0:
            assert _matrix_row_norms_exact(model, before, 1e-2 * 0.25)


@pytest.mark.parametrize("name", NAMES)
def test_zero_gradients_on_the_first_step_stay_finite(name):
    """adaLN-Zero: the modulation and final layers start at zero, so many matrices see exactly zero gradient."""
    model = tiny_dit(6)
    opt = build_optimizer(model, {"name": name})
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    assert all(torch.isfinite(p).all() for p in model.parameters())
    train(model, opt, 2)
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("name", NAMES)
def test_short_training_run_lowers_the_loss(name):
    """The tiny DiT learns 4 class prototypes with the shipped config (lr raised for a 25-step run): the loss at a
    fixed (noise, t) evaluation batch falls by a clear margin (measured: to 0.56-0.66 of the start, all five) and
    nothing is NaN."""
    from omegaconf import OmegaConf

    from dit_train.config import load_option

    cfg = OmegaConf.to_container(load_option("optimizer", name))
    cfg["lr"] = 1e-2
    model = tiny_dit(7, hidden_size=48, depth=2)
    opt = build_optimizer(model, cfg)
    g0 = torch.Generator().manual_seed(0)
    prototypes = 3 * nn.functional.avg_pool2d(torch.randn(4, 1, 8, 8, generator=g0), 3, 1, 1)
    y = torch.arange(32) % 4
    x = prototypes[y] + 0.1 * torch.randn(32, 1, 8, 8, generator=g0)
    fixed = (x, torch.rand(32, generator=g0), torch.randn(x.shape, generator=g0), y)
    with torch.no_grad():
        start = flow_loss(model, fixed).item()
    for s in range(25):
        g = torch.Generator().manual_seed(s)
        loss = flow_loss(model, (x, torch.rand(32, generator=g), torch.randn(x.shape, generator=g), y))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        assert math.isfinite(loss.item())
    with torch.no_grad():
        end = flow_loss(model, fixed).item()
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert end < 0.8 * start, (start, end)
