"""JAX devices: every GPU JAX sees; on a CPU-only machine, n virtual CPU devices. JAX fixes its CPU device
count when its backend starts (its first op), from `--xla_force_host_platform_device_count` in XLA_FLAGS:
harness/run/worker.py sets that flag before JAX is imported, as it sets thread counts. In a process that did
not (pytest, a notebook), the first call here asks for VIRTUAL_CPUS devices, as TensorFlow's split does.
On GPUs JAX would take 75% of every GPU it sees when it starts; here it allocates as it goes (like
TensorFlow's memory growth), so peak memory means something and co-located processes cannot starve."""
import importlib.util
import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")   # read when JAX's backend starts

import jax  # noqa: E402
from jax._src import xla_bridge  # noqa: E402

from common.interface import RosettaError  # noqa: E402
from common.placement import machine_gpus  # noqa: E402
from common.sharding import check_device_count  # noqa: E402

VIRTUAL_CPUS = 8
DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"
CUDA_PLUGINS = ("jax_cuda12_plugin", "jax_cuda13_plugin")   # what jax[cuda12] / jax[cuda13] install


def gpu_count():
    """The GPUs JAX will see, counted without starting its backend (jax.distributed.initialize must come
    first): when JAX's CUDA plugin is installed, those of JAX_LOCAL_DEVICE_IDS (JAX's own way to give a
    process its GPUs), else of CUDA_VISIBLE_DEVICES, else of the machine."""
    if not any(importlib.util.find_spec(name) for name in CUDA_PLUGINS):
        return 0
    if os.environ.get("JAX_LOCAL_DEVICE_IDS"):
        return len(os.environ["JAX_LOCAL_DEVICE_IDS"].split(","))
    return len(machine_gpus())


def split_cpu(n=VIRTUAL_CPUS):
    """n virtual CPU devices, unless the count is fixed already (by XLA_FLAGS, or a backend that started)."""
    if DEVICE_COUNT_FLAG not in os.environ.get("XLA_FLAGS", "") and not xla_bridge.backends_are_initialized():
        jax.config.update("jax_num_cpu_devices", n)


def get_devices(n=None):
    split_cpu(max(n or 1, VIRTUAL_CPUS))
    gpus = [d for d in jax.local_devices() if d.platform == "gpu"]   # this process's, in a multi-process run
    check_device_count(n, len(gpus))
    if gpus:
        return gpus[:n or len(gpus)]
    n = n or 1
    cpus = jax.local_devices(backend="cpu")
    if n > len(cpus):
        raise RosettaError(f"asked for {n} devices but JAX has {len(cpus)} CPU device(s), fixed when it "
                           f"started; set XLA_FLAGS={DEVICE_COUNT_FLAG}={n} before JAX runs anything")
    return cpus[:n]


def device_info(devices):
    info = []
    for i, d in enumerate(devices):
        if d.platform == "gpu":
            stats = d.memory_stats() or {}
            info.append({"name": d.device_kind, "type": "gpu", "index": d.id,
                         "memory_bytes": stats.get("bytes_limit")})
        else:
            info.append({"name": f"cpu (virtual device {d.id})", "type": "cpu", "index": i, "memory_bytes": None})
    return info


def sync(devices):
    """JAX dispatches every op asynchronously, CPU ones too: a timer must wait for the results. One array
    waits with `block_until_ready`; here every live array on the devices does, like MXNet's waitall."""
    mine = set(devices)
    jax.block_until_ready([a for a in jax.live_arrays() if a.devices() & mine])


def peak_memory(devices):
    """Peak memory of XLA's GPU allocator, summed over the GPUs; None on the CPU (see RSS)."""
    gpus = [d for d in devices if d.platform == "gpu"]
    return sum((d.memory_stats() or {}).get("peak_bytes_in_use", 0) for d in gpus) if gpus else None
