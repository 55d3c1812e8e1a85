"""Starting worker processes and making sure they end: on success, failure, timeout and Ctrl-C."""
import json
import os
import signal
import subprocess
import sys
import tempfile

from .interface import ROOT


def kill_group(proc):
    """Each worker leads its own process group, so its children (launchers, servers) die with it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def last_line(text):
    lines = [l.strip() for l in text.splitlines() if l.strip()]
    return lines[-1] if lines else ""


def run_worker(spec, timeout=None, env=None):
    """Run one spec in a fresh `python -m common.worker`; return its result dict (never raises for a
    failed run: a crash, a timeout or a kill becomes status 'failed' with the reason)."""
    with tempfile.TemporaryDirectory(prefix="rosetta-") as tmp:
        out_path, log_path = os.path.join(tmp, "result.json"), os.path.join(tmp, "stderr.log")
        with open(log_path, "w") as log:
            proc = subprocess.Popen([sys.executable, "-m", "common.worker", json.dumps(spec), out_path],
                                    cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                    env={**os.environ, **(env or {})})
            try:
                proc.wait(timeout=timeout)
                timed_out = False
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                kill_group(proc)   # also on Ctrl-C: the KeyboardInterrupt propagates after the kill
        with open(log_path, errors="replace") as log:
            stderr = log.read()
        if timed_out:
            return {"status": "failed", "error": f"timed out after {timeout} s", "log": stderr[-4000:]}
        if os.path.exists(out_path):
            with open(out_path) as f:
                result = json.load(f)
            if result["status"] == "failed":
                result["log"] = stderr[-4000:]
            return result
        return {"status": "failed", "log": stderr[-4000:],
                "error": f"worker exited with code {proc.returncode}: {last_line(stderr) or 'no output'}"}
