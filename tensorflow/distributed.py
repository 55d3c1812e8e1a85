"""TensorFlow across processes: MultiWorkerMirroredStrategy. A worker joins from TF_CONFIG (every
worker's host:port and its own index); compare.py sets it, naming every worker on 127.0.0.1.

By hand on one machine, from the repo root: one spec and one cluster for all workers, an index for each:
    SPEC='{"framework": "tensorflow", "mode": "builtin", "devices": 2, "processes": 2, "dataset": "digits",
           "epochs": 3, "batch_size": 256, "lr": 0.1, "seed": 0}'
    CLUSTER='"cluster": {"worker": ["127.0.0.1:23456", "127.0.0.1:23457"]}'
    TF_CONFIG="{$CLUSTER, \"task\": {\"type\": \"worker\", \"index\": 0}}" \
        python -m common.worker "$SPEC" out-{rank}.json &
    TF_CONFIG="{$CLUSTER, \"task\": {\"type\": \"worker\", \"index\": 1}}" \
        python -m common.worker "$SPEC" out-{rank}.json
    python compare.py --merge out-*.json    # the run's table row
On several machines: the same, one worker per machine, the cluster naming each machine's host:port
(worker i is the i-th entry). Start them in any order: each waits for the others.
"""
import os

import tensorflow as tf

from common.interface import RosettaError

from .devices import split_cpu

TIMEOUT = float(os.environ.get("ROSETTA_COLLECTIVE_TIMEOUT", "300"))

STRATEGY = None   # the process's MultiWorkerMirroredStrategy, once init_process has run


def init_process():
    """Join the workers named in TF_CONFIG; RING all-reduce (faster than AUTO on the CPU). Returns (rank,
    world size). Must run before TensorFlow initialises: the strategy configures the runtime's collectives,
    so the CPU is split into logical devices first (they cannot be added later)."""
    global STRATEGY
    if not tf.config.list_physical_devices("GPU"):
        split_cpu()
    options = tf.distribute.experimental.CommunicationOptions(
        implementation=tf.distribute.experimental.CommunicationImplementation.RING, timeout_seconds=TIMEOUT)
    STRATEGY = tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)
    resolver = STRATEGY.cluster_resolver
    return resolver.task_id, resolver.cluster_spec().num_tasks("worker")


def shutdown():
    """TensorFlow has no way to leave the cluster: the runtime stays up until the process exits."""
    global STRATEGY
    STRATEGY = None


def is_initialized():
    return STRATEGY is not None


def all_reduce(t):
    """The element-wise sum of t over all processes: the strategy's collective all-reduce, run in its one
    replica here (on the CPU it has one per process; on GPUs one per visible GPU: t would count twice)."""
    if len(STRATEGY.extended.worker_devices) != 1:
        raise RosettaError("the scratch mode across processes needs one visible GPU per TensorFlow worker")
    return STRATEGY.run(lambda v: tf.distribute.get_replica_context().all_reduce("sum", v), args=(t,))
