"""The benchmark's yardsticks: a matmul peak that responds to threads, and a load record that sees other
processes' CPU time but not the run's own."""
import subprocess
import sys
import time

import pytest

from common import calibration


def test_the_matmul_peak_is_a_plausible_gflops_figure():
    peak = calibration.matmul_peak(threads=1, n=512, seconds=0.5)
    assert 1 < peak < 5000   # GFLOP/s of one core: more than a toy loop, less than a GPU


def test_the_run_s_own_work_does_not_count_as_load():
    record = calibration.LoadRecord().start()
    subprocess.run([sys.executable, "-c", "import time\nt = time.time()\nwhile time.time() - t < 1.5: pass"],
                   check=True)   # a worker of the run: a child that is waited for
    load = record.stop()
    assert load["wall_seconds"] >= 1.5
    assert load["own_cpu_seconds"] >= 1.4, load   # the busy child was ours, whatever else the machine did


def test_another_process_s_work_is_load_and_makes_a_warning():
    record = calibration.LoadRecord().start()
    other = subprocess.Popen([sys.executable, "-c", "import time\nt = time.time()\nwhile time.time() - t < 2: pass"],
                             start_new_session=True)
    time.sleep(2.2)   # it is not reaped yet: its CPU time is not ours
    load = record.stop()
    other.wait()
    assert load["other_cpu_seconds"] >= 1.0, load
    assert not load["quiet"] and calibration.warning(load).startswith("warning: the machine was not quiet")


def test_a_quiet_record_has_no_warning():
    assert calibration.warning({"quiet": True}) is None
