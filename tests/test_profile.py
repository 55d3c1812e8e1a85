"""--profile: every framework's own profiler traces exactly the window of steps harness/profile.py names, in a file a
standard viewer opens (a Chrome trace, or TensorFlow's XSpace for TensorBoard), read back here as a viewer reads it."""
import gzip
import json

import pytest

from common import FRAMEWORKS
from harness.launch import run_workers
from harness.profile import STEPS
from harness.spec import RunSpec
from conftest import framework_or_skip

pytestmark = pytest.mark.slow   # real worker processes

# The convolution of each framework's scratch forward, as its profiler names it: one per layer, device and step.
CONVOLUTION = {"pytorch": "aten::conv2d", "mxnet": "Convolution", "tensorflow": "Conv2D", "jax": "convolution"}


def event_names(framework, path):
    """The names of the trace's events, read as its viewer reads the file."""
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


@pytest.mark.timeout(300)
@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_the_profiler_traces_the_window_of_steps(framework, tmp_path):
    framework_or_skip(framework)
    spec = RunSpec(framework, mode="scratch", devices=2, dataset="digits", epochs=2, threads=1, exec="eager",
                   profile=str(tmp_path))
    (record,) = run_workers(spec, timeout=240)
    assert record["status"] == "ok", record.get("error")
    names = event_names(framework, record["profile"])
    convolutions = [n for n in names if CONVOLUTION[framework] in n]
    assert len(convolutions) >= STEPS * 2 * 2, sorted(set(names))[:80]   # 2 layers on 2 devices a step
    if framework in ("pytorch", "mxnet"):   # one event per call: exactly the window's, no step more
        assert len([n for n in names if n == CONVOLUTION[framework]]) == STEPS * 2 * 2
