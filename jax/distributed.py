"""JAX across processes: jax.distributed. A worker joins from JAX_COORDINATOR_ADDRESS (process 0's
host:port, where process 0 serves the coordinator; JAX reads this variable itself), JAX_NUM_PROCESSES and
JAX_PROCESS_ID; compare.py sets the same ones. On the CPU the collectives between processes run over gloo.

By hand on one machine, from the repo root: one spec and coordinator for all processes, an id for each:
    SPEC='{"framework": "jax", "mode": "builtin", "devices": 2, "processes": 2, "dataset": "digits",
           "epochs": 3, "batch_size": 256, "lr": 0.1, "seed": 0}'
    export JAX_COORDINATOR_ADDRESS=127.0.0.1:12355 JAX_NUM_PROCESSES=2
    JAX_PROCESS_ID=0 python -m harness.run.worker "$SPEC" out-{rank}.json &
    JAX_PROCESS_ID=1 python -m harness.run.worker "$SPEC" out-{rank}.json
    python compare.py --merge out-*.json    # the run's table row
On several machines: the same, one process per machine, JAX_COORDINATOR_ADDRESS naming process 0's
machine, and GLOO_SOCKET_IFNAME each machine's network interface (see bind_gloo_to). Start them in any order:
each waits for the others.
"""
import functools
import os

import jax
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from common.interface import RosettaError

from .devices import gpu_count

TIMEOUT = int(float(os.environ.get("ROSETTA_COLLECTIVE_TIMEOUT", "300")))
VARIABLES = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")

_joined = False


def backend(gpus):
    """NCCL between GPUs (what XLA's GPU collectives use); gloo between CPU processes (JAX 0.7's default,
    said out loud: without it JAX refuses multi-process computations on the CPU)."""
    return "nccl" if gpus else "gloo"


def init_process(gpus):
    """Join the processes named by the JAX_* variables (this waits for every other process). Returns (rank,
    world size). `gpus`: this process's own GPUs among those it sees (common.placement); a JAX process
    computes on every local device it has, so it must see only its own (the launcher hides the others with
    CUDA_VISIBLE_DEVICES; by hand, JAX's own JAX_LOCAL_DEVICE_IDS does the same). Must run before JAX's
    backend starts: the backend is built with the job's collectives."""
    global _joined
    missing = [v for v in VARIABLES if v not in os.environ]
    if missing:
        raise RosettaError(f"a multi-process JAX run needs {', '.join(missing)} (see docs/usage.md)")
    if gpus != list(range(gpu_count())):
        raise RosettaError(f"a JAX process computes on every GPU it sees: this one sees {gpu_count()} and owns "
                           f"{len(gpus)}; start each process with CUDA_VISIBLE_DEVICES (or JAX_LOCAL_DEVICE_IDS) "
                           f"set to its own GPUs (docs/usage.md)")
    if backend(gpus) == "gloo":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        bind_gloo_to(os.environ.get("GLOO_SOCKET_IFNAME"))
    jax.distributed.initialize(num_processes=int(os.environ["JAX_NUM_PROCESSES"]),
                               process_id=int(os.environ["JAX_PROCESS_ID"]), initialization_timeout=TIMEOUT)
    _joined = True
    return jax.process_index(), jax.process_count()


def bind_gloo_to(interface):
    """JAX 0.7 builds its CPU collectives with gloo's default device, which binds to the address this machine's
    hostname resolves to: 127.0.0.1 on many machines, or nothing at all ("Unable to find address for: <hostname>"),
    and two hosts then never meet. JAX has no option for the interface (PyTorch reads GLOO_SOCKET_IFNAME), but the
    gloo factory it calls takes one: hand it the launcher's (harness/processes/cluster.py) before the backend is built."""
    if not interface:
        return
    from jax._src.lib import xla_client
    make = xla_client._xla.make_gloo_tcp_collectives
    xla_client._xla.make_gloo_tcp_collectives = functools.partial(make, interface=interface)


def shutdown():
    global _joined
    if _joined:
        jax.distributed.shutdown()
    _joined = False


def is_initialized():
    return _joined


@functools.cache
def process_mesh():
    """One device per process (each process's first), in process order: the axis to sum over."""
    firsts = {}
    for d in jax.devices():
        firsts.setdefault(d.process_index, d)
    return Mesh(np.array([firsts[p] for p in range(jax.process_count())]), ("processes",))


@functools.cache
def sum_over_processes():
    return jax.jit(lambda rows: rows.sum(0), out_shardings=NamedSharding(process_mesh(), P()))


def rows_of(x):
    """A global array over the process mesh whose row p is process p's x (this process gives its own row)."""
    mesh = process_mesh()
    (mine,) = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
    return jax.make_array_from_single_device_arrays((mesh.size, *x.shape), NamedSharding(mesh, P("processes")),
                                                    [jax.device_put(x[None], mine)])


def all_reduce(x):
    """The element-wise sum of x over all processes: each process's x is one row of a global array sharded
    over the process mesh, and a jitted sum over the rows makes XLA all-reduce across the processes. The
    result is replicated: this process's copy comes back."""
    return sum_over_processes()(rows_of(x)).addressable_data(0)


@functools.cache
def scattered_sum():
    return jax.jit(jax.shard_map(lambda row: lax.psum_scatter(row[0], "processes", tiled=True), mesh=process_mesh(),
                                 in_specs=P("processes"), out_specs=P("processes")))


@functools.cache
def gathered():
    return jax.jit(jax.shard_map(lambda row: lax.all_gather_invariant(row[0], "processes", tiled=True),
                                 mesh=process_mesh(), in_specs=P("processes"), out_specs=P()))


def reduce_scatter(x):
    """This process's chunk (the rank's, of `processes` equal ones) of the element-wise sum of x over all processes:
    the rows as all_reduce's, lax.psum_scatter under shard_map over the process mesh, so no process receives the
    whole sum (ZeRO's reduce-scatter, common/zero.py)."""
    return scattered_sum()(rows_of(x)).addressable_data(0)


def all_gather(x):
    """Every process's chunk x, concatenated in rank order, on every process: lax.all_gather under shard_map over
    the process mesh (reduce_scatter's inverse), its _invariant form, which tells shard_map that every process holds
    the same result (out_specs P(): replicated)."""
    return gathered()(rows_of(x)).addressable_data(0)


def sum_count(n):
    """The integer n summed over every process (the test split's correct counts), by XLA's all-reduce as above (int32:
    JAX's integers without x64)."""
    return int(all_reduce(np.array([n], np.int32))[0])
