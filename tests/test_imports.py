"""The name trap: our `mxnet/`, `tensorflow/` and `jax/` folders must never hide the real packages."""
import importlib.util
import os
import subprocess
import sys

import pytest

from common import FRAMEWORKS
from conftest import ROOT, framework_or_skip

REAL = {"mxnet": "mxnet", "tensorflow": "tensorflow", "pytorch": "torch", "jax": "jax"}


def test_framework_folders_are_not_packages():
    for name in FRAMEWORKS:
        assert not os.path.exists(os.path.join(ROOT, name, "__init__.py")), \
            f"{name}/__init__.py would shadow the real {name} package"


SHADOWABLE = [name for name in FRAMEWORKS if REAL[name] == name]   # a folder with the package's own name


@pytest.mark.parametrize("cwd", [ROOT, os.path.join(ROOT, "tests")] + [os.path.join(ROOT, n) for n in SHADOWABLE])
@pytest.mark.parametrize("package", SHADOWABLE)
def test_real_package_is_found_from_anywhere_in_the_repo(package, cwd):
    code = f"import importlib.util as u; s = u.find_spec({package!r}); print(s.origin if s else 'MISSING')"
    origin = subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True,
                            check=True).stdout.strip()
    if origin == "MISSING":
        pytest.skip(f"{package} is not installed")
    assert origin != "None" and not origin.startswith(ROOT + os.sep + package), origin
    assert origin.endswith(os.path.join(package, "__init__.py"))


@pytest.mark.parametrize("name", FRAMEWORKS)
def test_real_package_is_imported_under_pytest(name):
    framework_or_skip(name)   # imports the real package through the implementation
    module = sys.modules[REAL[name]]
    assert module.__file__ is not None, f"{REAL[name]} resolved to a namespace package (a repo folder)"
    assert not module.__file__.startswith(os.path.join(ROOT, name) + os.sep)
    assert importlib.util.find_spec(REAL[name]).origin == module.__file__
