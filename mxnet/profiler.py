"""MXNet's own profiler: mx.profiler. The trace is a Chrome trace (JSON): open it in https://ui.perfetto.dev or
chrome://tracing. Every operator the engine ran is an event on the worker thread that ran it, one row per
thread of each context's pool: where two devices' work does or does not overlap shows there."""
import os

import mxnet as mx

VIEWER = "a Chrome trace: ui.perfetto.dev or chrome://tracing"


def start(folder):
    """Record from now on: operators, memory and the engine's API calls. The engine is asynchronous: what was
    queued before is waited for first, so the trace holds only the profiled steps."""
    mx.nd.waitall()
    mx.profiler.set_config(profile_all=True, aggregate_stats=True, filename=os.path.join(folder, "trace.json"))
    mx.profiler.set_state("run")


def stop(folder):
    """Wait for the queued work, stop recording, write the trace; return its path."""
    mx.nd.waitall()
    mx.profiler.set_state("stop")
    mx.profiler.dump()
    return os.path.join(folder, "trace.json")
