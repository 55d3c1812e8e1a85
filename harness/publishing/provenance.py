"""Where a figure comes from: the commit (and whether the tree differed from it), the date, the CPU and how busy it
was. Absolute speed differs 2x between machines of one kind and moves with every commit, so every JSON, CSV and
markdown table the project writes carries these, and a published figure can be traced to the code that made it.
A comparison's file records them within its whole environment: the versions, the GPUs, the command."""
import datetime
import os
import platform
import shutil
import subprocess
import sys

from common.interface import FRAMEWORKS

from ..loader import ROOT, installed_version


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


def gpu_names():
    """GPUs as nvidia-smi lists them (no framework import needed); empty on CPU-only machines."""
    if not shutil.which("nvidia-smi"):
        return []
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in out.splitlines() if line.strip()]


def environment():
    """A run's whole environment: the provenance every output records, and the versions, GPUs and command."""
    return {
        **provenance(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "frameworks": {name: installed_version(name) for name in FRAMEWORKS},
        "numpy": installed_version_of("numpy"),
        "gpus": gpu_names(),
        "command": " ".join([os.path.basename(sys.argv[0])] + sys.argv[1:]),
    }


def environment_line(env):
    versions = ", ".join(f"{name} {v}" for name, v in env["frameworks"].items() if v)
    line = (f"{provenance_line(env)}; {', '.join(env['gpus']) or 'no GPU'}; Python {env['python']}, "
            f"{versions}, numpy {env['numpy']}; {env['platform']}")
    calibration = env.get("calibration")
    if calibration:
        peaks = " -> ".join(f"{calibration[k]:.0f}" for k in ("matmul_peak_gflops_start", "matmul_peak_gflops_end")
                            if k in calibration)
        line += f". Float32 matmul peak at {calibration['threads']} thread(s), start -> end: {peaks} GFLOP/s"
        low = calibration.get("low_matmul_peaks_gflops")
        if low:
            line += f"; PyTorch's matmul at the start: {', '.join(f'{k} {v:.0f}' for k, v in low.items())} GFLOP/s"
        if calibration.get("lockstep"):
            steady = calibration["lockstep"]
            line += (f". Numpy alone, a single-threaded process pinned to each of cores "
                     f"{', '.join(map(str, steady['cores']))}, {1e3 * steady['step_seconds']:.0f} ms steps: waiting for "
                     f"the slower step +{steady['lockstep_seconds'] / steady['step_seconds'] - 1:.1%}")
    return line + load_clause(env)


def load_clause(env):
    """How busy the machine was while the run ran, where its file records it (timed runs do): what says how far
    its timings can be trusted."""
    load = env.get("load")
    return (f". Load: other processes used {100 * load['other_cpu_share']:.1f}% of the CPU during the run "
            f"({'quiet' if load['quiet'] else 'NOT QUIET'}); load average {load['loadavg_start'][0]:.2f} at the "
            f"start, {load['loadavg_end'][0]:.2f} at the end") if load else ""


def installed_version_of(dist):
    import importlib.metadata
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None



CSV_COLUMNS = ("commit", "tree_modified", "date", "cpu", "cpu_count", "load_average")   # on every row of a CSV
