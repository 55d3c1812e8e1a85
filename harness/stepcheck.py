"""A run checked against the optimizer spec (common/optim.py) step by step, for the tests and harness.conventions.

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

from .loader import load_module
from .training import train


def traced(runner, data, epochs, batch_size, optimizer, seed=0, min_size=1):
    """Train `runner`; the weights before every step, then the final ones (copies: PyTorch's to_numpy hands out views
    of the live tensors, which the next step updates in place), and the training record."""
    trace = []
    record = train(runner, data, epochs, batch_size, optimizer.lr, seed, min_size=min_size, optimizer=optimizer,
                   before_step=lambda steps, runner: trace.append(copies(runner.weights())))
    return trace + [copies(runner.weights())], record


def copies(weights):
    """Copies, not views: PyTorch's to_numpy hands out views of the live tensors."""
    return {name: np.array(w) for name, w in weights.items()}


def mean_gradient(fw, weights, X, y):
    """The batch's mean gradient at canonical `weights`, from the framework's own scratch step on one device."""
    dp = load_module(fw.name, "data_parallel")
    (device,) = fw.get_devices(1)
    (X,), (y,) = dp.split_and_load(X, [device]), dp.split_and_load(y, [device])
    _, grads = dp.loss_and_grads(fw.get_params(weights, device), X, y)
    return {k: g / np.float32(len(y)) for k, g in fw.to_numpy(grads).items()}


def step_errors(fw, data, optimizer, trace, epochs, batch_size, seed=0, min_size=1):
    """(the largest |weights after a step - the spec's step from the weights before it|, where), and the clipping
    coefficients of the steps. `trace` is what `traced` returns for a run of these batches."""
    order = Order(len(data.y_train), batch_size, seed, min_size)
    batches = [rows for epoch in range(epochs) for rows, _ in order.parts(epoch, 0, 1)]
    if len(trace) != len(batches) + 1:
        raise ValueError(f"a trace of {len(trace) - 1} steps for a run of {len(batches)}")
    state, worst, coefficients = optim.init_state(optimizer, trace[0]), (0.0, None), []
    for k, rows in enumerate(batches):
        grads = mean_gradient(fw, trace[k], data.X_train[rows], data.y_train[rows])
        coefficients.append(optimizer.clip_coefficient(grads))
        want, state = optim.step(optimizer, trace[k], grads, state)
        for name, value in want.items():
            error = float(np.max(np.abs(trace[k + 1][name] - value)))
            worst = max(worst, (error, f"step {k}, {name}"), key=lambda e: e[0])
    return worst, coefficients
