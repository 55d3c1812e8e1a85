"""Which devices are mine: the one rule every framework's worker and the launcher follow.

A run's devices are shared out evenly: each of its processes owns `per_process` of them. CPU devices are
virtual and every process makes its own, so each owns its first `per_process`. GPUs belong to a machine:
the processes on one machine take consecutive slots in local-rank order (local rank r owns GPUs
r*k .. r*k+k-1 of those it sees), unless a launcher already hid every other GPU (CUDA_VISIBLE_DEVICES),
and then all it sees is its own. The global rank never decides: on several machines it is no slot at all.
"""
import os

from .interface import RosettaError

OURS = ("ROSETTA_LOCAL_RANK", "ROSETTA_LOCAL_WORLD_SIZE")
# The local rank and local world size as the framework's own launcher names them (torchrun); ours otherwise.
LAUNCHER_VARS = {"pytorch": ("LOCAL_RANK", "LOCAL_WORLD_SIZE")}
# Frameworks whose multi-process engine uses every GPU a worker sees, so a launcher must hide the others:
# TensorFlow's MultiWorkerMirroredStrategy replicates onto all of them (its multi-worker guide sets
# CUDA_VISIBLE_DEVICES per worker). PyTorch and MXNet address their GPU by index and need nothing.
HIDES_GPUS = {"tensorflow", "jax"}
HIDE = "CUDA_VISIBLE_DEVICES"
HOW = (f"start each worker with its own GPUs in {HIDE}, or with {OURS[0]} and {OURS[1]} "
       "(torchrun's LOCAL_RANK and LOCAL_WORLD_SIZE for PyTorch); see docs/usage.md")


def local_slot(framework, world, environ=os.environ):
    """(local rank, local world size) of this process on its machine, from its launcher's variables;
    (0, 1) for a single-process run; (None, None) when a launcher said nothing."""
    for rank_var, size_var in (LAUNCHER_VARS.get(framework, OURS), OURS):
        if rank_var in environ:
            try:
                rank = int(environ[rank_var])
                size = int(environ.get(size_var, rank + 1))
            except ValueError:
                raise RosettaError(f"{rank_var} and {size_var} must be integers, got "
                                   f"{environ[rank_var]!r} and {environ.get(size_var)!r}") from None
            if not 0 <= rank < size:
                raise RosettaError(f"{rank_var}={rank} is not a slot among {size_var}={size} local processes")
            return rank, size
    return (0, 1) if world == 1 else (None, None)


def owned(visible, per_process, local_rank, local_world, hidden=False):
    """Indices, among the `visible` GPUs this process sees, of the ones it owns; on the CPU (no GPU
    visible) its virtual devices 0 .. per_process-1. `hidden`: a launcher restricted what it sees."""
    mine = range(per_process)
    if visible == 0:
        return list(mine)
    if local_rank is None:   # the slot is unknown: only "all I see is mine" is safe
        if visible == per_process:
            return list(mine)
        raise RosettaError(f"this process sees {visible} GPU(s) and owns {per_process}, but its local rank "
                           f"is unknown: {HOW}")
    if visible >= per_process * local_world:   # every local process's GPUs are among those it sees
        return [per_process * local_rank + i for i in mine]
    if hidden and visible >= per_process:
        return list(mine)
    need = f"{local_world} processes x {per_process}" if local_world > 1 else f"{per_process}"
    raise RosettaError(f"asked for {need} GPU(s) on this machine, but this process sees only {visible}")


def my_gpus(framework, visible, per_process, world, environ=os.environ):
    """The rule, for a worker: the indices of its own GPUs among the `visible` ones ([] on the CPU)."""
    if not visible:
        return []
    return owned(visible, per_process, *local_slot(framework, world, environ), hidden=HIDE in environ)


def local_devices(fw, gpus, per_process):
    """This process's device handles: its own GPUs (`gpus`, from my_gpus), else its virtual CPU devices."""
    if not gpus:
        return fw.get_devices(per_process)
    return fw.get_devices(gpus[-1] + 1)[gpus[0]:]


def machine_gpus(environ=os.environ, driver="/proc/driver/nvidia/gpus"):
    """The GPU ids a launcher on this machine hands out: its own CUDA_VISIBLE_DEVICES list if it was
    given one (up to the first invalid entry, as CUDA reads it), else one per GPU the NVIDIA driver
    lists; [] without NVIDIA GPUs."""
    if HIDE in environ:
        ids = []
        for entry in (e.strip() for e in environ[HIDE].split(",")):
            if not entry or entry.startswith("-"):
                break
            ids.append(entry)
        return ids
    try:
        return [str(i) for i in range(len(os.listdir(driver)))]
    except OSError:
        return []


def worker_env(framework, local_rank, local_world, per_process, gpus):
    """The placement variables one worker of a launcher starts with: its local rank and local world
    size, and for a framework that uses every GPU it sees, exactly its own GPUs (`gpus`: the machine's
    ids). When the GPUs cannot be shared out, nothing is hidden: the worker's own check says why."""
    env = dict(zip(LAUNCHER_VARS.get(framework, OURS), (str(local_rank), str(local_world))))
    if framework in HIDES_GPUS and gpus:
        try:
            env[HIDE] = ",".join(gpus[i] for i in owned(len(gpus), per_process, local_rank, local_world))
        except RosettaError:
            pass
    return env
