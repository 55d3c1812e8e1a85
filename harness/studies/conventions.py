"""What a naive port gets: each framework's stock optimizer classes, given the same hyperparameters, against the
canonical update (common/optim.py, PyTorch's conventions), measured.

    python -m harness.studies.conventions [--frameworks ...] [--epochs 2]

For every framework and optimizer, the idiomatic loop trains the LeNet twice from the same weights on the same
batches (digits, batch 128, a warm-up then a cosine schedule, weight decay): once with this repo's configuration
(port="canonical") and once with the framework's stock classes as a straightforward port writes them
(port="stock": the same learning rate, schedule, momentum and decay passed to them, their own defaults and
formulas for the rest). Each run is checked step by step against the spec (harness/studies/stepcheck.py: the largest
difference of one step from the spec's step from the same weights, which a whole-run difference would drown in
chaos), and both runs' last-epoch losses are printed. A last row measures the data-parallel convention: clipping
each of 2 devices' gradients before the all-reduce instead of the all-reduced one. docs/migration.md's conventions
table is this command's output.
"""
import argparse
import dataclasses
import sys

import numpy as np

from common import optim
from common.batches import Order
from common.interface import FRAMEWORKS, RosettaError, Unavailable
from common.lenet import init_weights

from ..cli import name_list
from ..loader import load_framework, load_module
from ..publishing.provenance import provenance, provenance_line
from .stepcheck import mean_gradient, step_errors, traced
from ..training.loop import Idiomatic, steps_per_epoch

BATCH, SEED, WARMUP_EPOCHS = 128, 0, 0.5
DECAY = {"sgd": 5e-4, "momentum": 5e-4, "nesterov": 5e-4, "adam": 5e-4, "adamw": 1e-2, "rmsprop": 5e-4,
         "adagrad": 5e-4}


class Stock(Idiomatic):
    """The idiomatic loop with the framework's stock optimizer classes (its idiomatic.py's port="stock")."""

    def start(self, weights, optimizer, state=None, scaler=None):
        self.model = self.engine.get_model(weights, self.devices, optimizer, port="stock")


def canonical(name, data, epochs, clip_norm=None):
    per_epoch = steps_per_epoch(len(data.y_train), BATCH)
    return optim.Optimizer(name, optim.DEFAULT_LR[name], 0.9, DECAY[name], "cosine", round(WARMUP_EPOCHS * per_epoch),
                           epochs * per_epoch, clip_norm)


def port_row(fw, name, data, epochs):
    """(largest one-step error from the spec, last-epoch loss) of the canonical and of the stock port."""
    optimizer, row = canonical(name, data, epochs), []
    for runner_class in (Idiomatic, Stock):
        trace, record = traced(runner_class(fw, fw.get_devices(1)), data, epochs, BATCH, optimizer, SEED)
        (error, _), _ = step_errors(fw, data, optimizer, trace, epochs, BATCH, SEED)
        row += [error, record["epoch_loss_sums"][-1] / record["epoch_sizes"][-1]]
    return row


def clipping_row(fw, data, epochs, clip_norm=3.5):
    """The spec's training with the all-reduced gradient clipped (right) and with each of 2 devices' shard
    gradients clipped before the sum (the silent bug), the gradients from the framework's own step."""
    model = load_module(fw.name, "lenet").Functional()
    optimizer = canonical("sgd", data, epochs, clip_norm)
    order = Order(len(data.y_train), BATCH, SEED, 2)
    results = []
    for per_shard in (False, True):
        weights, state = init_weights(SEED), optim.init_state(optimizer, init_weights(SEED))
        for epoch in range(epochs):
            for rows, size in order.parts(epoch, 0, 1):
                grads = [{k: g * np.float32(len(shard) / size)   # mean_gradient's mean over the shard, times its share
                          for k, g in mean_gradient(fw, model, weights, None, data.X_train[shard],
                                                    data.y_train[shard]).items()}
                         for shard in np.array_split(rows, 2)]
                update = optimizer
                if per_shard:   # each device clips its own part to the norm, then the parts are summed
                    grads = [{k: g * np.float32(optimizer.clip_coefficient(part)) for k, g in part.items()}
                             for part in grads]
                    update = dataclasses.replace(optimizer, clip_norm=None)
                weights, state = optim.step(update, weights, {k: grads[0][k] + grads[1][k] for k in weights}, state)
        results.append(weights)
    return max(float(np.max(np.abs(results[0][k] - results[1][k]))) for k in results[0])


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m harness.studies.conventions", description=__doc__.split("\n\n")[0])
    p.add_argument("--frameworks", type=name_list(FRAMEWORKS, "framework"), default=",".join(FRAMEWORKS))
    p.add_argument("--epochs", type=int, default=2, help="epochs of digits (12 steps each)")
    args = p.parse_args(argv)
    from common.data import load_dataset
    data = load_dataset("digits")
    print(f"digits, batch {BATCH}, {args.epochs} epochs, warm-up {WARMUP_EPOCHS} epoch then cosine, weight decay "
          f"{DECAY['momentum']:g} (adamw {DECAY['adamw']:g}); the stock classes against the canonical update. Made at "
          f"{provenance_line(provenance())}.\n")
    print("| framework | optimizer | one step's largest error: this repo | the stock port | last-epoch loss: this repo "
          "| the stock port |")
    print("|---|---|---|---|---|---|")
    first = None
    for name in args.frameworks:
        try:
            fw = load_framework(name)
        except Unavailable as err:
            print(f"| {name} | skipped: {err} | | | |")
            continue
        except RosettaError as err:
            print(f"error: {err}", file=sys.stderr)
            return 1
        first = first or fw
        for optimizer in optim.OPTIMIZERS:
            error, loss, stock_error, stock_loss = port_row(fw, optimizer, data, args.epochs)
            print(f"| {name} | {optimizer} | {error:.1e} | {stock_error:.1e} | {loss:.4f} | {stock_loss:.4f} |",
                  flush=True)
    if first:
        print(f"\nclipping each of 2 devices' gradients before the all-reduce instead of after it (sgd, clip norm "
              f"3.5, {first.name}'s gradients): largest weight difference {clipping_row(first, data, args.epochs):.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
