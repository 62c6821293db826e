"""The MFU numerator: FlopCounterMode's count on the meta-device model equals the hand count of its matmuls and
attention (forward; backward twice the forward, less the input gradients of the two embedders' first layers)."""

import pytest

from dit_train.model.dit import load_preset
from dit_train.model.flops import training_flops_per_image


def hand_count(c) -> int:
    d, p, C, L = c.hidden_size, c.patch_size, c.in_channels, c.depth
    T, patch = (c.image_size // p) ** 2, p * p * C
    block = 2 * d * 6 * d + 2 * T * d * 3 * d + 4 * T * T * d + 2 * T * d * d + 2 * T * d * int(c.mlp_ratio * d) * 2
    forward = 2 * T * patch * d + 2 * 256 * d + 2 * d * d + L * block + 2 * d * 2 * d + 2 * T * d * patch
    no_input_grad = 2 * T * patch * d + 2 * 256 * d  # x_embedder and the timestep MLP's first layer
    return 3 * forward - no_input_grad


@pytest.mark.parametrize("preset,depth", [("dit_xs", None), ("dit_s", 3), ("dit_1b3", 2)])
def test_training_flops_match_the_hand_count(preset, depth):
    c = load_preset(preset, depth=depth)
    assert training_flops_per_image(c) == hand_count(c)
