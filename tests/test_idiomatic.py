"""Each framework's idiomatic reference loop trains exactly like its scratch step on one device, so the
benchmark's reference rows time the same computation."""
import numpy as np
import pytest

from common import RosettaError
from common.lenet import init_weights
from common.optim import Optimizer
from harness.training.loop import Idiomatic, Scratch


def train_both(fw, data, steps, batch_size=97, lr=0.2):
    rng = np.random.default_rng(0)
    batches = [rng.choice(len(data.y_train), batch_size, replace=False) for _ in range(steps)]
    runs = []
    for mode in (Scratch, Idiomatic):
        runner = mode(fw, fw.get_devices(1))
        runner.start(init_weights(3), Optimizer())
        losses = [runner.step((data.X_train[i], data.y_train[i]), lr, batch_size) for i in batches]
        runs.append((losses, runner.weights()))
    return runs


@pytest.mark.parametrize("steps,tol", [(1, 1e-5), (5, 1e-4)])
def test_idiomatic_loop_equals_scratch_step(fw, digits, steps, tol):
    (ref_losses, ref_weights), (losses, weights) = train_both(fw, digits, steps)
    assert all(isinstance(loss, float) for loss in losses)
    np.testing.assert_allclose(losses, ref_losses, atol=tol)
    for name, value in ref_weights.items():
        np.testing.assert_allclose(weights[name], value, atol=tol, err_msg=name)


def test_idiomatic_loop_is_single_device(fw):
    runner = Idiomatic(fw, fw.get_devices(2))
    with pytest.raises(RosettaError, match="1 device"):
        runner.start(init_weights(0), Optimizer())
