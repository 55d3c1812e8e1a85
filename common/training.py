"""The training loop every framework and mode shares: it owns the data order, the split of each global
batch across processes, the timing and the bookkeeping; a framework supplies only the step.

A run has `world` processes (1 unless an engine runs several); each one calls `train` with its rank and
trains on its contiguous part of every global batch, dividing the summed gradient by the global batch
size. `summarize` merges the per-process records into one run.
"""
import hashlib

import numpy as np

from .batches import epoch_batches
from .interface import load_module
from .lenet import init_weights
from .sharding import shard_bounds
from .timing import Timer

LOGGED_STEPS = 2000   # per-step losses kept, for the parity checks and the loss curves


class Scratch:
    """The recipe from scratch: one replica per device and the framework's own train_step."""

    def __init__(self, fw, devices):
        self.fw, self.devices = fw, devices

    def start(self, weights):
        self.replicas = [self.fw.get_params(weights, d) for d in self.devices]

    def step(self, X, y, lr, batch_size):
        return self.fw.train_step(self.replicas, X, y, self.devices, lr, batch_size)

    def weights(self):
        return self.fw.to_numpy(self.replicas[0])

    def evaluate(self, X, y):
        return self.fw.evaluate(self.replicas[0], X, y)

    def spread(self):
        """Largest |difference| between any replica's weights and the first one's: 0 when in sync."""
        first = self.weights()
        return max((float(np.max(np.abs(self.fw.to_numpy(r)[k] - first[k])))
                    for r in self.replicas[1:] for k in first), default=0.0)

    def sync(self):
        self.fw.sync(self.devices)


class Builtin(Scratch):
    """The framework's own data-parallel engine (its folder's builtin.py), driven the same way."""

    def __init__(self, fw, devices):
        super().__init__(fw, devices)
        self.engine = load_module(fw.name, "builtin")

    def start(self, weights):
        self.model = self.engine.get_model(weights, self.devices)

    def step(self, X, y, lr, batch_size):
        return self.engine.train_step(self.model, X, y, self.devices, lr, batch_size)

    def weights(self):
        return self.engine.to_numpy(self.model)

    def evaluate(self, X, y):
        return self.engine.evaluate(self.model, X, y)

    def spread(self):
        return None   # the engine keeps its replicas itself; equality is tested through to_numpy


class Idiomatic(Builtin):
    """The framework's minimal single-device loop (its folder's idiomatic.py: model, optimizer, loss):
    the reference that shows what the from-scratch harness costs."""

    def __init__(self, fw, devices):
        Scratch.__init__(self, fw, devices)
        self.engine = load_module(fw.name, "idiomatic")


MODES = {"scratch": Scratch, "builtin": Builtin, "idiomatic": Idiomatic}


def steps_per_epoch(n, batch_size, min_size=1):
    return n // batch_size + (1 if n % batch_size >= min_size else 0)


def digest(weights):
    """A hash of all weights: every process holds the same replicas exactly, or the digests differ."""
    h = hashlib.sha256()
    for name in sorted(weights):
        h.update(np.ascontiguousarray(weights[name], dtype=np.float32).tobytes())
    return h.hexdigest()[:16]


def train(runner, data, epochs, batch_size, lr, seed=0, init="he", rank=0, world=1, min_size=1,
          progress=None, max_steps=None):
    """Train this process's part; return its record: loss sums and sizes rather than means, so that
    processes with shards of different sizes merge exactly. max_steps stops early (for parity checks)."""
    runner.start(init_weights(seed, init))
    record = {"epoch_loss_sums": [], "epoch_sizes": [], "epoch_seconds": [], "step_loss_sums": [],
              "step_sizes": [], "first_step_seconds": None, "first_step_images": 0, "images": 0}
    steps, total_steps = 0, epochs * steps_per_epoch(len(data.y_train), batch_size, min_size)
    if max_steps is not None:
        total_steps = min(total_steps, max_steps)
    for epoch in range(epochs):
        batches = epoch_batches(len(data.y_train), batch_size, seed, epoch, min_size)
        if max_steps is not None:
            batches = batches[:max_steps - steps]
        if not batches:
            break
        loss_sum, size = 0.0, 0
        with Timer(runner.sync) as epoch_timer:
            for idx in batches:
                a, b = shard_bounds(len(idx), world)[rank]
                local = idx[a:b]
                first = steps == 0   # one-off costs: tracing, allocation, caches
                with Timer(runner.sync if first else lambda: None) as t:
                    loss = runner.step(data.X_train[local], data.y_train[local], lr, len(idx))
                if first:
                    record["first_step_seconds"], record["first_step_images"] = t.seconds, len(idx)
                steps += 1
                record["images"] += len(idx)
                if progress and rank == 0:
                    progress(steps, total_steps, loss)
                loss_sum, size = loss_sum + loss * len(local), size + len(local)
                if steps <= max(LOGGED_STEPS, max_steps or 0):
                    record["step_loss_sums"].append(loss * len(local))
                    record["step_sizes"].append(len(local))
        record["epoch_loss_sums"].append(loss_sum)
        record["epoch_sizes"].append(size)
        record["epoch_seconds"].append(epoch_timer.seconds)
    record["test_accuracy"] = runner.evaluate(data.X_test, data.y_test)
    record["replica_spread"] = runner.spread()
    record["digest"] = digest(runner.weights())
    return record


def summarize(records):
    """Merge the records of all processes (one for an in-process run) into the run's measurements."""
    add = lambda key: np.sum([r[key] for r in records], axis=0)   # noqa: E731
    epoch_seconds = np.max([r["epoch_seconds"] for r in records], axis=0)   # the slowest process sets the pace
    train_seconds = float(epoch_seconds.sum())
    first = max(r["first_step_seconds"] for r in records)
    steady_seconds = train_seconds - first
    steady_images = records[0]["images"] - records[0]["first_step_images"]
    spreads = [r["replica_spread"] for r in records if r["replica_spread"] is not None]
    device_peaks = [r["peak_device_memory_bytes"] for r in records if r.get("peak_device_memory_bytes") is not None]
    return {
        "train_seconds": train_seconds,
        "first_step_seconds": first,
        "epoch_seconds": epoch_seconds.tolist(),
        "epoch_seconds_median": float(np.median(epoch_seconds)),
        "images_per_second": steady_images / steady_seconds if steady_images and steady_seconds > 0 else None,
        "epoch_losses": (add("epoch_loss_sums") / add("epoch_sizes")).tolist(),
        "step_losses": (add("step_loss_sums") / add("step_sizes")).tolist(),
        "test_accuracy": records[0]["test_accuracy"],
        "replica_spread": max(spreads) if spreads else None,
        "exec": records[0].get("exec"),
        "startup_seconds": max(r.get("startup_seconds", 0.0) for r in records),
        "peak_rss_bytes": max(r.get("peak_rss_bytes", 0) for r in records),
        "peak_device_memory_bytes": sum(device_peaks) if device_peaks else None,   # each process's own GPUs
    }
