import numpy as np
import pytest

from common.lenet import PARAM_NAMES, PARAM_SHAPES, flops_per_image, init_weights, layer_outputs


def test_spec_matches_the_recipe():
    assert dict(layer_outputs())["pool after conv2"] == (50, 4, 4)
    assert PARAM_SHAPES["fc1.weight"] == (128, 800)
    # 2.25 M multiply-adds per 28x28 image, conv2 alone 2.0 M (rosetta notes, section 2)
    assert flops_per_image(training=False) == 2 * (20 * 26 * 26 * 9 + 50 * 9 * 9 * 20 * 25 + 800 * 128 + 1280)
    assert flops_per_image() == 3 * flops_per_image(training=False)


def test_init_is_seeded_float32_and_scaled():
    a, b, c = init_weights(0), init_weights(0), init_weights(1)
    assert list(a) == list(PARAM_NAMES)
    assert all(a[k].dtype == np.float32 and a[k].shape == PARAM_SHAPES[k] for k in a)
    assert all((a[k] == b[k]).all() for k in a)
    assert not (a["conv2.weight"] == c["conv2.weight"]).all()
    assert a["conv1.weight"].std() == pytest.approx(np.sqrt(2 / 9), rel=0.15)
    assert a["fc1.weight"].std() == pytest.approx(np.sqrt(2 / 800), rel=0.05)
    assert not a["fc1.bias"].any()
    assert init_weights(0, "recipe")["fc1.weight"].std() == pytest.approx(0.01, rel=0.05)
