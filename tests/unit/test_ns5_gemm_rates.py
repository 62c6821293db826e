"""benchmarks/ns5_gemm_rates.py: the matmuls NS5 dispatches (counted from the direction itself), the interpolation
between measured rates against values worked out by hand, and that a counted NS5 matmul is priced from that table,
not from the square GEMM rates by side."""

from __future__ import annotations

import pytest
import torch

from benchmarks import ns5_gemm_rates as nr
from benchmarks import op_cost as oc
from benchmarks.cost_model.predict import counted_records
from benchmarks.cost_model.shapes import model_shapes
from dit_train.optim.directions import NS5

BF16 = "bfloat16"
# X X^T of wide matrices ('nt', long k) measured at r in {128, 512}, aspect in {1, 4}, batch in {1, 8}: a rate
# per corner, all different
CORNERS = {(r, a, B): 1e11 * (1 + i) for i, (r, a, B) in enumerate(
    (r, a, B) for r in (128, 512) for a in (1, 4) for B in (1, 8))}
ROWS = tuple(("bmm", "nt", BF16, r, a * r, r, B, rate) for (r, a, B), rate in CORNERS.items())


def test_the_rate_at_a_measured_point_is_the_measured_rate():
    for (r, a, B), rate in CORNERS.items():
        assert nr.rate(ROWS, "bmm", "nt", BF16, (r, a * r, r), B) == rate


def test_between_measured_points_the_rate_is_interpolated_in_log_coordinates():
    # r = 256 is halfway between 128 and 512 in log r; aspect 2 halfway between 1 and 4: the mean of the 4 corners
    lo, hi = CORNERS[(128, 1, 1)], CORNERS[(512, 1, 1)]
    assert nr.rate(ROWS, "bmm", "nt", BF16, (256, 256, 256), 1) == pytest.approx((lo + hi) / 2)
    square = [CORNERS[(r, a, 1)] for r in (128, 512) for a in (1, 4)]
    assert nr.rate(ROWS, "bmm", "nt", BF16, (256, 512, 256), 1) == pytest.approx(sum(square) / 4)
    # a quarter of the way in log r (r = 128 * 2^0.5), batch 8: 3/4 of the r = 128 rate and 1/4 of the r = 512 one
    r = 181
    w = (torch.tensor(r / 128.0).log() / torch.tensor(4.0).log()).item()
    expect = (1 - w) * CORNERS[(128, 1, 8)] + w * CORNERS[(512, 1, 8)]
    assert nr.rate(ROWS, "bmm", "nt", BF16, (r, r, r), 8) == pytest.approx(expect)
    assert min(CORNERS.values()) < expect < max(CORNERS.values())


def test_outside_the_measured_range_the_nearest_edge_and_other_kinds_are_not_covered():
    assert nr.rate(ROWS, "bmm", "nt", BF16, (1024, 8192, 1024), 16) == CORNERS[(512, 4, 8)]  # clamped
    assert nr.rate(ROWS, "bmm", "tn", BF16, (128, 512, 128), 1) is None  # another layout
    assert nr.rate(ROWS, "bmm", "nt", "float32", (128, 512, 128), 1) is None  # another dtype
    assert nr.rate(ROWS, "bmm", "nt", BF16, (128, 128, 512), 1) is None  # long on n, only k measured
    assert nr.rate(ROWS, "bmm", "nt", BF16, (128, 256, 512), 1) is None  # not an NS5 shape (short sides differ)


def _ns5_records(m: int, n: int, B: int = 2) -> list:
    counter = oc.OpCounter(allow_non_fake_inputs=True)
    with counter, torch.no_grad():
        U = torch.empty(B, m, n, dtype=torch.bfloat16)
        counter.reset()
        NS5()(U, nr.ns5_group(), {})
    return [r for r in counter.records if r.category == "gemm"]


def test_the_matmuls_ns5_dispatches_are_counted_from_it_with_their_layouts():
    points = nr.ns5_matmuls(sides=(32,), aspects=(1, 4), batches=(1, 8))
    kinds = {(op, layout, (m, k, n)) for op, layout, _, m, k, n, _ in points}
    # plain form on a square: X X^T, then (b A + c A^2) and a X + B X as baddbmm's
    assert {("bmm", "nt", (32, 32, 32)), ("baddbmm", "nn", (32, 32, 32))} <= kinds
    # Gram form, wide: X X^T ('nt', long k) and Q X (long n); tall: O^T O reads a transposed view ('tn'), X Q^T
    assert {("bmm", "nt", (32, 128, 32)), ("bmm", "nn", (32, 32, 128)), ("bmm", "tn", (32, 128, 32)),
            ("bmm", "nt", (128, 32, 32))} <= kinds
    assert {B for *_, B in points} == {1, 8} and {p[2] for p in points} == {BF16}


def test_a_counted_ns5_matmul_is_priced_from_the_ns5_table_not_the_square_rate():
    points = nr.ns5_matmuls(sides=(64,), aspects=(1, 1.5, 2, 4), batches=(1, 8))
    rates = oc.OpRates(stream=1e12, convert=1e12, reduce=1e12, matvec=1e12, op_s=0.0, adamw=1e12, fused=1e12,
                       gemm=((1, 1e9),), square=((1, 1e9),), ns5=tuple((*p, 7e10) for p in points))
    for m, n in ((256, 256), (256, 1024), (1024, 256), (256, 384), (384, 256)):  # square, Gram, plain; both ways
        for rec in _ns5_records(m, n):
            assert oc.seconds(rec, rates) == pytest.approx(rec.flops / 7e10)
    # without the table (a profile measured before it), the same records fall back to the rates by side
    rec = _ns5_records(256, 1024)[0]
    assert oc.seconds(rec, oc.OpRates(**{**rates.__dict__, "ns5": ()})) == pytest.approx(rec.flops / 1e9)
    assert rates.shared(0.5).ns5[0][-1] == 3.5e10


def test_every_matmul_of_muon_at_the_calibration_widths_is_covered_by_the_table():
    rows = tuple((*p, 1e12) for p in nr.ns5_matmuls(sides=(64,), batches=(1,)))
    for width in (256, 512):  # bench_distributed's and bench_optimizer's dit_m (depth does not change the shapes)
        records = counted_records(model_shapes("dit_m", width, 1), "refresh", "spectral", "eager")
        gemms = [r for r in records if r.category == "gemm"]
        assert gemms and all(nr.rate(rows, r.op, r.layout, r.dtype, r.dims, r.batch) for r in gemms)


def test_measured_rows_are_positive_flop_rates():
    rows = nr.measure_ns5_gemms(1, [("bmm", "tn", BF16, 16, 64, 16, 2), ("baddbmm", "nn", BF16, 16, 16, 16, 1)])
    assert [row[:7] for row in rows] == [["bmm", "tn", BF16, 16, 64, 16, 2], ["baddbmm", "nn", BF16, 16, 16, 16, 1]]
    assert all(row[7] > 0 for row in rows)
    # the timed operands have the layout measured (a transposed view stays one after the cast to bf16)
    assert [oc.layout_of(nr._operand(2, 16, 64, lay, torch.bfloat16)) for lay in "nt"] == ["n", "t"]


def test_the_price_check_rejects_bad_arguments_in_one_line(capsys):
    from benchmarks import ns5_price_check

    for args, message in ((["--cpu-time", "--threads", "2"], "it needs --threads 1, not 2"),
                          (["--repeats", "0"], "--threads and --repeats must be >= 1")):
        with pytest.raises(SystemExit):
            ns5_price_check.main(args)
        assert message in capsys.readouterr().err
