"""dit-memory-formula with FSDP2 units of several blocks (parallel.blocks_per_fsdp_unit): the most blocks gathered at
once, counted by hand, and the working set of units of one block unchanged. tests/integration/test_memory_estimate.py
checks the formula against the estimator, which runs the real plan."""

import pytest

from dit_train.parallel.memory_formula import gathered_blocks, main, memory


@pytest.mark.parametrize("depth, per_unit, blocks", [
    (50, 1, 2),  # two blocks: the one computing and the prefetched one
    (50, 2, 4),
    (50, 4, 8),  # twelve units of 4 and a last one of 2: two units of 4 side by side
    (6, 4, 6),  # a unit of 4, then the remainder of 2
    (4, 4, 4),  # one unit holds every block
    (3, 8, 3),
    (1, 1, 1),
])
def test_gathered_blocks_are_the_largest_two_consecutive_units(depth, per_unit, blocks):
    assert gathered_blocks(depth, per_unit) == blocks


COUNTS = {"P": 10_000, "P_matrix": 8_000, "P_block": 900, "P_block_matrix": 800, "P_root": 500, "depth": 10,
          "d": 16, "tokens": 4}


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_units_of_one_block_keep_the_working_set_of_before(optimizer):
    """Two gathered blocks (2 x 2 bytes), one block's bf16 gradient and fp32 reduce-scatter input (6 bytes), the
    root's bf16 weights; gather mode's bf16 momentum bucket of one block's matrices for the Muon family."""
    c = COUNTS
    working = 4 * c["P_block"] + 6 * c["P_block"] + 2 * c["P_root"] + (2 * c["P_block_matrix"] if optimizer != "adamw"
                                                                        else 0)
    assert memory(c, 8, 2, optimizer, False)["working"] == working
    assert memory(c, 8, 2, optimizer, False, blocks_per_unit=1) == memory(c, 8, 2, optimizer, False)


def test_larger_units_add_their_gathered_weights_and_gradients():
    c, base = COUNTS, memory(COUNTS, 8, 2, "adamw", True)["working"]
    for per_unit, extra_gathered, extra_unit in [(2, 2, 1), (4, 6, 3), (10, 8, 9)]:
        r = memory(c, 8, 2, "adamw", True, blocks_per_unit=per_unit)
        assert r["working"] - base == (2 * extra_gathered + 6 * extra_unit) * c["P_block"]
        assert {k: v for k, v in r.items() if k != "working"} == {
            k: v for k, v in memory(c, 8, 2, "adamw", True).items() if k != "working"}


def test_a_unit_size_below_one_is_refused_in_one_line(capsys):
    with pytest.raises(SystemExit):
        main(["--blocks-per-unit", "0", "--presets", "dit_1b3"])
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].endswith("--blocks-per-unit: 0 is not a number of blocks (an integer >= 1)")
