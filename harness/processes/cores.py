"""How a run's processes use this machine's cores, fixed before the framework starts.

shared (the frameworks' usual setting): every op may use all of its process's threads. The replicas of one
  process then take turns on the same cores, so on a CPU 2 virtual devices do the work of 1.
per-device: each device gets cores of its own. Its process is pinned to them (the only limit XLA's CPU
  thread pool obeys), each op gets one device's share of threads, and the framework's schedulers get a
  thread per device (MXNet's engine has a worker pool per context; TensorFlow's inter-op pool runs
  independent ops side by side). N devices on N cores can then run in parallel, if the framework runs its
  replicas concurrently: that is what the benchmark's per-device rows measure.
In both, MXNet gets more scratch buffers (common/cpu_scratch.py): its ops draw their temporary space round robin
from one pool for all CPU contexts, 4 copies by default, and two ops given the same copy wait for each other. With
two contexts of the LeNet that made them take turns (their engine workers' CPU time summed to the wall time:
docs/profiling.md); 16 copies per context let them overlap, and Gluon's synchronised BatchNorm needs 128 not to hang.
"""
import os

from common import cpu_scratch

CORES = ("shared", "per-device")
CPUS_VARIABLE = "ROSETTA_CPUS"   # the cores a worker pins itself to, set by compare.py's launcher


def thread_env(threads, cores="shared", local_devices=1, sync_batchnorm=False):
    """The variables OpenMP, MKL, TensorFlow and MXNet read when they start (set them before the import).
    sync_batchnorm: the run synchronises BatchNorm across its devices (--bn sync), which MXNet's scratch buffers
    must allow for."""
    per_op = threads if cores == "shared" else max(1, threads // local_devices)
    env = {var: str(per_op) for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "TF_NUM_INTRAOP_THREADS")}
    if cores == "shared":
        env.update(MXNET_CPU_WORKER_NTHREADS=str(threads), TF_NUM_INTEROP_THREADS="1" if threads == 1 else "2")
    else:
        env.update(MXNET_CPU_WORKER_NTHREADS="1", TF_NUM_INTEROP_THREADS=str(local_devices))
    env[cpu_scratch.VARIABLE] = str(cpu_scratch.copies(local_devices, sync_batchnorm))
    return env


def per_device_threads(threads, most_devices):
    """Each device's share of `threads` cores when the largest row has `most_devices` devices: the same
    share in every row, so that 1 device and N devices are compared at the same cores per device."""
    return threads // most_devices


def worker_cpus(rank, threads, available=None):
    """The cores worker `rank` of a per-device run is pinned to: `threads` of them, its own."""
    available = sorted(os.sched_getaffinity(0) if available is None else available)
    cpus = available[rank * threads:(rank + 1) * threads]
    if len(cpus) < threads:
        raise ValueError(f"worker {rank} needs cores {rank * threads}-{(rank + 1) * threads - 1} "
                         f"but this process may use {len(available)}")
    return cpus


def pin_from_env():
    """Pin this process to the cores its launcher chose (nothing if it chose none)."""
    cpus = os.environ.get(CPUS_VARIABLE)
    if cpus:
        os.sched_setaffinity(0, [int(c) for c in cpus.split(",")])
