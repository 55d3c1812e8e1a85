"""docs/migration.md's walkthrough runs as written: its commands, one by one, as a new user types them (the folder
`walk` made a temporary one). A Gluon ResNet trained on 4 contexts with BatchNorm, momentum, weight decay and a
warm-up is converted to PyTorch and to JAX with --verify (logits within 1e-4), and stock code continues it in each
within its script's stated tolerance of MXNet's own continuation (a buffer copied as it is misses it by 0.28)."""
import os
import re
import shlex
import subprocess
import sys

import pytest

from conftest import ROOT as REPO

HEADING = "## Walkthrough: a Gluon ResNet on 4 devices, moved and continued"


def commands():
    """The bash block under the walkthrough's heading, a command a line, comments dropped."""
    page = open(os.path.join(REPO, "docs", "migration.md")).read()
    section = page[page.index(HEADING):]
    block = section[section.index("```bash\n") + 8:]
    return [line.split("  #")[0].strip() for line in block[:block.index("```")].splitlines() if line.strip()]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_walkthrough_s_commands_run_and_continue_the_gluon_run(tmp_path):
    lines = commands()
    assert len(lines) == 5 and all(line.startswith("python ") for line in lines)
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    outputs = []
    for line in lines:
        argv = [str(tmp_path / a[len("walk"):].lstrip("/")) if a == "walk" or a.startswith("walk/") else a
                for a in shlex.split(line)]
        done = subprocess.run([sys.executable, *argv[1:]], cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=600)
        assert done.returncode == 0, f"{line}\n{done.stdout[-1500:]}\n{done.stderr[-1500:]}"
        outputs.append(done.stdout)
    print("\n".join(outputs))
    differences = [float(x) for x in re.findall(r"continuation: ([0-9.e+-]+)", "".join(outputs))]
    logits = [float(x) for x in re.findall(r"logit difference\| ([0-9.e+-]+)", "".join(outputs))]
    assert len(differences) == 2 and max(differences) <= 1e-2, differences
    assert len(logits) == 2 and max(logits) <= 1e-4, logits
