"""--profile DIR: one trace per row of a few steady-state steps, recorded by the framework's own profiler (its
folder's profiler.py: start(folder), stop(folder) -> the trace's path, VIEWER), in a format a standard viewer opens.

The window is steps FIRST .. FIRST + STEPS - 1 of the run counted from 0 (WINDOW: the 3rd to 5th), in rank 0 only:
past the first step's one-off costs (tracing, compilation, allocation), and full batches in any data set of 5 or more
steps an epoch (an epoch's last, smaller batch is a new shape, which jax.jit and tf.function compile again). A row of
fewer steps is traced in part or not at all, and compare.py says so before the first row (short_rows). The device
queues are drained (runner.sync) at both ends, so the trace holds whole steps and nothing of the others. A profiled
row's timings include the profiler's overhead: profile in a run of its own, not in the benchmark.
"""
import os

from ..loader import load_module

FIRST, STEPS = 2, 3
WINDOW = f"steps {FIRST + 1}-{FIRST + STEPS}"   # as a person counts them, from 1


def run_steps(spec, n_train):
    """The steps a row of `spec` takes on n_train training images (training/loop.py: its epochs, or max_steps). A
    row resumed from a checkpoint (--resume-from) takes fewer: its epochs before the checkpoint are not run again."""
    from .loop import steps_per_epoch
    steps = spec.epochs * steps_per_epoch(n_train, spec.batch_size, spec.devices)
    return steps if spec.max_steps is None else min(steps, spec.max_steps)


def short_rows(rows, n_train):
    """One line naming the rows, (label, spec), too short for the window, or None: a row of FIRST steps or fewer is
    not traced at all, and one that ends inside the window has a trace of fewer steps (profiler's finish)."""
    short = [(label, steps) for label, spec in rows
             for steps in [run_steps(spec, n_train)] if steps < FIRST + STEPS]
    if not short:
        return None
    traced = lambda steps: ("no trace" if steps <= FIRST else f"step {steps} only" if steps == FIRST + 1   # noqa: E731
                            else f"steps {FIRST + 1}-{steps} only")
    said = "; ".join(f"{label}: {steps} step(s), {traced(steps)}" for label, steps in short)
    return f"note: --profile traces {WINDOW} of each row, counted from 1; too few steps in {said}"


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
