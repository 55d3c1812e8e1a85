"""Where a step of several devices goes: compute, the all-reduce, the input, and the rest (waiting).

A row of several devices (in one process or several) is timed whole (its global batch over its images per second); its step is split into
- compute: the step's images at its 1-device row's rate (the scaling base), what the step would take if the
  processes only shared the arithmetic; its share of the step is the row's scaling efficiency;
- all-reduce: the engine's collectives on one step's gradients and nothing else, measured in fresh processes placed
  as the row's were (the same cores, the same transport), in step with each other (each collective waits for the
  last one of both), so no process waits for the other's compute: what the transport costs;
- input: the loop's wait for its next batch, measured in the row;
- the rest: the step less those three: a process waiting for the other (their steps do not end together), the
  processes slowing each other's compute (memory bandwidth, caches), the smaller per-process batch's lower rate.
  Negative where an engine overlaps its all-reduce with the backward pass (DDP's buckets go as they fill).
  A row of several processes measures two parts of it, from its processes run again alongside each other with
  nothing to share (each its own one-process run, pinned as the row's, with its share of the batch):
  - sharing the machine: their mean step less the compute (the halved batch's rate, caches, memory bandwidth);
  - waiting for the slower step: each step at the pace of the slower of them, less their mean step: what lockstep
    costs processes whose steps vary from step to step (the OS, other tenants of the host), and what no all-reduce,
    however fast, removes;
  and what is left is the engine's own (its threads, its collectives' scheduling).
The collectives are the row's: the scratch step's `--allreduce`, a built-in engine's as its builtin.py declares
(ALLREDUCE: which of the two patterns the engine's own reduction makes), or its `--allreduce` where the user writes
it (common/buckets.py's BUCKETING_ENGINES)."""
import numpy as np

from common.buckets import bucket_bytes

REPEATS, WARMUP = 20, 3


def gradient_allreduce(fw, spec, devices):
    """The row's all-reduce of one step's gradients, as a call (a buffer of ones per parameter on each of this
    process's devices): the step's own function, data_parallel.allreduce_gradients, at the row's pattern."""
    from ..loader import load_module
    from .projection import gradient_sizes
    chosen = spec.mode == "scratch" or spec.allreduce != "per-tensor"   # the engine's own unless bucketed by hand
    pattern = spec.allreduce if chosen else load_module(fw.name, "builtin").ALLREDUCE
    data_parallel, execution = load_module(fw.name, "data_parallel"), load_module(fw.name, "execution")
    per_parameter = [fw.split_and_load(np.ones((len(devices), n), np.float32), devices)
                     for n in gradient_sizes(spec.model, spec.width)]
    grads = [list(device_grads) for device_grads in zip(*per_parameter)]

    def allreduce():
        return data_parallel.allreduce_gradients(grads, bucket_bytes(pattern))
    # TensorFlow's step is one tf.function with the all-reduce inside it (its unit step_on_shards); the others
    # call their collectives op by op, as here.
    traced = execution.COMPILERS[execution.DEFAULT].get("step_on_shards")
    return (traced(allreduce) if traced else allreduce), pattern


def measure(fw, spec, rank, world, devices):
    """Worker task 'collectives': the median seconds of the row's all-reduce of one step's gradients, after a
    check that it sums (every device's ones, over every process: the run's device count)."""
    from .projection import timed, to_host
    allreduce, pattern = gradient_allreduce(fw, spec, devices)
    total = to_host(allreduce()[0][0])   # in place or a new list: the first device's first
    if not np.all(total == spec.devices):
        raise RuntimeError(f"the all-reduce summed to {float(total.flat[0])}, not {spec.devices}")
    return {**timed(allreduce, lambda: fw.sync(devices), REPEATS, WARMUP), "allreduce": pattern, "rank": rank}


def relaunched(spec, what, timeout, cluster, copies=1):
    """The records of a row's processes started again for a measurement of their own (no profile, no checkpoints),
    or None with a line on stderr naming `what` if any failed: the row keeps its timing."""
    import sys
    from ..processes.launch import run_workers
    records = run_workers(spec.replace(profile=None, checkpoint_dir=None, resume_from=None), timeout,
                          cluster=cluster, copies=copies)
    bad = [r for r in records if r["status"] != "ok"] or ([] if records else [{"status": "failed", "error": "no record"}])
    if bad:
        print(f"  {what} {bad[0]['status']}: {bad[0].get('error')}", file=sys.stderr)
        return None
    return records


def allreduce_alone(spec, timeout, cluster):
    """Launch the row's processes again for its collectives alone (task 'collectives'): {"allreduce_alone_seconds",
    "allreduce_alone_pattern"}, or {} with a line on stderr if they failed (the row keeps its timing)."""
    mine = relaunched(spec.replace(task="collectives"), "the all-reduce alone", timeout, cluster)
    if not mine:
        return {}
    seconds = max(r["collectives"]["median"] for r in mine)   # the slower process's: both wait for it
    return {"allreduce_alone_seconds": seconds, "allreduce_alone_pattern": mine[0]["collectives"]["allreduce"]}


def lockstep(step_seconds):
    """(the mean step of processes that run side by side on their own, the mean step if they had to wait for each
    other at the end of every step: its slowest process's), from each process's step times, the first (tracing)
    left out unless it is the only one."""
    steps = min(len(t) for t in step_seconds)
    skip = 1 if steps > 1 else 0
    times = np.array([t[skip:steps] for t in step_seconds])
    return float(times.mean()), float(times.max(axis=0).mean())


def alongside(spec, timeout, cluster, n_train):
    """The row's processes with nothing to share (one host): each its own one-process run of the row's engine on its
    devices, its share of the batch and the row's number of steps (of `n_train` images an epoch), all at once, pinned
    as the row's are. {"alongside_seconds", "lockstep_seconds"} (lockstep above), or {} with a line on stderr if
    they failed or the row spans hosts."""
    from ..training.loop import steps_per_epoch
    if cluster.nnodes != 1:
        return {}
    steps = spec.max_steps or spec.epochs * steps_per_epoch(n_train, spec.batch_size, spec.devices)
    solo = spec.replace(processes=1, devices=spec.per_process, batch_size=spec.batch_size // spec.processes,
                        max_steps=steps)
    records = relaunched(solo, "its processes alongside", timeout, cluster, copies=spec.processes)
    if not records:
        return {}
    mean, slowest = lockstep([r["step_seconds"] for r in records])
    return {"alongside_seconds": mean, "lockstep_seconds": slowest}


def add_split(rows):
    """Each step of several devices in parts (seconds): the row needs its scaling base and its all-reduce alone."""
    for r in rows:
        alone = r.get("allreduce_alone_seconds")
        ok = r["status"] == "ok" and r.get("scaling_efficiency") and alone is not None and r.get("images_per_second")
        if not ok:
            continue
        step = r["batch_size"] / r["images_per_second"]
        epoch, wait = r.get("epoch_seconds_median"), r.get("input_seconds_median") or 0.0
        parts = {"compute": step * r["scaling_efficiency"], "allreduce": alone,
                 "input": step * wait / epoch if epoch else 0.0}
        if r.get("alongside_seconds") is not None:   # the rest in parts: sharing the machine, waiting for the slower
            parts["sharing"] = r["alongside_seconds"] - parts["compute"]
            parts["lockstep"] = r["lockstep_seconds"] - r["alongside_seconds"]
        r["step_split"] = {"step": step, **parts, "rest": step - sum(parts.values())}
