"""The training loop every framework and mode shares: it owns the data order (common.batches.Order), the
split of each global batch across processes, the timing and the bookkeeping; a framework supplies the step
and, in its built-in mode, its own input pipeline (its folder's pipeline.py), which must yield exactly the
batches of that order.

A run has `world` processes (1 unless an engine runs several); each one calls `train` with its rank and
trains on its contiguous part of every global batch, dividing the summed gradient by the global batch
size. `summarize` merges the per-process records into one run.
"""
import collections
import dataclasses
import hashlib

import numpy as np

from common.batches import Order
from common.buckets import bucket_bytes
from common.interface import Network, StepSettings
from common.loss_scaling import LossScaling, Scaler
from common.models import has_batchnorm, init_bn_state, init_weights
from common.optim import Optimizer
from common.precision import needs_loss_scaling
from common.sharding import evaluation_rows, micro_batch_count
from common.zero import ITEMSIZE, SHARD_ENGINES

from ..loader import load_module
from .timing import Timer

LOGGED_STEPS = 2000   # per-step losses kept, for the parity checks and the loss curves


class Scratch:
    """The recipe from scratch: one replica per device, the network as its framework writes it (`model`, a Functional
    of lenet.py or resnet.py, in the run's layout) and the framework's one train_step, with the run's settings (the
    all-reduce's buckets, the compiled units: common.interface.StepSettings)."""
    world = 1   # the processes sharing each batch: feed() says, and a runner stepped by hand is one process

    def __init__(self, fw, devices, network=Network(), model=None, settings=StepSettings()):
        self.fw, self.devices, self.network, self.settings = fw, devices, network, settings
        self.functional = model or functional(fw, network)

    def initial_weights(self, seed, init):
        return init_weights(self.network.name, seed, init, width_of(self.network))

    def start(self, weights, optimizer, state=None, scaler=None):
        """The replicas, their BatchNorm state (None each for the LeNet) and, for a stateful optimizer, each one's
        state (the recipe's sgd has none): zero, or the canonical `state` of a checkpoint. At fp16, the loss scaler:
        from the first scale, or from a checkpoint's `scaler` (common.loss_scaling.ScalerState)."""
        self.replicas = [self.functional.get_params(weights, d) for d in self.devices]
        self.bn_states = [self.functional.get_bn_state(self.network.bn_state, d) for d in self.devices]
        if self.network.loss_scaling is not None:
            self.settings = self.settings._replace(scaler=Scaler(self.network.loss_scaling, scaler))
        self.states = None if optimizer.is_recipe else [
            self.fw.init_state(r, optimizer) if state is None else self.fw.state_from_numpy(state, r, optimizer,
                                                                                            self.functional)
            for r in self.replicas]

    def feed(self, data, order, rank, world):
        self.data, self.order, self.rank, self.world = data, order, rank, world

    def batches(self, epoch):
        """The recipe's feeding: numpy rows of this process's part of every global batch; the step copies
        them to the devices (split_and_load)."""
        for rows, _ in self.order.parts(epoch, self.rank, self.world):
            yield self.data.X_train[rows], self.data.y_train[rows]

    def step(self, batch, lr, batch_size):
        X, y = batch
        settings = self.settings
        if settings.accumulate > 1:
            settings = settings._replace(accumulate=self.micro_batches(batch_size, settings.accumulate))
        return self.fw.train_step(self.functional, self.replicas, self.bn_states, X, y, self.devices, lr, batch_size,
                                  self.states, settings)

    def micro_batches(self, batch_size, accumulate):
        """This batch's micro-batches per device under --accumulate: the same on every device of every process."""
        return micro_batch_count(batch_size, len(self.devices) * self.world, accumulate)

    def whole(self):
        """The replicas, whole: under --shard parameters (after the first step) gathered from every device's and
        process's slices, a collective which every process calls."""
        if self.settings.shard == "parameters" and isinstance(self.replicas[0], dict):
            return self.fw.gather_params(self.replicas, self.settings.bucket_bytes)
        return self.replicas

    def weights(self):
        return self.functional.to_numpy(self.whole()[0])

    def scaler_state(self):
        """fp16's loss scaler between steps (common.loss_scaling.ScalerState), what a checkpoint keeps; None: no loss
        scaling."""
        return None if self.settings.scaler is None else self.settings.scaler.state()

    def skipped_steps(self):
        """The steps fp16's loss scaler has skipped since start(): they move no schedule (common/loss_scaling.py)."""
        return 0 if self.settings.scaler is None else self.settings.scaler.skipped

    def loss_scale(self):
        """The scale the next step runs at (None: no loss scaling)."""
        state = self.scaler_state()
        return None if state is None else float(state.scale)

    def optimizer_state(self):
        """The first replica's optimizer state, canonical (common.optim.init_state's form). Sharded (--shard), every
        device's and process's slices gathered into it: a collective, which every process calls."""
        states = self.states
        if self.sharded():
            states = self.fw.gather_states(states, self.whole(), self.settings.bucket_bytes)
        return self.fw.state_to_numpy(states[0], self.functional)

    def sharded(self):
        """Whether the states are in their sharded form: --shard, after the first step has cut them."""
        return self.settings.shard != "none" and bool(self.states) and "shard" in self.states[0]

    def state_bytes(self):
        """The bytes of optimizer state one device holds (the first; the recipe's SGD has none): its slices when
        sharded."""
        return self.fw.state_bytes(self.states[0]) if self.states else 0

    def parameter_bytes(self):
        """The bytes of parameters one device holds between steps (the first; float32 master weights): its slices
        under --shard parameters, else its whole replica."""
        held = self.replicas[0]["slices"] if isinstance(self.replicas[0], dict) else self.replicas[0]
        return sum(int(np.prod(tuple(p.shape))) for p in held) * ITEMSIZE

    def evaluate(self, X, y):
        return self.fw.evaluate(self.functional, self.whole()[0], self.bn_states[0], X, y)

    def total(self, count):
        """`count` summed over the run's processes by the run's own collective (its distributed.py's sum_count)."""
        return count if self.world == 1 else load_module(self.fw.name, "distributed").sum_count(count)

    def spread(self):
        """Largest |difference| between any replica's weights and the first one's: 0 when in sync."""
        replicas = self.whole()
        first = self.functional.to_numpy(replicas[0])
        return max((float(np.max(np.abs(self.functional.to_numpy(r)[k] - first[k])))
                    for r in replicas[1:] for k in first), default=0.0)

    def sync(self):
        self.fw.sync(self.devices)

    def replica_bn_states(self):
        """Each replica's running statistics, canonical ([] for a network without BatchNorm)."""
        return [self.functional.bn_state_to_numpy(s) for s in self.bn_states if s is not None]

    def bn_state(self):
        """The running statistics a checkpoint keeps and evaluation uses: the first replica's (None: no BatchNorm)."""
        states = self.replica_bn_states()
        return states[0] if states else None


class Builtin(Scratch):
    """The framework's own data-parallel engine (its folder's builtin.py), fed by the framework's own input
    pipeline (its pipeline.py: DataLoader, tf.data, Gluon DataLoader, a global jax.Array). An engine (builtin.py,
    idiomatic.py) defines get_model(weights, devices, optimizer=None, state=None) -> common.interface.Model,
    train_step(model, batch, lr, batch_size) -> mean loss, to_numpy(model), optimizer_state(model) (canonical)
    and evaluate(model, X, y); with a stateful optimizer its own schedule sets the rate, and lr is the spec's."""

    def __init__(self, fw, devices, network=Network(), bucket_bytes=None, accumulate=1, allreduce_dtype="fp32",
                 shard="none"):
        self.fw, self.devices, self.network, self.bucket_bytes = fw, devices, network, bucket_bytes
        self.accumulate, self.allreduce_dtype, self.shard = accumulate, allreduce_dtype, shard
        self.engine = load_module(fw.name, "builtin")
        self.pipeline = load_module(fw.name, "pipeline")

    def start(self, weights, optimizer, state=None, scaler=None):
        """The engine's model and its trainer: the framework's own optimizer and schedule computing `optimizer`,
        from the canonical `state` of a checkpoint if given; the network and, for the ResNet, its BatchNorm; at fp16
        the framework's own loss scaler, carrying on from a checkpoint's `scaler` if given."""
        extra = {} if self.bucket_bytes is None else {"bucket_bytes": self.bucket_bytes}   # engines that bucket (JAX)
        if self.allreduce_dtype != "fp32":   # engines that can put bf16 on the wire (common.precision.WIRE_ENGINES)
            extra["allreduce_dtype"] = self.allreduce_dtype
        if self.shard != "none":   # engines that shard (common.zero.SHARD_ENGINES)
            extra["shard"] = self.shard
        self.model = self.engine.get_model(weights, self.devices, optimizer, state=state, network=self.network, **extra)
        if scaler is not None and self.network.loss_scaling is not None:
            self.engine.restore_scaler(self.model, scaler)

    def feed(self, data, order, rank, world):
        self.world = world
        self.loader = self.pipeline.make_loader(data, order, rank, world, self.model, self.devices)

    def batches(self, epoch):
        return self.pipeline.batches(self.loader, epoch)

    def step(self, batch, lr, batch_size):
        return self.engine.train_step(self.model, batch, lr, batch_size,
                                      accumulate=self.micro_batches(batch_size, self.accumulate))

    def weights(self):
        return self.engine.to_numpy(self.model)

    def scaler_state(self):
        return None if self.network.loss_scaling is None else self.engine.scaler_state(self.model)

    def skipped_steps(self):
        return 0   # with a schedule the engine's own optimizer sets the rate, by the updates it counts itself

    def optimizer_state(self):
        return self.engine.optimizer_state(self.model)

    def save_shards(self, path, optimizer, replacing):
        """Every rank's shard of the weights and the optimizer's state into the framework's own sharded checkpoint at
        `path` (its engine's save_sharded; common.zero.SHARDED_CHECKPOINTS), a collective: `replacing()` gives rank 0
        a temporary directory that replaces the checkpoint once written, where the framework does not commit it
        itself."""
        self.engine.save_sharded(self.model, path, optimizer, replacing)

    def state_bytes(self):
        """What an engine that shards (common.zero.SHARD_ENGINES) measures of its optimizer's state on one device,
        sharded or not; None for the others."""
        return self.engine.state_bytes(self.model) if self.fw.name in SHARD_ENGINES else None

    def parameter_bytes(self):
        return self.engine.parameter_bytes(self.model) if self.fw.name in SHARD_ENGINES else None

    def evaluate(self, X, y):
        return self.engine.evaluate(self.model, X, y)

    def spread(self):
        return None   # the engine keeps its replicas itself; equality is tested through to_numpy

    def replica_bn_states(self):
        return self.engine.replica_bn_states(self.model) if has_batchnorm(self.network.name) else []

    def bn_state(self):
        return self.engine.bn_state(self.model) if has_batchnorm(self.network.name) else None

    def exec_name(self):
        """The engine's EXEC; a framework with two built-in engines (PyTorch) names each by its model's class, one with
        two forms (JAX) by a function of the model."""
        names = self.engine.EXEC
        if callable(names):
            return names(self.model)
        return names[type(self.model.net)] if isinstance(names, dict) else names


    def layout_name(self):
        """The engine's LAYOUT; an engine whose layout depends on its model (PyTorch's FSDP2) gives a function of it."""
        names = self.engine.LAYOUT
        return names(self.model) if callable(names) else names


class Idiomatic(Builtin):
    """The framework's minimal single-device loop (its folder's idiomatic.py: net, trainer, loss):
    the reference that shows what the from-scratch harness costs. Fed numpy batches, as the recipe is."""

    def __init__(self, fw, devices, network=Network(), bucket_bytes=None, accumulate=1, allreduce_dtype="fp32",
                 shard="none"):
        self.fw, self.devices, self.network, self.bucket_bytes = fw, devices, network, None   # one device: no sum
        self.accumulate, self.allreduce_dtype, self.shard = accumulate, "fp32", "none"
        self.engine = load_module(fw.name, "idiomatic")

    feed, batches = Scratch.feed, Scratch.batches

    def state_bytes(self):
        return None   # the reference loop is one device's: nothing to shard

    def parameter_bytes(self):
        return None

    def step(self, batch, lr, batch_size):
        X, y = batch
        return self.engine.train_step(self.model, X, y, self.devices, lr, batch_size,
                                      accumulate=self.micro_batches(batch_size, self.accumulate))


MODES = {"scratch": Scratch, "builtin": Builtin, "idiomatic": Idiomatic}


def network_of(spec):
    """The network a run trains (common.interface.Network): its name, its initial BatchNorm state, its --bn, its
    --precision and, at fp16, the dynamic loss scaling that precision needs (common/loss_scaling.py)."""
    scaling = LossScaling(spec.loss_scale, spec.loss_scale_interval) if needs_loss_scaling(spec.precision) else None
    return Network(spec.model, init_bn_state(spec.model, spec.width), spec.bn == "sync", spec.precision, scaling)


def width_of(network):
    """The ResNet's width, read off its BatchNorm state; None for the LeNet."""
    return None if network.bn_state is None else len(network.bn_state["stem.bn.running_mean"])


def functional(fw, network, layout="default"):
    """The network as the scratch step trains it: its framework's Functional (lenet.py's, or resnet.py's with the
    run's BatchNorm), computing at the network's precision, in `layout` (execution.layout's key; 'default': the
    network's own default, which is the framework's usual layout but for PyTorch's ResNet, NCHW: its resnet.py says
    why)."""
    fields = {"precision": network.precision}
    if layout != "default":
        fields["layout"] = load_module(fw.name, "execution").layout(layout)
    if has_batchnorm(network.name):
        return load_module(fw.name, "resnet").Functional(sync=network.sync, **fields)
    return load_module(fw.name, "lenet").Functional(**fields)


def runner(spec, fw, devices):
    """The mode's runner for the spec's network; the scratch one with the spec's layout, exec level and all-reduce."""
    network = network_of(spec)
    if spec.mode != "scratch":
        return MODES[spec.mode](fw, devices, network, bucket_bytes(spec.allreduce), spec.accumulate,
                                spec.allreduce_dtype, spec.shard)
    model = functional(fw, network, spec.layout)
    units = load_module(fw.name, "execution").compile(spec.exec, model)
    return Scratch(fw, devices, network, model, StepSettings(bucket_bytes(spec.allreduce), units, spec.accumulate,
                                                             allreduce_dtype=spec.allreduce_dtype, shard=spec.shard))


def steps_per_epoch(n, batch_size, min_size=1):
    return n // batch_size + (1 if n % batch_size >= min_size else 0)


def digest(weights):
    """A hash of all weights: every process holds the same replicas exactly, or the digests differ."""
    h = hashlib.sha256()
    for name in sorted(weights):
        h.update(np.ascontiguousarray(weights[name], dtype=np.float32).tobytes())
    return h.hexdigest()[:16]


# Where a run starts: from the initial weights at epoch 0, or (harness/training/checkpoints.py's resume_point) from a
# checkpoint's weights, canonical optimizer state and loss scaler (fp16's) after its epochs.
Start = collections.namedtuple("Start", "weights state first_epoch scaler", defaults=(None, None, 0, None))
# What a run calls outside its timers: progress(steps, total, loss) on rank 0, before_step(steps done, runner),
# after_epoch(epochs done, runner).
Hooks = collections.namedtuple("Hooks", "progress before_step after_epoch", defaults=(None, None, None))


def train(runner, data, spec, optimizer, rank=0, world=1, start=Start(), hooks=Hooks()):
    """Train this process's part of the run `spec` (harness/spec.py: epochs, batch size, seed and init, max_steps to
    stop early, target_accuracy to evaluate after every epoch); return its record: loss sums and sizes rather than
    means, so that processes with shards of different sizes merge exactly. `optimizer` (common/optim.py) is the
    update and its schedule, each step's rate passed to the step. A resumed run starts from `start` (the remaining
    epochs see the batches the uninterrupted run would); the hooks run outside the timers, and so does the
    evaluation after each epoch (time to accuracy)."""
    epochs, batch_size, min_size, max_steps = spec.epochs, spec.batch_size, spec.devices, spec.max_steps
    first_epoch, progress, before_step, after_epoch = start.first_epoch, *hooks
    weights = runner.initial_weights(spec.seed, spec.init) if start.weights is None else start.weights
    runner.start(weights, optimizer, start.state, start.scaler)
    order = Order(len(data.y_train), batch_size, spec.seed, min_size)
    runner.feed(data, order, rank, world)
    record = {"epoch_loss_sums": [], "epoch_sizes": [], "epoch_seconds": [], "epoch_input_seconds": [],
              "step_loss_sums": [], "step_sizes": [], "step_seconds": [], "first_step_seconds": None,
              "first_step_images": 0,
              "images": 0, "first_epoch": first_epoch, "epoch_test_accuracies": []}
    steps = 0
    # The schedule's position: the updates that ran before this run (a resumed optimizer's count: fp16 may skip steps)
    updates_before = (first_epoch * steps_per_epoch(len(data.y_train), batch_size, min_size) if start.state is None
                      else start.state["step"])
    total_steps = (epochs - first_epoch) * steps_per_epoch(len(data.y_train), batch_size, min_size)
    if max_steps is not None:
        total_steps = min(total_steps, max_steps)
    for epoch in range(first_epoch, epochs):
        parts = order.parts(epoch, rank, world)
        if max_steps is not None:
            parts = parts[:max_steps - steps]
        if not parts:
            break
        loss_sum, size, waited = 0.0, 0, 0.0
        with Timer(runner.sync) as epoch_timer:
            feed = iter(runner.batches(epoch))
            for rows, global_size in parts:
                if before_step:
                    before_step(steps, runner)
                with Timer() as wait:   # the input pipeline's cost: how long the loop waits for a batch
                    batch = next(feed)
                waited += wait.seconds
                first = steps == 0   # one-off costs: tracing, allocation, caches
                lr = optimizer.learning_rate(updates_before + steps - runner.skipped_steps())
                with Timer(runner.sync if first else lambda: None) as t:
                    loss = runner.step(batch, lr, global_size)
                if first:
                    record["first_step_seconds"], record["first_step_images"] = t.seconds, global_size
                # batch and step, ended by the loss as a host number (an asynchronous engine's update may run on into
                # the next step: MXNet's; the mean holds, the step-to-step spread is smoothed)
                record["step_seconds"].append(wait.seconds + t.seconds)
                steps += 1
                record["images"] += global_size
                if progress and rank == 0:
                    progress(steps, total_steps, loss)
                loss_sum, size = loss_sum + loss * len(rows), size + len(rows)
                if steps <= max(LOGGED_STEPS, max_steps or 0):
                    record["step_loss_sums"].append(loss * len(rows))
                    record["step_sizes"].append(len(rows))
        record["epoch_loss_sums"].append(loss_sum)
        record["epoch_sizes"].append(size)
        record["epoch_seconds"].append(epoch_timer.seconds)
        record["epoch_input_seconds"].append(waited)
        if spec.target_accuracy is not None:
            record["epoch_test_accuracies"].append(shared_accuracy(runner, data, rank, world))
        if after_epoch:
            after_epoch(epoch + 1, runner)
    finished = len(record["epoch_test_accuracies"]) == len(record["epoch_seconds"]) > 0   # evaluated already
    record["test_accuracy"] = (record["epoch_test_accuracies"][-1] if finished
                               else shared_accuracy(runner, data, rank, world))
    record["evaluated_by"] = world
    record["replica_spread"] = runner.spread()
    record["optimizer_state_bytes_per_device"] = runner.state_bytes()
    record["parameter_bytes_per_device"] = runner.parameter_bytes()
    record["final_loss_scale"] = runner.loss_scale()   # fp16's, the next step's were there one (None: no scaling)
    record["digest"] = digest(runner.weights())
    record["bn_digests"] = [digest(s) for s in runner.replica_bn_states()]   # one per replica: equal, or not
    return record


def shared_accuracy(runner, data, rank, world):
    """The accuracy on the whole test split, which the run's processes share: each evaluates its own rows
    (common.sharding.evaluation_rows: nothing counted twice, nothing dropped) and the correct counts are summed by the
    run's collective, so every process gets the same accuracy, the one a single process would."""
    n = len(data.y_test)
    start, stop = evaluation_rows(n, rank, world)
    # evaluate() gives the fraction of its rows that are right, count / rows: the count comes back exactly
    correct = 0
    if stop > start:
        correct = round(runner.evaluate(data.X_test[start:stop], data.y_test[start:stop]) * (stop - start))
    return runner.total(correct) / n


def fed_rows(runner, data, epochs, batch_size, seed=0, rank=0, world=1, min_size=1):
    """The rows a built-in runner's input pipeline hands each of this process's devices, step by step, for
    `epochs` epochs (labels replaced by row numbers, so the batches say which rows they hold): the tests
    compare them with the shared order."""
    data = dataclasses.replace(data, y_train=np.arange(len(data.y_train)))
    runner.start(runner.initial_weights(seed, "he"), Optimizer())
    runner.feed(data, Order(len(data.y_train), batch_size, seed, min_size), rank, world)
    return [[[y.tolist() for _, y in runner.pipeline.per_device(batch)] for batch in runner.batches(epoch)]
            for epoch in range(epochs)]


def time_to_accuracy(epoch_seconds, accuracies, target, first_epoch=0):
    """The training seconds (the epochs' own, evaluation left out) and epochs until the test accuracy first reached
    `target` (checked after every epoch), or None and None where it never did; {} without a target. A run resumed
    after `first_epoch` epochs counts its epochs from the start and its seconds from there: the time before the
    checkpoint is not this run's (first_epoch says so beside them)."""
    if target is None or not accuracies:
        return {}
    reached = next((i for i, accuracy in enumerate(accuracies) if accuracy >= target), None)
    seconds = None if reached is None else float(np.sum(epoch_seconds[:reached + 1]))
    return {"target_accuracy": target, "seconds_to_target": seconds,
            "epochs_to_target": None if reached is None else first_epoch + reached + 1}


def most(records, key):
    """The most any process's record holds of `key` (bytes one device keeps), None where no record measured it."""
    return max((r.get(key) for r in records), key=lambda b: -1 if b is None else b)


def summarize(records):
    """Merge the records of all processes (one for an in-process run) into the run's measurements."""
    add = lambda key: np.sum([r[key] for r in records], axis=0)   # noqa: E731
    epoch_seconds = np.max([r["epoch_seconds"] for r in records], axis=0)   # the slowest process sets the pace
    input_seconds = np.max([r.get("epoch_input_seconds", [0.0] * len(epoch_seconds)) for r in records], axis=0)
    train_seconds = float(epoch_seconds.sum())
    first = max(r["first_step_seconds"] for r in records)
    steady_seconds = train_seconds - first
    steady_images = records[0]["images"] - records[0]["first_step_images"]
    spreads = [r["replica_spread"] for r in records if r["replica_spread"] is not None]
    device_peaks = [r["peak_device_memory_bytes"] for r in records if r.get("peak_device_memory_bytes") is not None]
    bn_digests = sum((r.get("bn_digests") or [] for r in records), [])
    return {
        "train_seconds": train_seconds,
        "first_step_seconds": first,
        "epoch_seconds": epoch_seconds.tolist(),
        "epoch_seconds_median": float(np.median(epoch_seconds)),
        "epoch_input_seconds": input_seconds.tolist(),
        "input_seconds_median": float(np.median(input_seconds)),
        "images_per_second": steady_images / steady_seconds if steady_images and steady_seconds > 0 else None,
        "epoch_losses": (add("epoch_loss_sums") / add("epoch_sizes")).tolist(),
        "step_losses": (add("step_loss_sums") / add("step_sizes")).tolist(),
        "test_accuracy": records[0]["test_accuracy"],
        "evaluated_by": records[0].get("evaluated_by"),   # how many processes shared the test split (shared_accuracy)
        "epoch_test_accuracies": records[0].get("epoch_test_accuracies") or None,
        **time_to_accuracy(epoch_seconds, records[0].get("epoch_test_accuracies"),
                           (records[0].get("spec") or {}).get("target_accuracy"), records[0].get("first_epoch", 0)),
        "replica_spread": max(spreads) if spreads else None,
        # the optimizer's state one device holds (the most any holds; under --shard its slices): None for an engine
        "optimizer_state_bytes_per_device": most(records, "optimizer_state_bytes_per_device"),
        "parameter_bytes_per_device": most(records, "parameter_bytes_per_device"),   # its slices at --shard parameters
        # BatchNorm: how many different running states the run's replicas (every process's) ended with, of how many
        "bn_states": len(set(bn_digests)) if bn_digests else None,
        "bn_replicas": len(bn_digests) if bn_digests else None,
        "exec": records[0].get("exec"),
        "compiles": records[0].get("compiles"),
        "layout": records[0].get("layout"),
        "first_epoch": records[0].get("first_epoch", 0),   # > 0: resumed from a checkpoint of that epoch
        "startup_seconds": max(r.get("startup_seconds", 0.0) for r in records),
        "peak_rss_bytes": max(r.get("peak_rss_bytes", 0) for r in records),
        "train_memory_bytes": max((r["train_memory_bytes"] for r in records if r.get("train_memory_bytes")),
                                  default=None),
        "peak_device_memory_bytes": sum(device_peaks) if device_peaks else None,   # each process's own GPUs
        "final_loss_scale": records[0].get("final_loss_scale"),   # fp16's; merge_records: the same in every process
    }
