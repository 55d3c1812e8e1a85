"""The contract every framework folder implements, and the one way to load an implementation.

The folders `pytorch/`, `mxnet/`, `tensorflow/` and `jax/` have no `__init__.py` on purpose: a package folder
with the name of a real framework would shadow it. They are mounted here under a private name
(`rosetta_pytorch`, ...) so their files can import each other with relative imports.
"""
import functools
import importlib
import importlib.metadata
import os
import sys
import types

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FRAMEWORKS = ("pytorch", "mxnet", "tensorflow", "jax")

# The pip distribution to install for each framework (requirements.txt pins it). Any other distribution
# that provides the same import package counts as installed: torch's CUDA builds, mxnet-cu101 ...
# mxnet-cu117, tensorflow (with GPU support), tensorflow-gpu, ...
DISTRIBUTIONS = {
    "pytorch": ("torch",),
    "mxnet": ("mxnet",),
    "tensorflow": ("tensorflow-cpu",),
    "jax": ("jax",),
}
# The package each framework is imported as, where it differs from the framework's name.
IMPORT_NAMES = {"pytorch": "torch"}

# The files of a framework folder, in reading order, and what each one must define.
FILES = ("devices", "lenet", "data_parallel")

CONTRACT = {
    # devices.py: what the framework calls a device.
    "gpu_count": "gpu_count() -> the number of GPUs this process sees (0 on a CPU-only machine), without "
                 "initialising the framework's devices (common.placement decides which of them are the process's).",
    "get_devices": "get_devices(n=None) -> list of device handles: all GPUs (the first n), else n virtual "
                   "CPU devices (1 when n is None). n < 1 or more GPUs than exist raises RosettaError.",
    "device_info": "device_info(devices) -> list of dicts: name, type, index, memory_bytes (None if unknown).",
    "sync": "sync(devices) -> None: wait until all queued work on the devices is done (for timers).",
    "peak_memory": "peak_memory(devices) -> peak GPU memory in bytes, summed over the devices; None on the CPU "
                   "or where the framework does not tell.",
    # lenet.py: the model of common/lenet.py, in this framework's ops.
    "get_params": "get_params(weights, device) -> replica: the canonical numpy weights, on one device.",
    "forward": "forward(replica, X) -> logits for a batch X already on the replica's device.",
    "to_numpy": "to_numpy(replica) -> dict of float32 numpy arrays in canonical (PyTorch) layout.",
    # data_parallel.py: the multi-device recipe.
    "split_and_load": "split_and_load(array, devices) -> list of len(devices) contiguous shards along axis 0, "
                      "sizes differing by at most one (common.sharding), shard i on devices[i].",
    "allreduce": "allreduce(tensors) -> the same list, every tensor now holding the element-wise sum.",
    "train_step": "train_step(replicas, X, y, devices, lr, batch_size=None) -> float: one synchronous SGD step "
                  "on a numpy batch (summed loss per shard, gradients summed across devices, update divided by "
                  "batch_size, the global batch size: len(X) unless processes share the batch), returning the "
                  "mean loss over X.",
    "evaluate": "evaluate(replica, X, y) -> float: accuracy of one replica on numpy data.",
}


class RosettaError(Exception):
    """A problem the user can fix (bad option, missing data, framework not installed): shown as one line."""


class Unavailable(RosettaError):
    """This framework, file, mode, exec level or layout cannot run here: its row is skipped, with this reason."""


def choose(option, names, default, framework, what="mode", reasons=None):
    """The exec level or layout (`what`) a framework runs for `option` ('default' is its usual one), or
    Unavailable for one it lacks (a skipped row, not a failure), saying why where `reasons` knows."""
    option = default if option == "default" else option
    if option not in names:
        why = (reasons or {}).get(option, f"choose from {', '.join(names)}")
        raise Unavailable(f"{framework} has no {option!r} {what} here ({why})")
    return option


@functools.cache
def installed_version(name, path=None):
    """The framework's version from package metadata, without importing it (None if not installed): that
    of the installed distribution whose files include the framework's import package, whatever its pip
    name (every CUDA build of MXNet has its own). Metadata, not `find_spec`: from the repo root,
    find_spec would find our own `mxnet/` folder. `path`: where to look (default sys.path)."""
    package = IMPORT_NAMES.get(name, name)
    for dist in importlib.metadata.distributions(**({} if path is None else {"path": list(path)})):
        declared = (dist.read_text("top_level.txt") or "").split()
        if package in declared or (not declared and any(f.parts[0] == package for f in dist.files or ())):
            return dist.version
    return None


def check_name(name):
    if name not in FRAMEWORKS:
        raise RosettaError(f"unknown framework {name!r}; choose from {', '.join(FRAMEWORKS)}")


def load_framework(name):
    """The framework's implementation as one namespace holding every CONTRACT function."""
    check_name(name)
    if installed_version(name) is None:
        raise Unavailable(f"{name} is not installed (pip install {DISTRIBUTIONS[name][0]}); "
                           f"see requirements.txt for the pinned version")
    package = f"rosetta_{name}"
    if package not in sys.modules:
        module = types.ModuleType(package, f"The {name} implementation, mounted from {name}/.")
        module.__path__ = [os.path.join(ROOT, name)]
        sys.modules[package] = module
    impl = types.SimpleNamespace(name=name, version=installed_version(name))
    for file in FILES:
        if not os.path.exists(os.path.join(ROOT, name, file + ".py")):
            raise Unavailable(f"{name} is not implemented yet ({name}/{file}.py is missing)")
        try:
            module = importlib.import_module(f"{package}.{file}")
        except ImportError as err:
            raise RosettaError(f"{name} is installed but does not import: {err}") from err
        for attr in dir(module):
            if attr in CONTRACT:
                setattr(impl, attr, getattr(module, attr))
    missing = [fn for fn in CONTRACT if not hasattr(impl, fn)]
    if missing:
        raise RosettaError(f"{name} does not implement {', '.join(missing)}")
    return impl


def load_module(name, file):
    """One more file of a framework folder (beyond the contract), e.g. ('pytorch', 'builtin')."""
    load_framework(name)
    if not os.path.exists(os.path.join(ROOT, name, file + ".py")):
        raise Unavailable(f"{name} is not implemented yet ({name}/{file}.py is missing)")
    return importlib.import_module(f"rosetta_{name}.{file}")
