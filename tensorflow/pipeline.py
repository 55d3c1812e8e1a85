"""TensorFlow's input pipeline: tf.data, handed to the strategy. distribute_datasets_from_function calls the
dataset function once per input pipeline (one per worker process) and tells it which one it is
(input_pipeline_id of num_input_pipelines); the dataset yields per-replica batches, and the strategy deals
them to the worker's replicas in turn. So each process's dataset holds its part of every global batch
(common.batches), cut into its replicas' contiguous shards, in that order. (experimental_distribute_dataset
would instead split global batches its own way across processes and replicas.)"""
import ctypes
import ctypes.util
import itertools
import types

import numpy as np
import tensorflow as tf

from common.sharding import shard_bounds


def replica_rows(order, epoch, pipeline, pipelines, replicas):
    """Index rows of every per-replica batch of this input pipeline, in the order the strategy deals them."""
    rows = []
    for part, _ in order.parts(epoch, pipeline, pipelines):
        rows += [part[a:b] for a, b in shard_bounds(len(part), replicas)]
    return rows


def make_loader(data, order, rank, world, model, devices):
    """The training set as two tensors in host memory, and one distributed iterator over every epoch, made here,
    before the timed loop, as Keras's fit makes one for all its epochs: making it takes 0.2-0.4 s (the strategy
    builds each replica's prefetching iterator), which made at every epoch's first batch was most of the loop's
    wait for input (docs/results.md)."""
    with tf.device("/device:CPU:0"):
        X, y = tf.constant(data.X_train), tf.constant(data.y_train)
    return start(types.SimpleNamespace(strategy=model.placement, order=order, X=X, y=y), 0)


def start(loader, epoch):
    """The loader's iterator from `epoch` on: each epoch's rows come from the shared order in Python, once an epoch."""
    replicas = len(loader.strategy.extended.worker_devices)   # this process's

    def dataset_fn(context):
        def rows(e):
            rows = replica_rows(loader.order, int(e), context.input_pipeline_id, context.num_input_pipelines,
                                replicas)
            return np.concatenate(rows).astype(np.int64), np.array([len(r) for r in rows], np.int64)
        epochs = tf.data.Dataset.counter(epoch).flat_map(lambda e: dataset(loader.X, loader.y, *tf.numpy_function(
            rows, [e], (tf.int64, tf.int64), stateful=False)))
        return epochs.repeat()   # endless already; repeat() says so (its length infinite, not unknown)
    loader.iterator = iter(loader.strategy.distribute_datasets_from_function(dataset_fn))
    keep_freed_memory()   # making the iterator changed malloc's threshold (its GeneratorDataset): set it back
    loader.epoch = epoch
    return loader


def dataset(X, y, flat_rows, lengths):
    """One epoch's per-replica batches, from their rows end to end and each batch's length; gathered and prefetched
    in the background."""
    def gather(index):
        return tf.gather(X, index), tf.gather(y, index)
    flat_rows.set_shape([None])
    lengths.set_shape([None])
    ragged = tf.RaggedTensor.from_row_lengths(flat_rows, lengths)
    return tf.data.Dataset.from_tensor_slices(ragged).map(gather).prefetch(tf.data.AUTOTUNE)


# glibc's mallopt parameters, and the values glibc's own adaptive threshold stops at on 64-bit (malloc/malloc.c:
# DEFAULT_MMAP_THRESHOLD_MAX, and a trim threshold twice the mmap threshold, as the adaptive rule sets it)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD, TRIM_THRESHOLD = 32 << 20, 64 << 20


def keep_freed_memory():
    """Undo what making the strategy's iterator did to the whole process's malloc. Its kernels include a
    GeneratorDataset, whose construction calls TensorFlow's ApplyPython311MemoryPatch (seen in gdb: mallopt(
    M_MMAP_THRESHOLD, 131072)), a fix for from_generator's memory growth under Python 3.11 that also turns off
    glibc's adaptive threshold. From then on every buffer over 128 KiB, the step's activations and gradients
    included, is a fresh mmap that the kernel zero-fills page by page and unmaps when freed: the LeNet's step at
    batch 256 took 23,000 minor page faults and 65 ms of system time instead of 360 and 2 ms, 1.5x its time
    (docs/profiling.md). Set back to where glibc's adaptive threshold would settle, freed buffers are reused. On a
    C library without mallopt (not glibc) there is nothing to undo."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    if hasattr(libc, "mallopt"):
        libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)
        libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)


def batches(loader, epoch):
    """The epoch's steps from the run's one iterator (every process has its part of every global batch). The
    iterator never ends, as an epoch's dataset of known length would need: with batches whose shapes are not static,
    the strategy's iterator would then fetch every batch as an optional and agree on whether any replica got one,
    across workers an all-reduce in each next() (input_lib's _enable_get_next_as_optional)."""
    if loader.epoch != epoch:   # a resumed run, an epoch left unfinished (max_steps): start again there
        start(loader, epoch)
    steps, loader.epoch = len(loader.order.batches(epoch)), None
    for step, batch in enumerate(itertools.islice(loader.iterator, steps), 1):
        if step == steps:   # taken the last one: the iterator stands at the next epoch (the loop stops asking here)
            loader.epoch = epoch + 1
        yield batch


def per_device(batch):
    """What each of this process's devices holds of a batch, as numpy (X, y): for tests and readers."""
    X, y = (getattr(t, "values", (t,)) for t in batch)   # a PerReplica value, or a tensor for one replica
    return [(a.numpy(), b.numpy()) for a, b in zip(X, y)]
