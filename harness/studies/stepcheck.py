"""A run checked against the optimizer spec (common/optim.py) step by step, for the tests and
harness.studies.conventions.

Every step of a run is compared with the spec's step from the weights the run had before it, with the gradient of
the same batch at those weights (the framework's own scratch `loss_and_grads`). The spec's optimizer state follows
the same gradients from zero, so each step also checks the state the run carried into it: the momentum buffers,
Adam's moments and the step count behind the rate and the bias corrections.

Why step by step: a whole run is chaotic at the 1e-7 level. A ReLU whose input is within rounding of zero flips
between two runs that differ by one float32 ulp, and 24 steps later their weights differ by up to 3e-2 (measured:
the spec against itself, its initial weights nudged by one ulp). A single step amplifies nothing: the frameworks'
rounding stays ~1e-7, while a convention slip moves a step's weights by 1e-4 or more.
"""
import numpy as np

from common import optim
from common.batches import Order

from ..loader import load_module
from ..spec import RunSpec
from ..training.loop import Hooks, train


def traced(runner, data, epochs, batch_size, optimizer, seed=0, min_size=1, max_steps=None):
    """Train `runner`; the weights before every step, then the final ones (copies, which no later step can change),
    and the training record."""
    trace = []
    spec = RunSpec(runner.fw.name, runner.network.name, epochs=epochs, batch_size=batch_size, lr=optimizer.lr,
                   seed=seed, devices=min_size, max_steps=max_steps)
    record = train(runner, data, spec, optimizer,
                   hooks=Hooks(before_step=lambda steps, runner: trace.append(copies(runner.weights()))))
    return trace + [copies(runner.weights())], record


def copies(weights):
    """Copies: a trace must hold what the weights were, whatever a framework's to_numpy hands out (every one copies
    now; PyTorch's handed out views of its live tensors until fp16's tests kept the weights before each step)."""
    return {name: np.array(w) for name, w in weights.items()}


def mean_gradient(fw, model, weights, bn_state, X, y, n_devices=1, units=None):
    """The batch's mean gradient at canonical `weights`, from the framework's own scratch loss_and_grads of `model` (a
    Functional) on `n_devices` devices, summed: a local BatchNorm normalises each shard by its own statistics, so the
    gradient depends on the split (a training-mode forward does not read the running statistics `bn_state`).
    `units`: a run's compiled units (execution.compile), whose loss_and_grads then gives the run's own gradient to the
    bit, where the written one rounds otherwise (a jitted or traced graph fuses differently)."""
    dp = load_module(fw.name, "data_parallel")
    devices = fw.get_devices(n_devices)
    X_shards, y_shards = dp.split_and_load(X, devices), dp.split_and_load(y, devices)
    replicas = [model.get_params(weights, d) for d in devices]
    bn_states = [model.get_bn_state(bn_state, d) for d in devices]
    _, grads, _ = (units or dp.UNITS)["loss_and_grads"](model, replicas, bn_states, X_shards, y_shards, devices)
    per_device = [model.to_numpy(device_grads) for device_grads in grads]
    return {k: np.sum([g[k] for g in per_device], axis=0, dtype=np.float32) / np.float32(len(y)) for k in per_device[0]}


def step_errors(fw, data, optimizer, trace, epochs, batch_size, seed=0, min_size=1, model=None, bn_state=None,
                n_devices=1, max_steps=None, names=None, units=None):
    """(the largest |weights after a step - the spec's step from the weights before it|, where), and the clipping
    coefficients of the steps. `trace` is what `traced` returns for a run of these batches; `model` the Functional
    whose gradients the spec's step takes (the LeNet's by default), on `n_devices` devices, with `bn_state` for a
    network with BatchNorm; `names`: the parameters compared (all by default); `units`: the run's compiled units, for
    the run's gradient to the bit (mean_gradient)."""
    model = model or load_module(fw.name, "lenet").Functional()
    order = Order(len(data.y_train), batch_size, seed, min_size)
    batches = [rows for epoch in range(epochs) for rows, _ in order.parts(epoch, 0, 1)][:max_steps]
    if len(trace) != len(batches) + 1:
        raise ValueError(f"a trace of {len(trace) - 1} steps for a run of {len(batches)}")
    state, worst, coefficients = optim.init_state(optimizer, trace[0]), (0.0, None), []
    for k, rows in enumerate(batches):
        grads = mean_gradient(fw, model, trace[k], bn_state, data.X_train[rows], data.y_train[rows], n_devices,
                              units)
        coefficients.append(optimizer.clip_coefficient(grads))
        want, state = optim.step(optimizer, trace[k], grads, state)
        for name, value in want.items():
            if names is not None and name not in names:
                continue
            error = float(np.max(np.abs(trace[k + 1][name] - value)))
            error = np.inf if np.isnan(error) else error   # max() would pass over a NaN: a step that made none is off
            worst = max(worst, (error, f"step {k}, {name}"), key=lambda e: e[0])
    return worst, coefficients
