"""PyTorch's side of the optimizers (pytorch/optimizer.py), beyond tests/test_optimizers.py's trajectories: the rate
torch.optim.lr_scheduler gives every step of every schedule (SequentialLR's switch, the recursive forms), the
scratch state in the replica's memory layout, the stock port, and the scratch update at every exec level."""
import numpy as np
import pytest
import torch

from common import optim
from common.lenet import init_weights
from conftest import EXPLICIT_SCHEDULES, framework_or_skip, replicas_of, train_steps, weights_of
from harness.loader import load_module


@pytest.fixture
def pytorch():
    return framework_or_skip("pytorch")


RUNS = [(1, 0), (1, 1), (2, 1), (7, 0), (7, 1), (7, 2), (24, 5), (24, 23), (24, 24), (1000, 37)]   # (total, warm-up)


# Every schedule with its defaults over RUNS, and with its parameters given over a run they fit
CASES = [({"schedule": schedule}, total, warmup) for schedule in optim.SCHEDULES for total, warmup in RUNS] + \
    [(given, 24, warmup) for given in EXPLICIT_SCHEDULES for warmup in (0, 5)]


@pytest.mark.filterwarnings("error")   # e.g. "lr_scheduler.step() before optimizer.step()"
@pytest.mark.parametrize("given,total,warmup", CASES, ids=[
    f"{g['schedule']}{'-given' if len(g) > 1 else ''}-{t}steps-warmup{w}" for g, t, w in CASES])
def test_the_scheduler_gives_the_spec_rate_at_every_step(pytorch, given, total, warmup):
    """The rate of each optimizer.step(), one scheduler.step() after it: LinearLR's, CosineAnnealingLR's and
    PolynomialLR's recursive forms stay within rounding of the spec's closed forms, SequentialLR switches on time,
    and a run that ends with its warm-up still steps the schedule once more."""
    o = optim.Optimizer("momentum", 0.3, warmup_steps=warmup, total_steps=total, **given)
    p = torch.nn.Parameter(torch.zeros(1))
    trainer = load_module("pytorch", "optimizer").get_trainer([p], o)
    for step in range(total):
        assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(o.learning_rate(step), rel=1e-12), step
        p.grad = torch.zeros(1)
        trainer.step()





def test_the_stock_port_is_the_canonical_one(pytorch, digits):
    """common/optim.py is PyTorch's conventions: a straightforward port trains exactly as the canonical one."""
    idiomatic = load_module("pytorch", "idiomatic")
    o = optim.Optimizer("adamw", 1e-3, weight_decay=1e-2, schedule="cosine", warmup_steps=2, total_steps=4,
                        clip_norm=1.0)
    X, y = digits.X_train[:64], digits.y_train[:64]
    weights = []
    for port in idiomatic.PORTS:
        model = idiomatic.get_model(init_weights(0), pytorch.get_devices(1), o, port=port)
        for _ in range(o.total_steps):
            idiomatic.train_step(model, X, y, pytorch.get_devices(1), 0.0, len(X))
        weights.append(idiomatic.to_numpy(model))
    for name in weights[0]:
        np.testing.assert_array_equal(weights[1][name], weights[0][name])


@pytest.mark.slow   # trains: the slow tier
def test_every_exec_level_updates_with_states(pytorch, digits):
    """The scratch step with states on 2 devices at the graph level (torch.compile of the forward) as eagerly."""
    execution = load_module("pytorch", "execution")
    o = optim.Optimizer("adamw", 1e-3, weight_decay=1e-2, clip_norm=1.0, total_steps=3)
    devices = pytorch.get_devices(2)
    X, y = digits.X_train[:64], digits.y_train[:64]
    weights = {}
    for level in execution.NAMES:
        replicas = replicas_of(pytorch, init_weights(0), devices, level=level)
        states = [pytorch.init_state(r, o) for r in replicas]
        for step in range(o.total_steps):
            train_steps(pytorch, replicas, X, y, devices, o.learning_rate(step), len(X), states, level=level)
        assert [s["step"] for s in states] == [o.total_steps] * 2
        weights[level] = weights_of(pytorch, replicas[1], level=level)
    for name, value in weights["eager"].items():
        np.testing.assert_allclose(weights["graph"][name], value, atol=1e-6, err_msg=name)
