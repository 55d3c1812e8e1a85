"""How a global batch is cut into per-device shards, and the test split into per-process parts: the same arithmetic
in every framework."""
from .interface import RosettaError


def shard_bounds(n, k):
    """(start, stop) of k contiguous shards of n rows; sizes differ by at most one, larger ones first
    (like numpy.array_split and MXNet's even_split=False)."""
    if k < 1:
        raise RosettaError(f"need at least one device, got {k}")
    if n < k:
        raise RosettaError(f"cannot split {n} rows across {k} devices: every device needs at least one row")
    base, extra = divmod(n, k)
    bounds, start = [], 0
    for i in range(k):
        stop = start + base + (1 if i < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def evaluation_rows(n, rank, world):
    """(start, stop) of process `rank`'s part of an n-image test split that `world` processes evaluate together:
    contiguous, sizes differing by at most one, every image counted once. The stock samplers pad or drop instead
    (PyTorch's DistributedSampler repeats images to even the parts; docs/usage.md). A process gets no rows only
    when there are more processes than images."""
    base, extra = divmod(n, world)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def micro_batch_count(global_size, devices, accumulate):
    """Gradient accumulation (--accumulate K): how many micro-batches every device's shard of a global batch of
    `global_size` rows over `devices` devices (of every process) is cut into: K, or the smallest shard's rows when a
    batch (an epoch's last) gives some device fewer. The same on every device and process, so that a synchronised
    BatchNorm's micro-batches meet in lock-step."""
    return max(1, min(accumulate, global_size // devices))


def micro_batches(n, count):
    """(start, stop) of the `count` micro-batches of a shard of n rows: contiguous, sizes differing by at most one."""
    return shard_bounds(n, count)


def check_device_count(n, available_gpus):
    """Validate a requested device count: n < 1 is always an error, more GPUs than exist too.
    On a CPU-only machine any n >= 1 is fine: the devices are virtual."""
    if n is None:
        return
    if not isinstance(n, int) or n < 1:
        raise RosettaError(f"the number of devices must be an integer >= 1, got {n!r}")
    if available_gpus and n > available_gpus:
        raise RosettaError(f"asked for {n} devices but only {available_gpus} GPU(s) exist")
