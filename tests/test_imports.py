"""The name trap: our `mxnet/`, `tensorflow/` and `jax/` folders must never hide the real packages."""
import ast
import importlib.util
import os
import subprocess
import sys

import pytest

from common import FRAMEWORKS
from conftest import ROOT, framework_or_skip, skip_not_installed

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
        skip_not_installed(f"{package} is not installed")
    assert origin != "None" and not origin.startswith(ROOT + os.sep + package), origin
    assert origin.endswith(os.path.join(package, "__init__.py"))


@pytest.mark.parametrize("name", FRAMEWORKS)
def test_real_package_is_imported_under_pytest(name):
    framework_or_skip(name)   # imports the real package through the implementation
    module = sys.modules[REAL[name]]
    assert module.__file__ is not None, f"{REAL[name]} resolved to a namespace package (a repo folder)"
    assert not module.__file__.startswith(os.path.join(ROOT, name) + os.sep)
    assert importlib.util.find_spec(REAL[name]).origin == module.__file__


def fake_install(folder, dist, version, top_level=None, files=()):
    """A distribution's metadata as pip leaves it in site-packages, without the package itself."""
    info = folder / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    if top_level is not None:
        (info / "top_level.txt").write_text(top_level + "\n")
    (info / "RECORD").write_text("".join(f"{f},,\n" for f in files))


@pytest.mark.parametrize("dist", ["mxnet-cu101", "mxnet-cu110", "mxnet-cu111", "mxnet-cu113", "mxnet-cu116"])
def test_every_cuda_build_of_mxnet_counts_as_mxnet(dist, tmp_path):
    """MXNet 1.9.1 has a pip name per CUDA version (mxnet-cu101 ... mxnet-cu117): any of them is mxnet."""
    from harness.loader import installed_version
    fake_install(tmp_path, dist, "1.9.1", top_level="dmlc_tracker\nmxnet")
    assert installed_version("mxnet", path=(str(tmp_path),)) == "1.9.1"
    assert installed_version("tensorflow", path=(str(tmp_path),)) is None


def test_a_framework_is_known_by_its_import_package(tmp_path):
    from harness.loader import installed_version
    fake_install(tmp_path, "tensorflow", "2.21.0", files=["tensorflow/__init__.py"])   # no top_level.txt
    fake_install(tmp_path, "torch", "2.13.0+cu126", top_level="functorch\ntorch\ntorchgen")
    fake_install(tmp_path, "mxnet-tools", "0.1", top_level="mxnet_tools")   # not mxnet
    path = (str(tmp_path),)
    assert (installed_version("tensorflow", path=path), installed_version("pytorch", path=path),
            installed_version("mxnet", path=path)) == ("2.21.0", "2.13.0+cu126", None)


def repo_imports(path):
    """The repo's own top-level modules that a file imports by absolute name (relative imports stay inside its
    folder): what a floor stands on."""
    ours = {d for d in os.listdir(ROOT) if os.path.isfile(os.path.join(ROOT, d, "__init__.py"))}
    ours |= (set(FRAMEWORKS) - set(SHADOWABLE)) | {"compare", "conftest"}   # `import jax` is the real JAX
    found = set()
    for node in ast.walk(ast.parse(open(path).read(), path)):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level:
            found.add(node.module.split(".")[0])
    return found & ours


def python_files(folder):
    """Every .py file in `folder`, its subpackages' too (harness/run/, ...)."""
    return sorted(os.path.join(top, f) for top, _, files in os.walk(os.path.join(ROOT, folder)) for f in files
                  if f.endswith(".py"))


@pytest.mark.parametrize("folder", ["common", *FRAMEWORKS, "harness"])
def test_the_three_floors(folder):
    """common/ (the spec) <- the framework folders <- harness/ and compare.py: no import runs back up. The
    framework folders reach harness/ never, and each other only through harness.loader (which mounts them)."""
    below = {"common": set(), "harness": {"common", "harness"}}.get(folder, {"common"})
    for path in python_files(folder):
        assert repo_imports(path) <= below, f"{os.path.relpath(path, ROOT)} imports {repo_imports(path) - below}"


def test_compare_py_stands_on_top():
    assert repo_imports(os.path.join(ROOT, "compare.py")) <= {"common", "harness"}
    assert all("compare" not in repo_imports(p) for p in python_files("harness"))


# harness/'s packages, each above those it may import; the modules of harness/ itself lie beneath them all
HARNESS_BENEATH = {"run": {"studies", "training", "processes", "publishing"},
                   "studies": {"training", "processes", "publishing"},
                   "training": set(), "processes": set(), "publishing": set()}


def harness_imports(path):
    """The harness packages (or "" for a module of harness/ itself) that a file of harness/ imports, relatively or
    by absolute name."""
    package = os.path.relpath(os.path.dirname(path), ROOT).split(os.sep)   # ["harness", "run"]
    found = set()
    for node in ast.walk(ast.parse(open(path).read(), path)):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package[:len(package) - node.level + 1]
            names = [f"{node.module}.x"] if node.module else [a.name for a in node.names]
            targets = [base + name.split(".") for name in names]
        elif isinstance(node, ast.ImportFrom) and node.module.startswith("harness"):
            targets = [node.module.split(".") + [a.name] for a in node.names]
        else:
            continue
        for target in targets:   # harness.run.plan.x: "run"; harness.loader.x: ""
            inside = target[1] if len(target) > 2 and target[1] in HARNESS_BENEATH else ""
            found.add(inside)
    return found


@pytest.mark.parametrize("package", [*HARNESS_BENEATH, ""])
def test_harness_packages_import_only_those_beneath(package):
    """run/ <- studies/ <- training/, processes/, publishing/ (none of each other) <- harness/'s own modules
    (loader, spec, cli, files), which import no package: what harness/__init__.py says."""
    allowed = HARNESS_BENEATH.get(package, set()) | {"", package}
    files = python_files(os.path.join("harness", package)) if package else \
        [p for p in python_files("harness") if os.path.dirname(p) == os.path.join(ROOT, "harness")]
    assert files
    for path in files:
        assert harness_imports(path) <= allowed, \
            f"{os.path.relpath(path, ROOT)} imports harness's {harness_imports(path) - allowed}"
