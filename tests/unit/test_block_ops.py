"""benchmarks/block_ops.py, the per-block counter of operators, Python calls and module calls, against a hand count
of one DiT block: five projections (adaLN, qkv, attention output, MLP in and out), two LayerNorms, one attention."""

import pytest

from benchmarks.block_ops import compare, measure, totals

LINEARS = 5


@pytest.mark.parametrize("qk_norm", [False, True])
def test_counts_are_the_blocks_by_hand(qk_norm):
    r = measure("dit_xs", 2, 1, True, [f"qk_norm={str(qk_norm).lower()}"])
    fwd, bwd = r["ops"]["forward"], r["ops"]["backward"]
    assert fwd["addmm.default"] == LINEARS and "addmm.default" not in bwd
    assert bwd["mm.default"] == 2 * LINEARS  # input and weight gradient of each
    assert fwd["native_layer_norm.default"] == bwd["native_layer_norm_backward.default"] == 2
    assert fwd["_scaled_dot_product_flash_attention_for_cpu.default"] == 1
    assert (fwd["gelu.default"], bwd["gelu_backward.default"], fwd["silu.default"]) == (1, 1, 1)
    # DiTBlock, adaLN's Sequential, SiLU and Linear, norm1, attn, qkv, proj, norm2, mlp, fc1, fc2 (+ q_norm, k_norm)
    assert r["module_calls"] == {"forward": 12 + 2 * qk_norm, "backward": 0}
    assert r["rms_norms"] == 2 * qk_norm
    t = totals(r)
    if qk_norm:  # the norms' share is what one F.rms_norm dispatches, twice
        one = sum(n for op, n in r["rms_norm"]["forward"].items() if r["kinds"][op] != "no_kernel")
        assert t["forward"]["rms_kernel"] == 2 * one > 0
    else:
        assert t["forward"]["rms_kernel"] == t["backward"]["rms_kernel"] == 0
    assert r["python_calls"]["forward"] > r["module_calls"]["forward"] and r["thread_us"] > 0


def test_compare_lists_the_operators_that_changed():
    before = measure("dit_xs", 2, 1, True, ["qk_norm=false"])
    n = before["ops"]["forward"]["unsqueeze.default"]
    after = {**before, "ops": {"forward": {**before["ops"]["forward"], "unsqueeze.default": n + 5},
                               "backward": before["ops"]["backward"]}}
    lines = compare(before, after).splitlines()
    changed = [line for line in lines if line.startswith("| ") and "." in line.split("|")[1]]
    m = before["ops"]["backward"].get("unsqueeze.default", 0)
    assert changed == [f"| unsqueeze.default | {n} | {n + 5} | {m} | {m} |"]
    assert f"| views and allocations | {totals(before)['forward']['view']} / " in compare(before, after)
