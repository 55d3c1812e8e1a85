"""TensorFlow's own profiler: tf.profiler. The trace is TensorFlow's XSpace (plugins/profile/<run>/*.xplane.pb in
the folder): open the folder in TensorBoard with its profile plugin (`pip install tensorboard-plugin-profile`,
then `tensorboard --logdir FOLDER`, Profile tab, trace viewer). Every op the step's graph ran is an event on the
thread that ran it."""
import glob
import os

import tensorflow as tf

VIEWER = "TensorBoard's profile plugin: tensorboard --logdir FOLDER"


def start(folder):
    tf.profiler.experimental.start(folder)


def stop(folder):
    """Stop recording and write the trace; return its path (the newest in the folder: each start makes a run of its
    own there, beside those of an earlier command)."""
    tf.profiler.experimental.stop()
    traces = glob.glob(os.path.join(folder, "plugins", "profile", "*", "*.xplane.pb"))
    return max(traces, key=os.path.getmtime)
