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
    # optimizer.py: common/optim.py's canonical update by hand, its state kept per replica (identical on every one).
    "init_state": "init_state(replica, optimizer) -> one replica's state for a common.optim.Optimizer: its step "
                  "count and a zero buffer per slot and parameter, on the replica's device, in its layout.",
    "state_to_numpy": "state_to_numpy(state, model) -> common.optim.init_state's form: {'step': int, "
                      "'<slot>.<param name>': float32 array in canonical layout}, named and laid out by `model` "
                      "(a Functional: the network whose replica the state belongs to).",
    "state_from_numpy": "state_from_numpy(arrays, replica, optimizer, model) -> a state as init_state makes it, "
                        "holding the canonical `arrays` (state_to_numpy's form), on the replica's device, in `model`'s "
                        "layout.",
    "state_bytes": "state_bytes(state) -> int: the bytes the state's buffers (every slot's) hold on their device: a "
                   "replica's whole state, or under --shard the slices its device owns (common/zero.py).",
    # data_parallel.py: the multi-device recipe, one step for every network.
    "split_and_load": "split_and_load(array, devices) -> list of len(devices) contiguous shards along axis 0, "
                      "sizes differing by at most one (common.sharding), shard i on devices[i].",
    "allreduce": "allreduce(tensors) -> the same list, every tensor now holding the element-wise sum.",
    "allreduce_gradients": "allreduce_gradients(grads, bucket_bytes=None, dtype='fp32') -> grads[d] (device d's list "
                           "of gradients) summed across devices and processes: one allreduce per parameter, or with "
                           "bucket_bytes one per bucket of common.buckets.plan's (each device's gradients flattened "
                           "into one buffer, summed, cut back into their shapes); the same sums either way. With "
                           "dtype 'bf16' the gradients go over the wire in bf16 (common.precision.summed_on_the_wire).",
    "reduce_scatter": "reduce_scatter(buffers, dtype='fp32') -> slices: one flat buffer of a unit per local device "
                      "(flattened in the framework's own element order, zero-padded to common.zero.chunk * the world's "
                      "devices) -> each local device's own slice of their sum over every device of every process "
                      "(common.zero: the owner of slice g is device g % devices of process g // devices), on its "
                      "device. dtype: the wire's, as allreduce's.",
    "all_gather": "all_gather(slices) -> buffers: each local device's own slice of a unit -> the whole flat (padded) "
                  "buffer, every device's and process's slices in owner order, on every local device.",
    "shard_states": "shard_states(states, replicas, bucket_bytes=None) -> states: each device's whole state "
                    "(init_state's or state_from_numpy's, one per replica) cut to the slices the device owns: every "
                    "slot's buffers of a unit (common.zero.groups of the parameters' sizes) flattened, padded and cut "
                    "(common.zero.bounds), a list of one slice a unit per slot; the step count and optimizer kept. "
                    "What --shard optimizer, gradients and parameters keep between steps.",
    "gather_states": "gather_states(states, replicas, bucket_bytes=None) -> states: the inverse of shard_states, every "
                     "device's and process's slices gathered (all_gather) into whole per-parameter buffers in the "
                     "replicas' shapes and layout, on every device: what state_to_numpy and a checkpoint read.",
    "shard_params": "shard_params(replicas, bucket_bytes=None) -> replicas: each device's whole list of parameters cut "
                    "to the slices it owns, what --shard parameters (ZeRO stage 3) keeps between steps: a dict "
                    "{'shard': (owner, world), 'slices': [one flat slice a unit, as shard_states cuts a slot], 'like': "
                    "what gather_params rebuilds the parameters from (their shapes, layout and device, no values)}.",
    "gather_params": "gather_params(replicas, bucket_bytes=None) -> replicas: the inverse of shard_params, each device's "
                     "whole list of parameters (as get_params makes them: shapes, layout, device, ready for "
                     "loss_and_grads) from every device's and process's slices (all_gather a unit): a collective "
                     "every process calls.",
    "train_step": "train_step(model, replicas, bn_states, X, y, devices, lr, batch_size=None, states=None, "
                  "settings=StepSettings()) -> float: one synchronous step of the network `model` (a Functional of "
                  "lenet.py or resnet.py) on a numpy batch: split_and_load, each device's summed loss and gradients "
                  "(model.loss_and_grads, BatchNorm state in and out), the gradients all-reduced (allreduce_gradients, "
                  "settings.bucket_bytes), the same update on every replica: the recipe's sgd, lr / batch_size times "
                  "the sum (batch_size: the global batch, len(X) unless processes share it), or with `states` "
                  "(init_state's, one per replica) common/optim.py's update at rate lr on the all-reduced mean "
                  "gradient, the states advancing. bn_states (one per replica; None each for a network without "
                  "BatchNorm) get the new running statistics in their slots. settings.units are execution.compile's "
                  "(None: every unit as written). With settings.scaler (common/loss_scaling.py) each device "
                  "differentiates its loss times scaler.scale, the all-reduced gradients are multiplied by 1/scale "
                  "and checked (unscale_gradients), the update is skipped where one is not finite, and "
                  "scaler.update(finite) runs. With settings.shard other than 'none' the states are shard_states' "
                  "(the step cuts whole ones itself on its first call): the gradients all-reduced ('optimizer') or "
                  "reduce_scatter'ed ('gradients'), each device's owned slices updated (the global norm for clipping "
                  "summed from every device's slices, an overflow anywhere skipping every device's update), the "
                  "slices all_gather'ed back into every replica. Returns the mean loss over X (unscaled).",
    "evaluate": "evaluate(model, replica, bn_state, X, y) -> float: accuracy of one replica on numpy data, in "
                "inference mode (a BatchNorm network normalises by the running statistics bn_state).",
}

# The run's settings of the scratch step (data_parallel.train_step's `settings`), passed, never set on a module:
# bucket_bytes: how the gradients are all-reduced (None: one all-reduce per parameter; else in common.buckets.plan's
# buckets of that many bytes: --allreduce bucketed); units: what runs compiled (execution.compile(level, model)'s dict,
# every name of data_parallel.UNITS as the exec level makes it; None: every unit as written); accumulate: the micro-batches
# each device's shard is cut into, their gradients added up on the device before the one all-reduce (--accumulate K:
# common.sharding.micro_batch_count gives each step's); scaler: the run's dynamic loss scaler (a
# common.loss_scaling.Scaler, None: no scaling), the one piece of the settings the step changes: it differentiates the
# loss times scaler.scale, unscales the all-reduced gradients, skips the update if any is not finite and calls
# scaler.update; allreduce_dtype: the gradients' precision on the wire (--allreduce-dtype, common/precision.py's
# summed_on_the_wire): "fp32", or "bf16" (each device's gradients cast to bf16 for the all-reduce, summed in bf16,
# widened back).
# shard: ZeRO's stage (--shard, common/zero.py): "none", the recipe's replicated step; "optimizer" (stage 1), the
# all-reduce, then each device updates the slices it owns with its slice of the optimizer state (the states are
# shard_states' form), then all_gather; "gradients" (stage 2), reduce_scatter in place of the all-reduce;
# "parameters" (stage 3), the replicas too held as shard_params' slices between steps: gather_params before the
# forward, reduce_scatter, each device's update of its slices, nothing gathered after.
StepSettings = collections.namedtuple("StepSettings", "bucket_bytes units accumulate scaler allreduce_dtype shard",
                                      defaults=(None, None, 1, None, "fp32", "none"))

# The networks the scratch step trains: lenet.py and resnet.py of every framework folder each define a class
# Functional, the network as the recipe writes it (weights as lists of tensors, forward as a function), with these
# members. Its settings are its fields: the memory layout (lenet.Functional(layout); resnet.Functional(layout, sync),
# sync for --bn sync). Frozen and hashable: a compiled step may take it as static.
MODELS = ("lenet", "resnet")

FUNCTIONAL = {
    "name": "name -> the network's name in common.models.MODELS: 'lenet' or 'resnet18'.",
    "param_names": "param_names -> the canonical parameter names, in the replica's order (common.lenet.PARAM_NAMES or "
                   "common.resnet.PARAM_NAMES).",
    "get_params": "get_params(weights, device) -> replica: the canonical numpy weights, on one device, in param_names "
                  "order and the model's layout.",
    "get_bn_state": "get_bn_state(state, device) -> the canonical numpy BatchNorm state (running means and variances) "
                    "on one device, in common.resnet.BN_STATE_NAMES order; None for a network without BatchNorm "
                    "(state None).",
    "loss_and_grads": "loss_and_grads(replicas, bn_states, X_shards, y_shards, devices) -> (losses, grads, bn_states): "
                      "each device's summed loss on its shard (already on its device), each replica's gradients "
                      "(grads[d], param_names order), and each replica's new BatchNorm state (the given ones for a "
                      "network without BatchNorm). The ResNet's forward is training-mode under CANONICAL_BN: with "
                      "sync False every replica normalises by its own shard's statistics and its running statistics "
                      "follow its shard; with sync True, at every BatchNorm the shards' per-channel moments are "
                      "all-reduced across this process's devices and across processes, every replica normalises by "
                      "the global batch's mean and biased variance, the backward passes through that all-reduce, and "
                      "every replica's running statistics become the global batch's.",
    "to_numpy": "to_numpy(replica) -> dict of float32 numpy arrays in canonical (PyTorch) layout.",
    "bn_state_to_numpy": "bn_state_to_numpy(bn_state) -> dict of float32 numpy arrays, BN_STATE_NAMES order ({} for "
                         "None).",
    "evaluate": "evaluate(replica, bn_state, X, y) -> float: accuracy in inference mode (the running statistics).",
}

# resnet.py also keeps the idiomatic network of every framework:
#   build_model(weights, bn_state, bn=CANONICAL_BN) -> the idiomatic model (nn.Module, Gluon HybridBlock, Keras model,
#       Flax NNX module) holding the canonical weights and state, its BatchNorm layers set to convention bn as far as
#       the framework's arguments reach (common.resnet.layer_arguments);
#   model_to_numpy(model) -> (weights, bn_state) of an idiomatic model, canonical numpy.

# The built-in engines (builtin.py) and the single-device loops (idiomatic.py) build the network they are given:
# get_model(weights, devices, optimizer=None, state=None, network=Network()). For the ResNet they also define
#   bn_state(model) -> the canonical numpy BatchNorm state this process's first replica holds (what a checkpoint
#                      keeps and evaluate uses);
#   replica_bn_states(model) -> one canonical numpy BatchNorm state per replica this process holds, as the engine
#                      keeps them (equal where it synchronises or broadcasts them, each its own where it does not);
# and evaluate(model, X, y) runs in inference mode. `bn_state` is the canonical initial state; `sync` asks for
# the framework's own synchronised BatchNorm (Unavailable, with the framework's reason, where it cannot run);
# `precision` is what the network computes in (common/precision.py: fp32, or bf16 or fp16 with fp32 master weights),
# by the framework's own mixed precision. The scratch step's Functional carries the same precision as a field.
# `loss_scaling` (a common.loss_scaling.LossScaling, or None) asks the engine for its own dynamic loss scaler, set to
# it: what fp16 needs. Engines then define scaler_state(model) -> that scaler between steps (a
# common.loss_scaling.ScalerState: what a checkpoint keeps) and restore_scaler(model, state), which carries on from one.
Network = collections.namedtuple("Network", "name bn_state sync precision loss_scaling",
                                 defaults=("lenet", None, False, "fp32", None))


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
# Deep Learning names them in every framework), for a built-in engine its handle on the devices the replicas live on
# (a device, the contexts, the strategy, the mesh; None for the single-device loop), the network's precision, and
# its mixed-precision form where the framework makes one beside the net (MXNet's AMP-converted graph over the same
# Parameters; PyTorch's GradScaler, disabled without loss scaling; the idiomatic JAX loop's loss scaler; None where
# the network itself carries the precision, as a Keras dtype policy does).
Model = collections.namedtuple("Model", "net trainer placement precision mixed", defaults=(None, "fp32", None))
