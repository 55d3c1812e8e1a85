"""PyTorch devices: `cuda:i` for each GPU; on a CPU-only machine, n virtual devices that are all `cpu`
(PyTorch gives the CPU no index, so several replicas on `cpu` stand in for several devices)."""
import torch

from common.sharding import check_device_count


def gpu_count():
    return torch.cuda.device_count()


def get_devices(n=None):
    gpus = gpu_count()
    check_device_count(n, gpus)
    if gpus:
        return [torch.device(f"cuda:{i}") for i in range(n or gpus)]
    return [torch.device("cpu")] * (n or 1)


def device_info(devices):
    info = []
    for i, d in enumerate(devices):
        if d.type == "cuda":
            props = torch.cuda.get_device_properties(d)
            info.append({"name": props.name, "type": "gpu", "index": d.index, "memory_bytes": props.total_memory})
        else:
            info.append({"name": f"cpu (virtual device {i})", "type": "cpu", "index": i, "memory_bytes": None})
    return info


def sync(devices):
    """CUDA kernels run asynchronously: a timer must wait for them. CPU ops are synchronous."""
    for d in set(devices):
        if d.type == "cuda":
            torch.cuda.synchronize(d)


def peak_memory(devices):
    """Peak GPU memory PyTorch's allocator handed out, summed over the GPUs; None on the CPU (see RSS)."""
    gpus = {d for d in devices if d.type == "cuda"}
    return sum(torch.cuda.max_memory_allocated(d) for d in gpus) if gpus else None
