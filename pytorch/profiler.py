"""PyTorch's own profiler: torch.profiler. The trace is a Chrome trace (JSON): open it in https://ui.perfetto.dev
or chrome://tracing. Every aten op of the profiled steps is an event on its thread, with its input shapes."""
import os

import torch
from torch.profiler import ProfilerActivity, profile

VIEWER = "a Chrome trace: ui.perfetto.dev or chrome://tracing"
_profile = None


def start(folder):
    """Record from now on: the CPU's ops, and the GPU's kernels where there is one."""
    global _profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    _profile = profile(activities=activities, record_shapes=True)
    _profile.start()


def stop(folder):
    """Stop recording; write the trace into `folder`; return its path."""
    global _profile
    _profile.stop()
    path = os.path.join(folder, "trace.json")
    _profile.export_chrome_trace(path)
    _profile = None
    return path
