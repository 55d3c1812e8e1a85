"""Every output names the code and the machine it came from (harness/publishing/provenance.py)."""
import csv
import re
import subprocess

from harness.studies.benchmark import write_csv
from harness.publishing.provenance import CSV_COLUMNS, commit, environment, environment_line, provenance, provenance_line


def git(repo, *args):
    return subprocess.run(["git", "-c", "user.email=t@example.com", "-c", "user.name=t", *args], cwd=repo,
                          check=True, capture_output=True, text=True).stdout.strip()


def test_the_commit_and_whether_tracked_files_differ_from_it(tmp_path):
    assert commit(tmp_path) == (None, None)   # not a checkout: said, not guessed
    git(tmp_path, "init", "-q")
    (tmp_path / "code.py").write_text("a = 1\n")
    git(tmp_path, "add", "code.py")
    git(tmp_path, "commit", "-qm", "one")
    head = git(tmp_path, "rev-parse", "--short", "HEAD")
    assert commit(tmp_path) == (head, False)
    (tmp_path / "results.json").write_text("{}")   # an output beside the code is not a change to it
    assert commit(tmp_path) == (head, False)
    (tmp_path / "code.py").write_text("a = 2\n")
    assert commit(tmp_path) == (head, True)
    line = provenance_line(provenance(tmp_path))
    assert line.startswith(f"commit {head} with local changes, ")
    assert re.search(r", \d{4}-\d\d-\d\d \d\d:\d\d UTC, .+ \(\d+ cores\), load average \d+\.\d\d$", line), line


def test_the_json_environment_and_its_line_carry_the_provenance():
    env = environment()
    assert {"commit", "tree_modified", "date", "cpu", "cpu_count", "load_average"} <= set(env)
    assert env["commit"] == commit()[0] and env["commit"] is not None   # the tests run in the repo's checkout
    assert environment_line(env).startswith(f"commit {env['commit']}")


def test_every_csv_row_carries_the_provenance(tmp_path):
    env = {**provenance(), "commit": "abc1234", "tree_modified": True}
    rows = [{"framework": fw, "mode": "scratch", "devices": 2, "processes": 1, "status": "ok"}
            for fw in ("pytorch", "jax")]
    path = tmp_path / "runs.csv"
    write_csv(str(path), rows, env)
    with open(path, newline="") as f:
        table = list(csv.DictReader(f))
    assert [r["framework"] for r in table] == ["pytorch", "jax"]
    for r in table:
        assert {k: r[k] for k in CSV_COLUMNS} == {k: str(env[k]) for k in CSV_COLUMNS}
    assert [k for k in table[0] if not any(r[k] for r in table)] == []   # no column that no row fills (usage.md)


def test_the_published_command_runs_the_whole_run():
    """The site shows the file's command without its outputs and without --resume, which needs the --json it drops
    (the page showed a command that fails: "--resume ... needs the --json PATH"); --resume-from stays."""
    from harness.publishing.published import command
    recorded = "compare.py --resume --json r.json --csv r.csv --epochs 3 --resume-from ck/pytorch-epoch1.pt --resume"
    assert command({"command": recorded}) == "compare.py --epochs 3 --resume-from ck/pytorch-epoch1.pt"
