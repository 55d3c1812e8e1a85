"""JAX's own profiler: jax.profiler. It writes TensorBoard's XSpace (plugins/profile/<run>/*.xplane.pb: open the
folder with `tensorboard --logdir FOLDER` and its profile plugin) and, asked to, the same trace as Perfetto's
Chrome-trace JSON (perfetto_trace.json.gz: open it in https://ui.perfetto.dev). Every XLA executable a step ran
is an event, with its ops inside, on the thread of the device that ran it."""
import glob
import os

import jax

VIEWER = "a Chrome trace: ui.perfetto.dev (or the folder in TensorBoard's profile plugin)"


def start(folder):
    jax.profiler.start_trace(folder, create_perfetto_trace=True)


def stop(folder):
    """Stop recording and write the trace; return the Perfetto file's path (the newest in the folder: each start
    makes a run of its own there, beside those of an earlier command)."""
    jax.profiler.stop_trace()
    return max(glob.glob(os.path.join(folder, "plugins", "profile", "*", "perfetto_trace.json.gz")), key=os.path.getmtime)
