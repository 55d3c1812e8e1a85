"""MXNet across processes: a `dist_sync` kvstore over ps-lite. A job is a scheduler, a server and the
workers, each the same program started with DMLC_* variables (a scheduler or server runs the moment it
imports mxnet, and exits when the workers are done); compare.py sets the same ones.

By hand on one machine, from the repo root: the same variables for every process, a role for each
(`{rank}` in the output path becomes the worker's rank, which the scheduler hands out):
    export DMLC_PS_ROOT_URI=127.0.0.1 DMLC_PS_ROOT_PORT=9091 DMLC_NUM_SERVER=1 DMLC_NUM_WORKER=2 \
           DMLC_NODE_HOST=127.0.0.1 DMLC_INTERFACE=lo
    SPEC='{"framework": "mxnet", "mode": "builtin", "devices": 2, "processes": 2, "dataset": "digits",
           "epochs": 3, "batch_size": 256, "lr": 0.1, "seed": 0}'
    DMLC_ROLE=scheduler python -m harness.run.worker "$SPEC" /dev/null &   # these two write no record
    DMLC_ROLE=server python -m harness.run.worker "$SPEC" /dev/null &
    DMLC_ROLE=worker python -m harness.run.worker "$SPEC" out-{rank}.json &
    DMLC_ROLE=worker python -m harness.run.worker "$SPEC" out-{rank}.json
    python compare.py --merge out-*.json    # the run's table row
On several machines: the same, one worker per machine, DMLC_PS_ROOT_URI the scheduler's address and
DMLC_NODE_HOST / DMLC_INTERFACE each machine's own address and network interface. Start them in any
order: each waits for the others; all of them exit when the workers are done. Several workers on one GPU
machine each need their slot there: ROSETTA_LOCAL_RANK=i ROSETTA_LOCAL_WORLD_SIZE=n (common/placement.py).
"""
import ctypes
import sys

import mxnet as mx
from mxnet.base import _LIB, check_call

KV = None      # the process's dist kvstore, once init_process has run
KEYS = {}      # (name, shape) -> the kvstore key declared for it
FIRST_KEY = 10_000   # past a gluon.Trainer's keys (its parameters' numbers, from 0), which share the kvstore


def backend(gpus):
    """dist_device_sync on GPUs: a worker sums its own GPUs' values on a GPU before the push (dist_sync
    would copy them to the CPU first); dist_sync on the CPU. Not `nccl`: MXNet's NCCL kvstore works in
    one process only (no server, no DMLC_* job), and only in builds with NCCL."""
    return "dist_device_sync" if gpus else "dist_sync"


def init_process(gpus):
    """Join the job named by the DMLC_* variables (this waits for every other process). `gpus`: this
    worker's own GPUs (common.placement); MXNet addresses them by index, nothing needs hiding. Returns
    (rank, world size)."""
    global KV
    KV = mx.kv.create(backend(gpus))
    return KV.rank, KV.num_workers


def shutdown():
    """A worker leaves when its kvstore is freed (here, or when the process exits if a Trainer still holds
    it): the workers meet at a barrier, then the server and scheduler exit by themselves. A worker that
    leaves on an exception skips that barrier, or it would hang: the others wait for its next push."""
    global KV
    if KV is not None and sys.exc_info()[0] is not None:
        check_call(_LIB.MXKVStoreSetBarrierBeforeExit(KV.handle, ctypes.c_int(0)))
    KV = None
    KEYS.clear()


def is_initialized():
    return KV is not None


def all_reduce(t, name):
    """The element-wise sum of t over all processes, in place: every worker pushes t under one key, the
    server adds the pushes up, every worker pulls the sum. `name` says what t is (a tuple: a gradient's index, a
    bucket's, a BatchNorm's sums), the same in every process; with t's shape it picks the key, so that a LeNet's and
    a ResNet's, or two bucket sizes', never share a key in one process. A key is declared (kv.init, itself a
    barrier) on its first use, so every process must use the same names in the same order."""
    key = KEYS.get((name, t.shape))
    if key is None:
        key = KEYS[name, t.shape] = FIRST_KEY + len(KEYS)
        KV.init(key, t)
    KV.pushpull(key, t, out=t)
    return t


def reduce_scatter(x, name):
    """This process's chunk (the rank's, len(x) / processes elements) of the element-wise sum of every process's flat
    x (`name`: all_reduce's). The kvstore has push and pull, no reduce-scatter: what comes closest is all_reduce (x
    summed in place, every process pulling the whole sum), then the chunk."""
    k = x.shape[0] // KV.num_workers
    return all_reduce(x, name)[KV.rank * k:(KV.rank + 1) * k]


def all_gather(x, name):
    """Every process's chunk x, concatenated in rank order. What comes closest with push and pull: each process
    writes its chunk at its place in a buffer of zeros, and all_reduce sums the buffers: x + 0 is x (a -0.0 comes
    back 0.0)."""
    k = x.shape[0]
    buffer = mx.nd.zeros((KV.num_workers * k,), x.context, dtype=x.dtype)
    buffer[KV.rank * k:(KV.rank + 1) * k] = x
    return all_reduce(buffer, name)


def sum_count(n):
    """The integer n summed over every worker (the test split's correct counts), through the kvstore as the
    gradients are; float64, exact for any count."""
    return int(all_reduce(mx.nd.array([n], dtype="float64"), ("correct count",)).asscalar())


def process_count():
    """The job's number of workers (the processes that train)."""
    return KV.num_workers


def rank():
    """This worker's rank, which the scheduler hands out: the chunk a reduce_scatter leaves it."""
    return KV.rank
