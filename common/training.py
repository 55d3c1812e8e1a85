"""The training loop every framework shares: the framework supplies train_step, this file supplies the
data order, the timing and the bookkeeping, so the frameworks differ only where they really differ."""
import numpy as np

from .batches import epoch_batches
from .lenet import init_weights
from .timing import Timer


def max_replica_spread(fw, replicas):
    """Largest |difference| between any replica's weights and the first one's: 0 when in sync."""
    first = fw.to_numpy(replicas[0])
    return max((float(np.max(np.abs(fw.to_numpy(r)[k] - first[k]))) for r in replicas[1:] for k in first),
               default=0.0)


def train(fw, data, devices, epochs, batch_size, lr, seed=0, init="he", progress=None):
    """Scratch data-parallel training; returns the run's measurements (see compare.py for the schema)."""
    replicas = [fw.get_params(init_weights(seed, init), d) for d in devices]
    sync = lambda: fw.sync(devices)   # noqa: E731
    epoch_losses, epoch_seconds, step_losses = [], [], []
    first_step_seconds, first_step_images, images = None, 0, 0
    for epoch in range(epochs):
        losses, sizes = [], []
        with Timer(sync) as epoch_timer:
            for step, idx in enumerate(epoch_batches(len(data.y_train), batch_size, seed, epoch, len(devices))):
                if first_step_seconds is None:   # includes one-off costs: tracing, allocation, caches
                    with Timer(sync) as first:
                        loss = fw.train_step(replicas, data.X_train[idx], data.y_train[idx], devices, lr)
                    first_step_seconds, first_step_images = first.seconds, len(idx)
                else:
                    loss = fw.train_step(replicas, data.X_train[idx], data.y_train[idx], devices, lr)
                losses.append(loss)
                sizes.append(len(idx))
                if len(step_losses) < 20:
                    step_losses.append(loss)
        epoch_losses.append(float(np.average(losses, weights=sizes)))
        epoch_seconds.append(epoch_timer.seconds)
        images += sum(sizes)
        if progress:
            progress(epoch + 1, epochs, epoch_losses[-1])
    train_seconds = float(sum(epoch_seconds))
    steady_images = images - first_step_images
    steady_seconds = train_seconds - first_step_seconds
    return {
        "train_seconds": train_seconds,
        "first_step_seconds": first_step_seconds,
        "epoch_seconds": epoch_seconds,
        "images_per_second": steady_images / steady_seconds if steady_seconds > 0 else None,
        "epoch_losses": epoch_losses,
        "step_losses": step_losses,
        "test_accuracy": fw.evaluate(replicas[0], data.X_test, data.y_test),
        "replica_spread": max_replica_spread(fw, replicas),
    }
