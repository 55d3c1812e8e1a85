"""Gradient buckets, written once: how `--allreduce bucketed` groups the parameters' gradients.

The recipe all-reduces one parameter at a time: 8 collectives a step for the LeNet, 76 for the ResNet-18, each
paying the latency of a collective across processes (a round trip through gloo, a kvstore server, TensorFlow's ring).
DistributedDataParallel instead flattens the gradients into buckets of at most `bucket_cap_mb` (25 MiB by default)
and all-reduces each bucket once. Every framework's data_parallel.allreduce_gradients does the same with this plan:
each device's gradients of a bucket concatenated into one flat buffer, one allreduce of the buffers, the sum cut back
into the parameters' shapes. The sums are element for element the per-tensor ones (tests/test_buckets.py).

DDP fills its buckets in reverse parameter order, because the backward produces the last layer's gradient first
and a full bucket's all-reduce overlaps the rest of the backward. The recipe all-reduces after the whole backward,
so nothing overlaps and the order does not matter: the buckets here follow the parameters' own order.
"""
ALLREDUCES = ("per-tensor", "bucketed")
# The built-in engines whose all-reduce the user writes, so can bucket (JAX's psum under shard_map: jax/builtin.py);
# the others sum their own way, as their builtin.py's ALLREDUCE says (DDP's buckets, TensorFlow's packs, MXNet's
# kvstore key by key).
BUCKETING_ENGINES = ("jax",)
BUCKET_MB = 25     # torch.nn.parallel.DistributedDataParallel's bucket_cap_mb
ITEMSIZE = 4       # float32 gradients


def bucket_bytes(allreduce):
    """data_parallel.BUCKET_BYTES for an --allreduce option: None (one all-reduce per parameter) or the cap."""
    if allreduce not in ALLREDUCES:
        raise ValueError(f"unknown all-reduce {allreduce!r}; choose from {ALLREDUCES}")
    return BUCKET_MB * 2**20 if allreduce == "bucketed" else None


def plan(sizes, cap_bytes):
    """The parameters' indices, bucket by bucket: consecutive parameters until the next one would pass `cap_bytes`
    (`sizes` in elements). A parameter larger than the cap gets a bucket of its own, as in DDP."""
    buckets, current, filled = [], [], 0
    for i, size in enumerate(sizes):
        if current and filled + size * ITEMSIZE > cap_bytes:
            buckets.append(current)
            current, filled = [], 0
        current.append(i)
        filled += size * ITEMSIZE
    return buckets + [current] if current else buckets
