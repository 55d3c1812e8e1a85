"""JAX's own profiler: jax.profiler. It writes TensorBoard's XSpace (plugins/profile/<run>/*.xplane.pb: open the
folder with `tensorboard --logdir FOLDER` and its profile plugin) and, asked to, the same trace as Perfetto's
Chrome-trace JSON (perfetto_trace.json.gz: open it in https://ui.perfetto.dev). Every XLA executable a step ran
is an event, with its ops inside, on the thread of the device that ran it."""
import contextlib
import glob
import os
import sys

import jax

VIEWER = "a Chrome trace: ui.perfetto.dev (or the folder in TensorBoard's profile plugin)"


def start(folder):
    with tensorflow_kept():
        jax.profiler.start_trace(folder, create_perfetto_trace=True)


def stop(folder):
    """Stop recording and write the trace; return the Perfetto file's path (the newest in the folder: each start
    makes a run of its own there, beside those of an earlier command)."""
    with tensorflow_kept():
        jax.profiler.stop_trace()
    traces = glob.glob(os.path.join(folder, "plugins", "profile", "*", "perfetto_trace.json.gz"))
    return max(traces, key=os.path.getmtime)


@contextlib.contextmanager
def tensorflow_kept():
    """In a process that holds TensorFlow too (a notebook, the test suite), JAX's profiler session sets TensorFlow's
    `trace.enabled` to a bool as it starts and stops, where TensorFlow 2.21 keeps a function: every tf.Variable made
    afterwards fails with "'bool' object is not callable". Put back what was there."""
    trace = sys.modules.get("tensorflow.python.profiler.trace")
    kept = getattr(trace, "enabled", None)
    try:
        yield
    finally:
        if trace is not None:
            trace.enabled = kept
