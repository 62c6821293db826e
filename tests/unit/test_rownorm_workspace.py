"""RowNorm's column-sum block accumulator (`sumsq_part`), the part of the optimizer workspace that does not shrink
with the world size (docs/scaling_out.md, memory section: dit-estimate-memory's periodic_rowwise workspace at
dit_15b was 0.59 GiB above the documented 6 B per matrix parameter / W, at every W)."""

import os

import torch

from conftest import ROOT, compose
from dit_train.optim.directions.linalg import row_sumsq_of

GiB = 2**30


def kept_bytes(ws: dict) -> int:
    return sum(t.untyped_storage().nbytes() for t in ws.values())


def test_a_tall_shard_keeps_min_256_rows_of_fp32_column_sums():
    for rows, kept_rows in ((600, 256), (100, 100)):
        X, ws = torch.randn(2, rows, 8, dtype=torch.bfloat16), {}
        sums = row_sumsq_of(X, tall=True, reduce=None, workspace=ws)
        torch.testing.assert_close(sums, X.float().square().sum(dim=-2, keepdim=True))
        assert kept_bytes(ws) == 4 * 2 * kept_rows * 8  # 4 x min(256, m / W) x n per matrix, whatever its dtype


def test_the_documented_constant_at_dit_15b():
    from dit_train.model.dit import build_model

    model = build_model(compose(["model=dit_15b", "run_dir=unused", "train.dry_run=true"]).model, device="meta")
    tall = [p.shape for p in model.parameters() if p.ndim == 2 and p.shape[0] > p.shape[1]]
    for W in (8, 16, 32):  # rank 0's rows: torch.chunk's ceil(m / W)
        total = sum(4 * min(256, -(-m // W)) * n for m, n in tall)
        assert round(total / GiB, 2) == 0.59, W
    with open(os.path.join(ROOT, "docs", "scaling_out.md")) as f:
        doc = f.read()
    assert "4 × min(256, m / W) × n bytes" in doc and "0.59 GiB at every W up to 32" in doc
