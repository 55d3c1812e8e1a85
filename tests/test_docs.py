"""The reader's promises: the Rosetta page's links hit their code, the framework folders line up, and the
README's commands are the ones CI runs."""
import ast
import importlib.util
import os
import re

import pytest

from common import CONTRACT, FRAMEWORKS
from common.interface import FILES
from conftest import ROOT


def load_links_tool():
    spec = importlib.util.spec_from_file_location("links", os.path.join(ROOT, "docs", "links.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_rosetta_links_point_at_their_code():
    links = load_links_tool()
    for page in links.PAGES:   # the Rosetta page, the migration page
        assert len(links.LINK.findall(open(page).read())) >= 30, page
        assert links.problems(page) == [], f"code moved under {page}'s links: run `python docs/links.py`"


def top_level_functions(path):
    return [node.name for node in ast.parse(open(path).read()).body if isinstance(node, ast.FunctionDef)]


def framework_files(name):
    return sorted(f for f in os.listdir(os.path.join(ROOT, name)) if f.endswith(".py"))


def test_the_framework_folders_hold_the_same_files():
    for name in FRAMEWORKS[1:]:
        assert framework_files(name) == framework_files("pytorch"), name
    assert {f"{f}.py" for f in FILES} <= set(framework_files("pytorch"))


@pytest.mark.parametrize("file", framework_files("pytorch"))
def test_the_same_functions_in_the_same_order(file):
    """Every function of the PyTorch file exists in the others, in the same order (a translation may
    add helpers of its own, e.g. TensorFlow's layout conversions)."""
    reference = top_level_functions(os.path.join(ROOT, "pytorch", file))
    for name in FRAMEWORKS[1:]:
        functions = top_level_functions(os.path.join(ROOT, name, file))
        assert [f for f in functions if f in reference] == reference, f"{name}/{file}"


def test_contract_functions_live_in_their_documented_files():
    defined = {f: set(top_level_functions(os.path.join(ROOT, "pytorch", f + ".py"))) for f in FILES}
    for fn in CONTRACT:
        assert any(fn in names for names in defined.values()), fn


def test_readme_commands_are_what_ci_runs():
    readme = open(os.path.join(ROOT, "README.md")).read()
    ci = open(os.path.join(ROOT, ".ci", "run")).read()
    blocks = re.findall(r"```bash\n(.*?)\n```", readme, re.S)
    install, test = blocks[0], blocks[1]
    assert "pip install -r requirements.txt" in install and "python compare.py" in install
    assert test.strip() in ci and "pip install -q -r requirements.txt" in ci


def test_requirements_point_at_a_readme_section_that_exists():
    readme = open(os.path.join(ROOT, "README.md")).read()
    sections = re.findall(r"^#+ (.+)$", readme, re.M)
    named = re.findall(r'README: "([^"]+)"', open(os.path.join(ROOT, "requirements.txt")).read())
    assert named and all(name in sections for name in named), (named, sections)
