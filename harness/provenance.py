"""Where a figure comes from: the commit (and whether the tree differed from it), the date, the CPU and how busy it
was. Absolute speed differs 2x between machines of one kind and moves with every commit, so every JSON, CSV and
markdown table the project writes carries these, and a published figure can be traced to the code that made it."""
import datetime
import os
import platform
import subprocess

from .loader import ROOT


def git(*args, cwd=ROOT):
    """git's output, or None where there is no git or no repository (a tarball, an installed copy)."""
    try:
        out = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def commit(cwd=ROOT):
    """(short hash of HEAD, whether a tracked file differs from it); (None, None) outside a git checkout.
    Untracked files do not count: outputs and caches live beside the code."""
    head = git("rev-parse", "--short", "HEAD", cwd=cwd)
    if head is None:
        return None, None
    return head, bool(git("status", "--porcelain", "--untracked-files=no", cwd=cwd))


def cpu_name():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def provenance(cwd=ROOT):
    """The fields every output records; `load_average` is the 1-minute load when the output was started."""
    head, modified = commit(cwd)
    return {"commit": head, "tree_modified": modified,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "cpu": cpu_name(), "cpu_count": os.cpu_count(), "load_average": round(os.getloadavg()[0], 2)}


def provenance_line(p):
    """One line for a markdown table's caption or a printed report."""
    head = "no git commit" if p["commit"] is None else \
        f"commit {p['commit']}" + (" with local changes" if p["tree_modified"] else "")
    return f"{head}, {p['date']}, {p['cpu']} ({p['cpu_count']} cores), load average {p['load_average']:.2f}"


CSV_COLUMNS = ("commit", "tree_modified", "date", "cpu", "cpu_count", "load_average")   # on every row of a CSV
