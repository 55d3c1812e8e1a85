"""TensorFlow devices: `/device:GPU:i` for each GPU; on a CPU-only machine, n logical CPU devices
`/device:CPU:i` split from the one physical CPU (they share its cores, but each is a real placement)."""
import tensorflow as tf

from common.interface import RosettaError
from common.sharding import check_device_count

LOGICAL_CPUS = 8   # made once, on the first call: TensorFlow fixes its devices when it initialises


def split_cpu(n=LOGICAL_CPUS):
    """Split the one CPU into n logical devices. Only possible before TensorFlow initialises (its first op,
    or listing logical devices); distributed.py calls this before it starts the multi-worker runtime."""
    cpu = tf.config.list_physical_devices("CPU")[0]
    if tf.config.get_logical_device_configuration(cpu) is None:
        try:
            tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * n)
        except RuntimeError:   # TensorFlow already ran an op: its devices are fixed
            pass


def get_devices(n=None):
    gpus = tf.config.list_physical_devices("GPU")   # physical devices: listing them initialises nothing
    check_device_count(n, len(gpus))
    if gpus:
        return [f"/device:GPU:{i}" for i in range(n or len(gpus))]
    n = n or 1
    split_cpu(max(n, LOGICAL_CPUS))
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
