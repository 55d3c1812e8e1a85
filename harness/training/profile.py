"""--profile DIR: one trace per row of a few steady-state steps, recorded by the framework's own profiler (its
folder's profiler.py: start(folder), stop(folder) -> the trace's path, VIEWER), in a format a standard viewer opens.

The window is steps FIRST .. FIRST + STEPS - 1 of the run (counted from 0), in rank 0 only: past the first step's
one-off costs (tracing, compilation, allocation), and full batches in any data set of 5 or more steps an epoch (an
epoch's last, smaller batch is a new shape, which jax.jit and tf.function compile again). The device queues are drained (runner.sync) at both ends, so
the trace holds whole steps and nothing of the others. A profiled row's timings include the profiler's overhead:
profile in a run of its own, not in the benchmark.
"""
import os

from ..loader import load_module

FIRST, STEPS = 2, 3


def trace_folder(profile_dir, spec, trial=None):
    """DIR/<the row's run_name>[-trial<k>] (training/checkpoints.py, e.g. DIR/jax-scratch-2d-1p): one folder per row,
    and per trial of a row run several times (--repeats), whose traces would otherwise overwrite each other."""
    from .checkpoints import run_name
    return os.path.join(profile_dir, run_name(spec) + ("" if trial is None else f"-trial{trial}"))


def profiler(spec, rank, record):
    """(before_step, finish) hooks that profile the window into spec.profile, or (None, None). finish() stops a
    window the run ended inside (a short run). The trace's path goes into record["profile"]."""
    if not spec.profile or rank != 0:
        return None, None
    tool, folder, state = load_module(spec.framework, "profiler"), spec.profile, {"on": False}
    os.makedirs(folder, exist_ok=True)

    def stop(runner):
        runner.sync()
        record["profile"] = tool.stop(folder)
        record["profile_viewer"] = tool.VIEWER
        state["on"] = False

    def before_step(steps, runner):
        if steps == FIRST:
            runner.sync()
            tool.start(folder)
            state["on"] = True
        elif steps == FIRST + STEPS and state["on"]:
            stop(runner)

    def finish(runner):
        if state["on"]:
            stop(runner)
    return before_step, finish
