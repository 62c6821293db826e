"""benchmarks/op_cost.py: the records of a tiny real optimizer step against its op list and bytes written out by
hand from optim/matrix_optimizer.py, a fused (compiled) region's bytes, matmul FLOPs and categories, and pricing."""

from __future__ import annotations

import pytest
import torch

from benchmarks import op_cost as oc
from dit_train.optim.directions import RowNorm
from dit_train.optim.matrix_optimizer import MatrixOptimizer

F = 4  # bytes of an fp32 element


def _tiny_step(compile_rownorm: bool, m: int = 4, n: int = 8):
    def make():
        p = torch.nn.Parameter(torch.empty(m, n))
        p.grad = torch.empty_like(p)
        return MatrixOptimizer([p], lr=0.1, weight_decay=0.1,
                               direction=RowNorm("frobenius", compile_rownorm))
    return [(r.phase, r.op, r.category, r.read, r.written) for r in oc.count_steps(make)]


def test_eager_rownorm_step_of_one_wide_matrix_by_hand():
    E, R = 4 * 8 * F, 4 * F  # one 4 x 8 fp32 matrix (W, G, M, U each); its 4 row factors
    assert _tiny_step(False) == [
        ("momentum", "_foreach_lerp_", "stream", 2 * E, E),  # M <- lerp(M, G): G, M in; M out
        ("momentum", "add", "stream", 2 * E, E),  # U = G + c M into the workspace (out=: not read)
        ("direction", "linalg_vector_norm", "reduce", E, R),  # row norms of U
        ("direction", "pow_", "stream", R, R),  # .square_() dispatches as pow_
        ("direction", "sqrt_", "stream", R, R),
        ("direction", "clamp_min_", "stream", R, R),
        ("direction", "reciprocal_", "stream", R, R),
        ("update", "_foreach_mul_", "stream", E, E),  # weight decay: W in, W out
        ("update", "_foreach_addcmul_", "stream", 2 * E + R, E),  # W += a U s: W, U, s in; W out
    ]


def test_compiled_rownorm_step_is_two_fused_passes_by_hand():
    E = 8 * 4 * F  # one 8 x 4 (tall) matrix
    R = 4 * F  # its 4 column factors
    assert _tiny_step(True, 8, 4) == [
        ("momentum", "zeros", "stream", 0, F),  # the 0-d placeholder expanded to U's shape (U not stored)
        ("momentum", "_momentum", "fused", 2 * E, 0),  # G, M in; nothing out (the column sums stay in the region)
        ("direction", "sqrt_", "stream", R, R),  # the factors from the column sums
        ("direction", "clamp_min_", "stream", R, R),
        ("direction", "reciprocal_", "stream", R, R),
        ("update", "full", "stream", 0, 8),  # lr as a 0-d fp64 tensor (a Python float would recompile per value)
        ("update", "_update", "fused", 3 * E + R + 8, 2 * E),  # W, G, M (U recomputed), factors, lr in; W, M out
    ]


def test_a_fused_record_carries_the_size_of_its_bucket():
    # two wide 4 x 8 matrices stack into one bucket (64 elements), the tall 8 x 4 into another (32): each compiled
    # pass is one record with its own bucket's elements, which its rate depends on
    def make():
        params = [torch.nn.Parameter(torch.empty(*shape)) for shape in ((4, 8), (8, 4), (4, 8))]
        for p in params:
            p.grad = torch.empty_like(p)
        return MatrixOptimizer(params, lr=0.1, weight_decay=0.1, direction=RowNorm("frobenius", True))
    fused = [(r.op, r.elements) for r in oc.count_steps(make) if r.category == "fused"]
    assert fused == [("_momentum", 64), ("_momentum", 32), ("_update", 64), ("_update", 32)]


def test_fused_region_reads_and_writes_each_outside_tensor_once():
    counter = oc.OpCounter(allow_non_fake_inputs=True)
    with counter:
        a, b = torch.empty(100), torch.empty(100)
        counter.reset()
        with counter.fused("f"):
            x = a * 2  # an intermediate: free
            b.add_(x)
            b.mul_(a)  # a and b again: still once each
            x.sum()
    assert [(r.op, r.category, r.read, r.written) for r in counter.records] == [("f", "fused", 800, 400)]


def test_matmuls_are_gemm_or_matvec_with_their_flops():
    counter = oc.OpCounter(allow_non_fake_inputs=True)
    with counter:
        A, B, x = torch.empty(2, 32, 64), torch.empty(2, 64, 48), torch.empty(2, 1, 32)
        counter.reset()
        torch.bmm(A, B)
        torch.bmm(x, A)
    gemm, matvec = counter.records
    assert (gemm.category, gemm.flops, gemm.dims) == ("gemm", 2 * 2 * 32 * 64 * 48, (32, 64, 48))
    assert (gemm.read, gemm.written) == ((2 * 32 * 64 + 2 * 64 * 48) * F, 2 * 32 * 48 * F)
    assert (matvec.category, matvec.flops) == ("matvec", 2 * 2 * 32 * 64)


def test_mixed_dtypes_are_a_conversion_and_broadcasts_are_read_once():
    counter = oc.OpCounter(allow_non_fake_inputs=True)
    with counter:
        a, h = torch.empty(64), torch.empty(64, dtype=torch.bfloat16)
        zero = torch.zeros(()).expand(64)
        counter.reset()
        torch.add(a, a, out=h)
        a.add_(zero)
    conv, bcast = counter.records
    assert (conv.category, conv.read, conv.written) == ("convert", 2 * 64 * F, 64 * 2)
    assert (bcast.category, bcast.read, bcast.written) == ("stream", 64 * F + F, 64 * F)


def test_pricing_by_hand():
    rates = oc.OpRates(stream=1e9, convert=5e8, reduce=2e9, matvec=4e9, op_s=1e-6, adamw=3e9, fused=2.5e9,
                       gemm=((128, 1e12), (512, 2e12)), square=((128, 5e11),))
    assert oc.seconds(oc.OpRecord("m", "add", "stream", 2000, 1000), rates) == pytest.approx(3e-6 + 1e-6)
    assert oc.seconds(oc.OpRecord("m", "add", "convert", 1000, 0), rates) == pytest.approx(2e-6 + 1e-6)
    # a 600 x 600 x 600 GEMM is square: 4.32e8 flops at the square rate of side 128 (the nearest at or below)
    sq = oc.OpRecord("d", "bmm", "gemm", 0, 0, 432_000_000, (600, 600, 600))
    assert oc.seconds(sq, rates) == pytest.approx(432e6 / 5e11 + 1e-6)
    # 512 x 2048 x 512 is not: the NS5-mix rate at 512; a collective is priced by the caller
    mix = oc.OpRecord("d", "bmm", "gemm", 0, 0, 10**9, (512, 2048, 512))
    assert oc.seconds(mix, rates) == pytest.approx(1e9 / 2e12 + 1e-6)
    assert oc.seconds(oc.OpRecord("d", "all_reduce", "collective", 10**6, 10**6), rates) == 0.0
    half = rates.shared(0.5)
    assert (half.stream, half.op_s, half.square) == (5e8, 2e-6, ((128, 2.5e11),))


def test_the_compiled_passes_rate_is_log_log_between_bucket_sizes_and_clamped_at_the_ends():
    # measured: 1e9 B/s on buckets of 1000 elements, 4e9 on 16,000: rate = 1e9 sqrt(elements / 1000) between them
    rates = oc.OpRates(stream=1e9, convert=1e9, reduce=1e9, matvec=1e9, op_s=1e-6, adamw=1e9, fused=7e9,
                       fused_by_size=((1000, 1e9), (16000, 4e9)))
    assert rates.fused_rate(4000) == pytest.approx(2e9)
    assert rates.fused_rate(2000) == pytest.approx(2**0.5 * 1e9)
    assert (rates.fused_rate(10), rates.fused_rate(10**6)) == (pytest.approx(1e9), pytest.approx(4e9))
    assert rates.fused_rate(0) == 7e9  # a region of unknown size: the one rate
    record = oc.OpRecord("update", "_update", "fused", 3000, 1000, elements=4000)
    assert oc.seconds(record, rates) == pytest.approx(4000 / 2e9 + 1e-6)
    assert rates.shared(0.5).fused_by_size == ((1000, 5e8), (16000, 2e9))
    single = oc.OpRates(stream=1e9, convert=1e9, reduce=1e9, matvec=1e9, op_s=0.0, adamw=1e9, fused=7e9)
    assert single.fused_rate(4000) == 7e9


def test_each_compiled_pass_is_priced_at_its_own_rates_and_other_regions_at_the_shared_ones():
    # the momentum pass measured at half the update pass's rate at both sizes; a region of another name (not a
    # RowNorm pass) takes the rates of both passes together (fused_by_size)
    rates = oc.OpRates(stream=1e9, convert=1e9, reduce=1e9, matvec=1e9, op_s=0.0, adamw=1e9, fused=7e9,
                       fused_by_size=((1000, 3e9),),
                       fused_by_pass=(("_momentum", ((1000, 1e9), (16000, 2e9))), ("_update", ((1000, 2e9),
                                                                                                 (16000, 4e9)))))
    assert rates.fused_rate(4000, "_momentum") == pytest.approx(2**0.5 * 1e9)  # log-log: 1e9 (4000 / 1000)^(1/4)
    assert rates.fused_rate(4000, "_update") == pytest.approx(2**1.5 * 1e9)
    assert rates.fused_rate(4000, "other") == rates.fused_rate(4000) == pytest.approx(3e9)
    momentum = oc.OpRecord("momentum", "_momentum", "fused", 8000, 0, elements=1000)
    update = oc.OpRecord("update", "_update", "fused", 12000, 8000, elements=1000)
    assert (oc.seconds(momentum, rates), oc.seconds(update, rates)) == (pytest.approx(8e-6), pytest.approx(1e-5))
    assert rates.shared(0.5).fused_by_pass == (("_momentum", ((1000, 5e8), (16000, 1e9))),
                                               ("_update", ((1000, 1e9), (16000, 2e9))))


def test_host_rates_take_each_compiled_pass_by_bucket():
    ops = {"stream": 1e9, "convert": 1e9, "reduce": 1e9, "matvec": 1e9, "op_s": 0.0, "square": [[1, 1e9]],
           "fused_passes": {"_update": [[8, 64, 32, 4e9], [1, 16, 8, 2e9]], "_momentum": [[1, 16, 8, 1e9]]}}
    rates = oc.host_op_rates(ops, [[1, 1e9]], 1e9)
    assert rates.fused_by_pass == (("_momentum", ((128, 1e9),)), ("_update", ((128, 2e9), (16384, 4e9))))
    assert rates.fused_by_size == () and rates.fused_rate(128, "_update") == pytest.approx(2e9)
    assert set(oc.fused_passes()) == {"_momentum", "_update"}  # the names the counted fused records carry


def test_host_rates_take_the_compiled_passes_by_bucket_or_an_older_profiles_one_rate():
    old = {"stream": 1e9, "convert": 1e9, "reduce": 1e9, "matvec": 1e9, "op_s": 0.0, "square": [[1, 1e9]],
           "fused": 3e9}
    rates = oc.host_op_rates(old, [[1, 1e9]], 1e9)
    assert rates.fused_by_size == () and rates.fused_rate(100) == 3e9
    new = {k: v for k, v in old.items() if k != "fused"}
    new["fused_buckets"] = [[8, 64, 32, 2e9], [1, 16, 8, 1e9]]  # [B, m, n, bytes/s]
    assert oc.host_op_rates(new, [[1, 1e9]], 1e9).fused_by_size == ((128, 1e9), (16384, 2e9))
    assert oc.host_op_rates({**new, "fused_buckets": None}, [[1, 1e9]], 1e9).fused_rate(100) == 1e9  # no compiler


def test_the_power_iterations_products_are_counted_by_the_layout_of_their_matrix():
    # spectral scale, one wide 4 x 8 matrix: R^T x (x U), then (R y: y U^T, R^T of it: x U) twice (spectral_cap)
    def make():
        p = torch.nn.Parameter(torch.empty(4, 8))
        p.grad = torch.empty_like(p)
        return MatrixOptimizer([p], lr=0.1, weight_decay=0.0, direction=RowNorm("spectral", False))

    products = [(r.layout, r.dims, r.batch) for r in oc.count_steps(make) if r.category == "matvec"]
    assert products == [("nn", (1, 4, 8), 1), ("nt", (1, 8, 4), 1), ("nn", (1, 4, 8), 1), ("nt", (1, 8, 4), 1),
                        ("nn", (1, 4, 8), 1)]


def test_each_product_is_priced_at_its_layouts_rate_by_bucket_and_an_older_profile_at_one_rate():
    rates = oc.OpRates(stream=1e9, convert=1e9, reduce=1e9, matvec=5e9, op_s=0.0, adamw=1e9, fused=1e9,
                       matvec_by_layout=(("nn", ((1000, 4e9), (16000, 8e9))), ("nt", ((1000, 1e9),))))
    x_u = oc.OpRecord("direction", "bmm", "matvec", 16000, 0, dims=(1, 100, 40), batch=1, layout="nn")
    y_ut = oc.OpRecord("direction", "bmm", "matvec", 16000, 0, dims=(1, 40, 100), batch=1, layout="nt")
    assert rates.matvec_rate(x_u) == pytest.approx(4e9 * 2**0.5)  # 4000 elements: log-log 4e9 (4000/1000)^(1/4)
    assert rates.matvec_rate(y_ut) == pytest.approx(1e9)  # one size measured: that rate at every size
    assert oc.seconds(y_ut, rates) == pytest.approx(16000 / 1e9)
    other = oc.OpRecord("direction", "bmm", "matvec", 16000, 0, dims=(1, 40, 100), batch=1, layout="tn")
    assert rates.matvec_rate(other) == 5e9  # a layout not measured: the one rate
    older = oc.OpRates(stream=1e9, convert=1e9, reduce=1e9, matvec=5e9, op_s=0.0, adamw=1e9, fused=1e9)
    assert older.matvec_rate(x_u) == older.matvec_rate(y_ut) == 5e9
    assert rates.shared(0.5).matvec_by_layout == (("nn", ((1000, 2e9), (16000, 4e9))), ("nt", ((1000, 5e8),)))


def test_host_rates_take_the_products_by_layout_and_measuring_them_gives_both():
    ops = {"stream": 1e9, "convert": 1e9, "reduce": 1e9, "matvec": 1e9, "op_s": 0.0, "square": [[1, 1e9]],
           "matvec_by_layout": {"nt": [[2, 8, 4, 1e9]], "nn": [[2, 8, 4, 3e9], [1, 4, 4, 2e9]]}}
    rates = oc.host_op_rates(ops, [[1, 1e9]], 1e9)
    assert rates.matvec_by_layout == (("nn", ((16, 2e9), (64, 3e9))), ("nt", ((64, 1e9),)))
    assert oc.host_op_rates({k: v for k, v in ops.items() if k != "matvec_by_layout"}, [[1, 1e9]],
                            1e9).matvec_by_layout == ()
    measured = oc.measure_matvec_rates(1, [(2, 8, 16), (1, 32, 8)])
    assert sorted(measured) == ["nn", "nt"]
    assert all([B, m, n] == b and rate > 0 for rows in measured.values()
               for (B, m, n, rate), b in zip(rows, ([2, 8, 16], [1, 32, 8])))
