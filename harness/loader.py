"""Loading a framework folder: the one way the machinery reaches an implementation.

The folders `pytorch/`, `mxnet/`, `tensorflow/` and `jax/` have no `__init__.py` on purpose: a package folder
with the name of a real framework would shadow it. They are mounted here under a private name
(`rosetta_pytorch`, ...) so their files can import each other with relative imports.

A framework that is not installed is `Unavailable` (its rows are skipped, its tests skip); an installed one
whose folder misses a file, fails to import or lacks a contract function is a broken translation: a plain
`RosettaError` (its rows fail, its tests fail).
"""
import functools
import importlib
import importlib.metadata
import os
import sys
import types

from common.interface import CONTRACT, FILES, FRAMEWORKS, RosettaError, Unavailable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

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
        module = import_file(name, file)
        for attr in dir(module):
            if attr in CONTRACT:
                setattr(impl, attr, getattr(module, attr))
    missing = [fn for fn in CONTRACT if not hasattr(impl, fn)]
    if missing:
        raise RosettaError(f"{name} does not implement {', '.join(missing)}")
    return impl


def import_file(name, file):
    """One file of a mounted framework folder; a missing or broken file is a broken translation."""
    if not os.path.exists(os.path.join(ROOT, name, file + ".py")):
        raise RosettaError(f"{name}/{file}.py is missing: every framework folder holds the same files")
    try:
        return importlib.import_module(f"rosetta_{name}.{file}")
    except ImportError as err:
        raise RosettaError(f"{name} is installed but {name}/{file}.py does not import: {err}") from err


def load_module(name, file):
    """One more file of a framework folder (beyond the contract), e.g. ('pytorch', 'builtin')."""
    load_framework(name)
    return import_file(name, file)
