"""TensorFlow devices: `/device:GPU:i` for each GPU; on a CPU-only machine, n logical CPU devices
`/device:CPU:i` split from the one physical CPU (they share its cores, but each is a real placement)."""
import tensorflow as tf

from common.interface import RosettaError
from common.sharding import check_device_count

LOGICAL_CPUS = 8   # made once, on the first call: TensorFlow fixes its devices when it initialises


def gpu_count():
    return len(tf.config.list_physical_devices("GPU"))   # physical devices: listing them initialises nothing


def configure(n=LOGICAL_CPUS):
    """What must happen before TensorFlow initialises its devices (its first op, or listing logical
    devices), once per process; distributed.py calls this before it starts the multi-worker runtime.
    On GPUs, memory growth: by default a process maps nearly all the memory of every GPU it sees, so
    workers sharing a GPU fail to allocate. On the CPU, the split into n logical devices."""
    gpus = tf.config.list_physical_devices("GPU")
    try:
        for gpu in gpus:
            tf.config.experimental.set_memory_growth(gpu, True)
        cpu = tf.config.list_physical_devices("CPU")[0]
        if not gpus and tf.config.get_logical_device_configuration(cpu) is None:
            tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * n)
    except RuntimeError:   # TensorFlow already ran an op: its devices are fixed
        pass


def get_devices(n=None):
    gpus = gpu_count()
    check_device_count(n, gpus)
    configure(max(n or 1, LOGICAL_CPUS))
    if gpus:
        return [f"/device:GPU:{i}" for i in range(n or gpus)]
    n = n or 1
    cpus = tf.config.list_logical_devices("CPU")
    # In a multi-worker run (distributed.py) the other workers' CPUs are listed too, after this one's.
    here = tf.DeviceSpec.from_string(cpus[0].name).task
    cpus = [d for d in cpus if tf.DeviceSpec.from_string(d.name).task == here]
    if n > len(cpus):
        raise RosettaError(f"asked for {n} devices but TensorFlow has {len(cpus)} logical CPU device(s), "
                           f"fixed when it initialised; ask for {n} before TensorFlow runs anything")
    return [d.name for d in cpus[:n]]


def device_info(devices):
    info = []
    for d in devices:
        spec = tf.DeviceSpec.from_string(d)
        if spec.device_type == "GPU":   # TensorFlow reports a GPU's name, not its total memory
            gpu = tf.config.list_physical_devices("GPU")[spec.device_index]
            name = tf.config.experimental.get_device_details(gpu).get("device_name", d)
            info.append({"name": name, "type": "gpu", "index": spec.device_index, "memory_bytes": None})
        else:
            info.append({"name": f"cpu (logical device {spec.device_index})", "type": "cpu",
                         "index": spec.device_index, "memory_bytes": None})
    return info


def sync(devices):
    """GPU kernels run asynchronously: sync_devices waits for them. Eager CPU ops are synchronous."""
    if any(tf.DeviceSpec.from_string(d).device_type == "GPU" for d in devices):
        tf.test.experimental.sync_devices()


def peak_memory(devices):
    """Peak memory of TensorFlow's GPU allocator, summed over the GPUs; None on the CPU (see RSS)."""
    gpus = [d for d in devices if tf.DeviceSpec.from_string(d).device_type == "GPU"]
    return sum(tf.config.experimental.get_memory_info(d)["peak"] for d in gpus) if gpus else None
