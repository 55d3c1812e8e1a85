"""The reader's promises: the Rosetta page's links hit their code, the framework folders line up, and the
README's commands are the ones CI runs."""
import ast
import glob
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
    """Every link of the README and of every docs/*.md page points where it says (python docs/links.py)."""
    links = load_links_tool()
    pages = links.pages()
    assert set(pages) == {os.path.join(ROOT, "README.md"), os.path.join(ROOT, "docs", "rosetta.toml")} \
        | set(glob.glob(os.path.join(ROOT, "docs", "*.md")))
    for page in pages:
        assert links.problems(page) == [], \
            f"code moved under {page}'s links: run `python docs/links.py --fix`, then `python -m harness.publishing.site`"
    for name in ("rosetta.md", "rosetta.toml", "migration.md"):
        found = links.find_links(open(os.path.join(ROOT, "docs", name)).read())
        assert sum(link.code is not None and ".py#L" in link.target for link in found) >= 30, name


SAMPLE = '''"""A module whose docstring names shard_map and frobnicate."""
import os
from os.path import (join,
                     shard_map, frobnicate)

# shard_map and frobnicate, in a comment


def frobnicate(x):
    """frobnicate, in its docstring."""
    return join(os.sep, x)


value = frobnicate("a")   # frobnicate again, and here shard_map only in a comment
'''
DOCSTRING, IMPORT, CONTINUATION, COMMENT, DEF, INNER_DOCSTRING, USE = 1, 3, 4, 6, 9, 10, 14


def sample(tmp_path, page_text, name="page.md"):
    (tmp_path / "pkg").mkdir(exist_ok=True)
    (tmp_path / "pkg" / "mod.py").write_text(SAMPLE)
    page = tmp_path / "docs" / name
    page.parent.mkdir(exist_ok=True)
    page.write_text(page_text)
    return str(page)


def test_a_link_to_a_docstring_comment_or_import_line_is_flagged(tmp_path):
    """shard_map is in the sample only in a docstring, an import continuation line and comments: a link to
    any of those lines is broken, and the message names the page, the text and the file."""
    links = load_links_tool()
    lines = (DOCSTRING, IMPORT, CONTINUATION, COMMENT, USE)
    page = sample(tmp_path, "".join(f"[`shard_map`](../pkg/mod.py#L{n})\n" for n in lines))
    found = links.problems(page)
    assert len(found) == len(lines), found
    for n, problem in zip(lines, found):
        assert problem.startswith(f"{os.path.relpath(page, ROOT)}: ../pkg/mod.py#L{n} does not hold `shard_map`")
        assert "no line of code in" in problem and "pkg/mod.py" in problem
    assert links.fix(page) == [] and links.main([], pages=[page]) == 1


def test_a_name_is_linked_at_its_def_line_and_nowhere_else(tmp_path):
    links = load_links_tool()
    wrong = (DOCSTRING, CONTINUATION, COMMENT, INNER_DOCSTRING, USE, 7, 99)   # 7 is blank, 99 past the end
    page = sample(tmp_path, "".join(f"[`frobnicate`](../pkg/mod.py#L{n})\n" for n in wrong + (DEF,)))
    found = links.problems(page)
    assert [p.split(" does not hold")[0].rsplit("#L")[1] for p in found] == [str(n) for n in wrong], found
    assert all(f"the def/class of `frobnicate` is line {DEF}" in p for p in found)
    assert "docstring line" in found[0] and "import line" in found[1] and "comment line" in found[2]


def test_fix_moves_a_link_from_a_docstring_to_the_def_line_and_checking_never_writes(tmp_path):
    links = load_links_tool()
    text = "See [`frobnicate`](../pkg/mod.py#L{}) and [`join(os.sep, x)`](../pkg/mod.py#L{}).\n"
    page = sample(tmp_path, text.format(DOCSTRING, DEF))
    for argv in ([], ["--check"]):
        assert links.main(argv, pages=[page]) == 1 and open(page).read() == text.format(DOCSTRING, DEF)
    assert links.main(["--fix"], pages=[page]) == 0
    assert open(page).read() == text.format(DEF, DEF + 2)   # the def line; the body's first line
    assert links.problems(page) == [] and links.main([], pages=[page]) == 0


def test_md_anchors_must_match_a_heading(tmp_path):
    links = load_links_tool()
    sample(tmp_path, "# Other\n\n## GPUs and processes\n\n## The `--cores` flag, again!\n\n## Notes\n\n## Notes\n"
                     "\n```bash\n# Not a heading\n```\n", name="other.md")
    good = ["other.md#gpus-and-processes", "other.md#the---cores-flag-again", "other.md#notes",
            "other.md#notes-1", "#a-section", "other.md"]
    bad = ["other.md#gpus-processes", "other.md#notes-2", "other.md#not-a-heading", "#missing"]
    page = sample(tmp_path, "## A section\n\n" + "".join(f"[here]({t})\n" for t in good + bad))
    found = links.problems(page)
    assert len(found) == len(bad) and all(f": {t} does not hold a heading" in p for t, p in zip(bad, found)), found


def test_a_missing_file_is_flagged_and_links_in_code_are_not_links(tmp_path):
    links = load_links_tool()
    page = sample(tmp_path, "[`frobnicate`](../pkg/gone.py#L9) [text](../pkg/gone.md) [t](../pkg/mod.py)\n"
                            "[line 3](../pkg/mod.py#L3) [line 99](../pkg/mod.py#L99) [web](https://example.org/x)\n"
                            "`[inline](nowhere.md)`\n\n```\n[fenced](nowhere.md)\n```\n")
    found = [p.split(": ", 1)[1] for p in links.problems(page)]
    assert len(found) == 3, found
    assert found[0].startswith("../pkg/gone.py#L9 does not hold anything: there is no ") and found[0].endswith("pkg/gone.py")
    assert found[1].startswith("../pkg/gone.md does not hold anything: there is no ") and found[1].endswith("pkg/gone.md")
    assert found[2].startswith("../pkg/mod.py#L99 does not hold line 99: ") and found[2].endswith("mod.py has 14 lines")


def top_level_functions(path):
    return [node.name for node in ast.parse(open(path).read()).body if isinstance(node, ast.FunctionDef)]


def framework_files(name):
    return sorted(f for f in os.listdir(os.path.join(ROOT, name)) if f.endswith(".py"))


def test_the_framework_folders_hold_the_same_files():
    for name in FRAMEWORKS[1:]:
        assert framework_files(name) == framework_files("pytorch"), name
    assert {f"{f}.py" for f in FILES} <= set(framework_files("pytorch"))


# PyTorch's own, with no counterpart in the others: nn.DataParallel's step with its four primitives (GPU only)
# PyTorch's own: nn.DataParallel's primitives; and helpers of its translation that the others fold into their
# Functional or need not (the strides a buffer keeps, Inductor's options per network, the parameters' names by count;
# torch.autocast's one context around a forward, where the others cast at each layer: low, compute)
# (bf16_hook, bf16_on_gloo: DDP's communication hook for --allreduce-dtype bf16; the others cast in their own step;
# grad_scaler: the GradScaler both engines hold, where Keras wraps the optimizer and MXNet sets the Trainer's scaler;
# a PyTorch program's own checkpoint, one torch.save of the model's, torch.optim's and GradScaler's state_dicts, which
# the converter reads: its parts, and the state, optimizer and scaler inside it; torch.save(model) told apart, and a
# fine-tuning state's parameters and its frozen ones' buffers, the names torch.optim keeps for its buffers)
# (FSDP2 and ZeroRedundancyOptimizer, the engines for --shard: fully_sharded and its blocks, their modules' and
# optimizers' unwrapping (module_of, optimizer_of, local), the bytes a device holds (state_bytes, parameter_bytes: JAX's
# engine shards too, TensorFlow's and MXNet's do not), EXEC and LAYOUT by the engine a model runs)
PYTORCH_ONLY = {"builtin.py": {"primitives_step", "bf16_hook", "bf16_on_gloo", "fully_sharded", "blocks", "module_of",
                               "optimizer_of", "save_sharded", "local", "state_bytes", "parameter_bytes", "EXEC",
                               "LAYOUT"},
                "checkpoint.py": {"width_of_state", "model_state", "parts", "general_parts", "holds_state", "steps_of",
                                  "read_optimizer", "read_scaler", "is_distributed", "loaded",
                                  "save_sharded", "entries", "entry", "numbered", "keeps_rate", "canonical_names",
                                  "pickled_module", "given_names", "embeddings", "with_frozen"},
                "execution.py": {"compiled_forward"}, "idiomatic.py": {"param_names", "grad_scaler"},
                "optimizer.py": {"buffer_like"},
                "lenet.py": {"accuracy", "loss_and_grads", "widened", "autocast"}, "resnet.py": {"to_layout", "accuracy", "loss_and_grads",
                                                                         "batch_statistics"}}


@pytest.mark.parametrize("file", framework_files("pytorch"))
def test_the_same_functions_in_the_same_order(file):
    """Every function of the PyTorch file exists in the others, in the same order (a translation may
    add helpers of its own, e.g. TensorFlow's layout conversions; PyTorch only those of PYTORCH_ONLY)."""
    reference = [f for f in top_level_functions(os.path.join(ROOT, "pytorch", file))
                 if f not in PYTORCH_ONLY.get(file, ())]
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


def test_no_user_facing_text_names_an_internal_issue():
    """An issue number means nothing to a reader of the docs, an option's help or an error line: the README, docs/ (the
    published runs' files aside) and every Python file of the machinery, compare.py and the framework folders."""
    paths = [os.path.join(ROOT, "README.md"), os.path.join(ROOT, "compare.py"),
             *glob.glob(os.path.join(ROOT, "docs", "*.md")), *glob.glob(os.path.join(ROOT, "docs", "*.toml")),
             *glob.glob(os.path.join(ROOT, "harness", "**", "*.py"), recursive=True),
             *[p for name in (*FRAMEWORKS, "common") for p in glob.glob(os.path.join(ROOT, name, "*.py"))]]
    named = [f"{os.path.relpath(path, ROOT)}:{n}: {line.strip()}" for path in paths
             for n, line in enumerate(open(path, encoding="utf-8"), 1) if re.search(r"\b[Ii]ssues? \d+\b", line)]
    assert not named, "\n".join(named)
