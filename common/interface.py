"""The contract every framework folder implements: its files, the functions they define, and the errors
they raise. The machinery that loads a folder is harness/loader.py; nothing here imports a framework."""

import collections

FRAMEWORKS = ("pytorch", "mxnet", "tensorflow", "jax")

# The files of a framework folder, in reading order, and what each one must define.
FILES = ("devices", "lenet", "optimizer", "data_parallel")

CONTRACT = {
    # devices.py: what the framework calls a device.
    "gpu_count": "gpu_count() -> the number of GPUs this process sees (0 on a CPU-only machine), without "
                 "initialising the framework's devices (common.placement decides which of them are the process's).",
    "get_devices": "get_devices(n=None) -> list of device handles: all GPUs (the first n), else n virtual "
                   "CPU devices (1 when n is None). n < 1 or more GPUs than exist raises RosettaError.",
    "device_info": "device_info(devices) -> list of dicts: name, type, index, memory_bytes (None if unknown).",
    "sync": "sync(devices) -> None: wait until all queued work on the devices is done (for timers).",
    "peak_memory": "peak_memory(devices) -> peak GPU memory in bytes, summed over the devices; None on the CPU "
                   "or where the framework does not tell.",
    # lenet.py: the model of common/lenet.py, in this framework's ops.
    "get_params": "get_params(weights, device) -> replica: the canonical numpy weights, on one device.",
    "forward": "forward(replica, X) -> logits for a batch X already on the replica's device.",
    "to_numpy": "to_numpy(replica) -> dict of float32 numpy arrays in canonical (PyTorch) layout.",
    # optimizer.py: common/optim.py's canonical update by hand, its state kept per replica (identical on every one).
    "init_state": "init_state(replica, optimizer) -> one replica's state for a common.optim.Optimizer: its step "
                  "count and a zero buffer per slot and parameter, on the replica's device, in its layout.",
    "state_to_numpy": "state_to_numpy(state) -> common.optim.init_state's form: {'step': int, "
                      "'<slot>.<param name>': float32 array in canonical layout}.",
    "state_from_numpy": "state_from_numpy(arrays, replica, optimizer) -> a state as init_state makes it, holding "
                        "the canonical `arrays` (state_to_numpy's form), on the replica's device.",
    # data_parallel.py: the multi-device recipe.
    "split_and_load": "split_and_load(array, devices) -> list of len(devices) contiguous shards along axis 0, "
                      "sizes differing by at most one (common.sharding), shard i on devices[i].",
    "allreduce": "allreduce(tensors) -> the same list, every tensor now holding the element-wise sum.",
    "train_step": "train_step(replicas, X, y, devices, lr, batch_size=None, states=None) -> float: one "
                  "synchronous SGD step on a numpy batch (summed loss per shard, gradients summed across devices, "
                  "update divided by batch_size, the global batch size: len(X) unless processes share the batch), "
                  "returning the mean loss over X. With states (init_state's, one per replica), common/optim.py's "
                  "update at rate lr (this step's) instead, on the all-reduced mean gradient; the states advance.",
    "evaluate": "evaluate(replica, X, y) -> float: accuracy of one replica on numpy data.",
}


class RosettaError(Exception):
    """A problem the user can fix (bad option, missing data, framework not installed): shown as one line."""


class Unavailable(RosettaError):
    """This framework, file, mode, exec level or layout cannot run here: its row is skipped, with this reason."""


def choose(option, names, default, framework, what="mode", reasons=None):
    """The exec level or layout (`what`) a framework runs for `option` ('default' is its usual one), or
    Unavailable for one it lacks (a skipped row, not a failure), saying why where `reasons` knows."""
    option = default if option == "default" else option
    if option not in names:
        why = (reasons or {}).get(option, f"choose from {', '.join(names)}")
        raise Unavailable(f"{framework} has no {option!r} {what} here ({why})")
    return option


# What get_model returns in every builtin.py and idiomatic.py: the network and what trains it (named as Dive into
# Deep Learning names them in every framework) and, for a built-in engine, its handle on the devices the replicas
# live on (a device, the contexts, the strategy, the mesh); None for the single-device loop.
Model = collections.namedtuple("Model", "net trainer placement", defaults=(None,))
