"""--profile: every framework's own profiler traces the window of steps harness/training/profile.py names, in a file a standard
viewer opens (a Chrome trace, or TensorFlow's XSpace for TensorBoard), read back here as a viewer reads it. The
traces are those of the session's profiled engine run (conftest.one_host_rows), whose weights the unprofiled
two-host and restart runs match bit for bit."""
import gzip
import json
import os
import time

import pytest

from common import FRAMEWORKS
from harness.processes.launch import run_workers
from harness.training.profile import STEPS
from harness.spec import RunSpec
from conftest import framework_or_skip

pytestmark = pytest.mark.slow   # real worker processes

# What every step of the built-in engine leaves in its framework's trace: the forward's convolution as the profiler
# names it (alone, or in the name of a fused op), and for JAX the compiled step itself (XLA on the CPU reports an
# executable as one event, not its ops: PjitFunction(jit_step), or jit_optax_step with a stateful optimizer).
STEP_EVENT = {"pytorch": "aten::conv2d", "mxnet": "Convolution", "tensorflow": "Conv2D", "jax": "_step)"}


def event_names(framework, path):
    """The names of the trace's spans, read as its viewer reads the file."""
    if framework == "tensorflow":   # TensorBoard's XSpace protobuf
        from tensorflow.tsl.profiler.protobuf import xplane_pb2
        space = xplane_pb2.XSpace()
        with open(path, "rb") as f:
            space.ParseFromString(f.read())
        names = []
        for plane in space.planes:
            metadata = {k: v.name for k, v in plane.event_metadata.items()}
            names += [metadata[e.metadata_id] for line in plane.lines for e in line.events]
        return names
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:   # a Chrome trace: a span is one "X" event, or a "B" and its "E"
        return [e.get("name", "") for e in json.load(f)["traceEvents"] if e.get("ph") in ("X", "B")]


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_every_engines_trace_opens_and_holds_its_steps(framework, one_host_rows):
    """The built-in engine's rank 0 (one device of two processes): every step of the window ran a convolution."""
    framework_or_skip(framework)
    names = event_names(framework, one_host_rows[framework]["profile"])
    assert len([n for n in names if STEP_EVENT[framework] in n]) >= STEPS, sorted(set(names))[:80]


@pytest.mark.timeout(300)
def test_the_window_is_exactly_its_steps(tmp_path):
    """PyTorch's profiler records one event per call: 3 steps x 2 layers x 2 devices convolutions, no step more."""
    framework_or_skip("pytorch")
    spec = RunSpec("pytorch", mode="scratch", devices=2, dataset="digits", epochs=1, threads=1, profile=str(tmp_path))
    (record,) = run_workers(spec, timeout=240)
    assert record["status"] == "ok", record.get("error")
    names = event_names("pytorch", record["profile"])
    assert len([n for n in names if n == STEP_EVENT["pytorch"]]) == STEPS * 2 * 2


@pytest.mark.parametrize("framework", ["tensorflow", "jax"])   # their profilers write a run of their own per start
def test_a_second_trace_in_a_folder_is_the_one_returned(framework, tmp_path):
    """A folder that holds a trace already (an earlier command's, into the same --profile DIR): the profiler's stop
    returns the trace it has just written, and the earlier one stays. In this process: no worker, and TensorFlow
    loaded beside JAX (the suite's test processes hold every framework)."""
    from harness.loader import load_module
    fw, tool = framework_or_skip(framework), load_module(framework, "profiler")
    paths = []
    for _ in range(2):
        tool.start(str(tmp_path))
        fw.get_devices(1)   # some work of the framework's
        paths.append(tool.stop(str(tmp_path)))
        time.sleep(1.1)   # a run's folder is named by the second it started in
    assert paths[0] != paths[1] and all(os.path.exists(p) for p in paths)
    assert os.path.getmtime(paths[1]) >= os.path.getmtime(paths[0])
    framework_or_skip("tensorflow")
    import tensorflow as tf   # in this process too, still whole: JAX's profiler leaves it so (jax/profiler.py)
    assert float(tf.Variable(1.0)) == 1.0
