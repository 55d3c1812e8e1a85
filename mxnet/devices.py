"""MXNet devices: `mx.gpu(i)` for each GPU; on a CPU-only machine, n distinct contexts `mx.cpu(i)`
(MXNet gives the CPU an index, so several replicas get several real contexts)."""
import numpy as np

# MXNet 1.9.1 (the last release) uses the alias np.bool, removed in numpy 1.24: restore it before the
# first import. Every other file of this folder imports this one first (common.interface.FILES order).
if "bool" not in np.__dict__:
    np.bool = bool

import mxnet as mx  # noqa: E402

from common.interface import Unavailable  # noqa: E402
from common.sharding import check_device_count  # noqa: E402


def gpu_count():
    return mx.context.num_gpus()


def get_devices(n=None):
    gpus = gpu_count()
    check_device_count(n, gpus)
    if gpus:
        return [mx.gpu(i) for i in range(n or gpus)]
    return [mx.cpu(i) for i in range(n or 1)]


def check_precision(precision, devices=None):
    """MXNet 1.9.1's fp16 convolution and dense layer are cuDNN's: on CPU contexts its kernels refuse ("FP16 gemm on
    cpu not implemented!", "float16 fully connected layer is currently only supported by CuDNN"), so --precision fp16
    is refused in one line before any runs. `devices`: the run's contexts (None: those get_devices gives, GPUs where
    there are any)."""
    on_cpu = gpu_count() == 0 if devices is None else devices[0].device_type == "cpu"
    if precision == "fp16" and on_cpu:
        raise Unavailable("MXNet 1.9.1 computes fp16 convolutions and dense layers only with cuDNN: --precision "
                          "fp16 needs a GPU (its CPU kernels refuse fp16)")


def device_info(devices):
    info = []
    for i, d in enumerate(devices):
        if d.device_type == "gpu":
            _, total = mx.context.gpu_memory_info(d.device_id)
            info.append({"name": f"gpu({d.device_id})", "type": "gpu", "index": d.device_id,
                         "memory_bytes": total})
        else:
            info.append({"name": f"cpu({d.device_id}) (virtual device {i})", "type": "cpu", "index": i,
                         "memory_bytes": None})
    return info


def sync(devices):
    """MXNet's engine runs every op asynchronously, CPU ones too: a timer must wait for all of them."""
    mx.nd.waitall()


def peak_memory(devices):
    """MXNet reports a GPU's free and total memory, not a peak: None (the process RSS is reported)."""
    return None
