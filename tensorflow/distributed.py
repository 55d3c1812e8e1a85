"""TensorFlow across processes: MultiWorkerMirroredStrategy. A worker joins from TF_CONFIG (every
worker's host:port and its own index); compare.py sets it (harness/processes/cluster.py).

By hand on one machine, from the repo root: one spec and one cluster for all workers, an index for each:
    SPEC='{"framework": "tensorflow", "mode": "builtin", "devices": 2, "processes": 2, "dataset": "digits",
           "epochs": 3, "batch_size": 256, "lr": 0.1, "seed": 0}'
    CLUSTER='"cluster": {"worker": ["127.0.0.1:23456", "127.0.0.1:23457"]}'
    TF_CONFIG="{$CLUSTER, \"task\": {\"type\": \"worker\", \"index\": 0}}" \
        python -m harness.run.worker "$SPEC" out-{rank}.json &
    TF_CONFIG="{$CLUSTER, \"task\": {\"type\": \"worker\", \"index\": 1}}" \
        python -m harness.run.worker "$SPEC" out-{rank}.json
    python compare.py --merge out-*.json    # the run's table row
On several machines: the same, one worker per machine, the cluster naming each machine's host:port
(worker i is the i-th entry). Start them in any order: each waits for the others. On GPUs every worker
must see only its own (CUDA_VISIBLE_DEVICES=0 for the first worker of a machine, =1 for the next, ...).
"""
import os

import tensorflow as tf

from common.interface import RosettaError

from .devices import configure, gpu_count

TIMEOUT = float(os.environ.get("ROSETTA_COLLECTIVE_TIMEOUT", "300"))

STRATEGY = None   # the process's MultiWorkerMirroredStrategy, once init_process has run


def backend(gpus):
    """NCCL between GPUs (TensorFlow's GPU all-reduce); RING on the CPU, where there is no NCCL (and RING
    was faster than AUTO here: docs/results.md)."""
    implementation = tf.distribute.experimental.CommunicationImplementation
    return implementation.NCCL if gpus else implementation.RING


def init_process(gpus):
    """Join the workers named in TF_CONFIG. Returns (rank, world size). `gpus`: this worker's own GPUs
    among those it sees (common.placement); the strategy replicates onto every GPU a worker sees, so it
    must see only its own: the launcher hides the others with CUDA_VISIBLE_DEVICES. Must run before
    TensorFlow initialises: the strategy configures the runtime's collectives, so memory growth is set
    and the CPU split into logical devices first (neither can change later)."""
    global STRATEGY
    configure()
    if gpus != list(range(gpu_count())):
        raise RosettaError(f"MultiWorkerMirroredStrategy replicates onto every GPU a worker sees: this one sees "
                           f"{gpu_count()} and owns {len(gpus)}; start each worker with CUDA_VISIBLE_DEVICES "
                           f"set to its own GPUs (docs/usage.md)")
    options = tf.distribute.experimental.CommunicationOptions(implementation=backend(gpus),
                                                              timeout_seconds=TIMEOUT)
    STRATEGY = tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)
    resolver = STRATEGY.cluster_resolver
    return resolver.task_id, resolver.cluster_spec().num_tasks("worker")


def shutdown():
    """TensorFlow has no way to leave the cluster: the runtime stays up until the process exits."""
    global STRATEGY
    STRATEGY = None


def is_initialized():
    return STRATEGY is not None


def task():
    """(rank, processes): this worker's index among TF_CONFIG's workers and their number; (0, 1) alone."""
    if STRATEGY is None:
        return 0, 1
    resolver = STRATEGY.cluster_resolver
    return resolver.task_id, resolver.cluster_spec().num_tasks("worker")


def all_reduce(t):
    """The element-wise sum of t over all processes: the strategy's collective all-reduce, run in its one
    replica here (on the CPU it has one per process; on GPUs one per visible GPU: t would count twice). t is copied
    onto the replica's device first: a tensor a graph makes outside every tf.device scope (a gradient the tape builds,
    a flag reduced from every device's) has no device, and the collective takes its destination from its input's."""
    if len(STRATEGY.extended.worker_devices) != 1:
        raise RosettaError("the scratch mode across processes needs one visible GPU per TensorFlow worker")
    with tf.device(STRATEGY.extended.worker_devices[0]):
        placed = tf.identity(t)
    return STRATEGY.run(lambda v: tf.distribute.get_replica_context().all_reduce("sum", v), args=(placed,))


def reduce_scatter(x):
    """This process's chunk (its rank's, of `processes` equal ones) of the element-wise sum of every process's flat
    x. What comes closest: the strategy's replica context has an all-reduce and an all-gather but no reduce-scatter
    (TensorFlow's CollectiveReduceScatterV2 is a raw op the strategy never calls), so the strategy's all-reduce, then
    the rank's chunk: the same sums, at an all-reduce's traffic."""
    rank, processes = task()
    size = x.shape[0] // processes
    return all_reduce(x)[rank * size:(rank + 1) * size]


def all_gather(x):
    """Every process's chunk x, concatenated in rank order, on every process: the strategy's collective all-gather
    along axis 0, in its one replica here (as all_reduce). Its launcher gathers only inside a graph ("all_gather is
    not supported in eager mode"): called eagerly, it runs traced (EAGER_ALL_GATHER, a trace per shape), where its
    input has no device until tf.identity places it in the replica (the collective's destination)."""
    if len(STRATEGY.extended.worker_devices) != 1:
        raise RosettaError("the scratch mode across processes needs one visible GPU per TensorFlow worker")
    if tf.executing_eagerly():
        return EAGER_ALL_GATHER(x)
    return STRATEGY.run(lambda v: tf.distribute.get_replica_context().all_gather(tf.identity(v), axis=0), args=(x,))


EAGER_ALL_GATHER = tf.function(all_gather, reduce_retracing=True)


def sum_count(n):
    """The integer n summed over every worker (the test split's correct counts), by the strategy's collective."""
    return int(all_reduce(tf.constant([n], tf.int64)).numpy()[0])
