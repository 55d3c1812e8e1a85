"""Each framework's expert step (its expert.py, the yardstick of harness/studies/expert.py) computes what it is timed
against: one step of the recipe on one device."""
import numpy as np
import pytest

from common import FRAMEWORKS
from common.lenet import init_weights
from conftest import framework_or_skip, replicas_of, train_steps, weights_of
from harness.loader import load_module


@pytest.mark.parametrize("name", FRAMEWORKS)
def test_the_expert_step_is_the_recipe_s_step(name, digits):
    fw = framework_or_skip(name)
    expert = load_module(name, "expert")
    device = fw.get_devices(1)[0]
    X, y = digits.X_train[:64], digits.y_train[:64]
    mine = expert.get_model(init_weights(2), device)
    first = mine[0]
    losses = [expert.train_step(mine, X, y, device, 0.2, 64) for _ in range(2)]
    replicas = replicas_of(fw, init_weights(2), [device])
    want = [train_steps(fw, replicas, X, y, [device], 0.2) for _ in range(2)]
    assert losses == pytest.approx(want, abs=1e-5) and losses[1] < losses[0]
    if name == "jax":   # its buffers donated: the old arrays are gone, the list holds the new ones
        assert first.is_deleted()
    expected = weights_of(fw, replicas[0])
    for key, value in weights_of(fw, mine).items():
        np.testing.assert_allclose(value, expected[key], atol=1e-5, err_msg=key)


def test_an_unknown_framework_is_one_line_and_a_non_zero_exit(capsys):
    from harness.studies.expert import main
    assert main(["--frameworks", "jax,nope"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.strip() == "error: unknown framework 'nope'; choose from pytorch, mxnet, tensorflow, jax"


def test_each_step_is_timed_until_its_engine_has_finished_it():
    """An asynchronous engine (MXNet's) returns the loss while the backward and the update still run: each reading
    waits for the devices, so a row's queued work is its own time, not the next row's. A fake clock: each step queues
    its row's seconds of work, which the sync does."""
    from harness.studies.expert import in_turn
    now, queued = [0.0], [0.0]

    def queue(seconds):
        def step(batch):
            queued[0] += seconds
        return step

    def sync():
        now[0] += queued[0]
        queued[0] = 0.0
    rows = {"expert": (iter(range(10)), queue(1.0)), "scratch": (iter(range(10)), queue(3.0))}
    seconds = in_turn(rows, warmup=2, repeats=3, sync=sync, clock=lambda: now[0])
    assert seconds == {"expert": [1.0] * 3, "scratch": [3.0] * 3}
