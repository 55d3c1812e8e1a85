"""A pytest-xdist worker ends as soon as it has sent its results. Its interpreter's teardown of every module and C++
object the four frameworks made (and pytest's last garbage collections, JAX's atexit freeing of its backends) took
8 to 10 s at the end of each run of the suite here, while the controller waited for the workers' processes to end.
Nothing is lost: the controller has the worker's every report and its exit status, xdist reads nothing more from
it, and what its frameworks leave in the temporary folder is in the session's, which the controller removes."""
import os
import sys


def end_after_sending_results(config):
    """Called first of a worker's pytest_unconfigure hooks, after its `workerfinished` message: the process ends
    here. The controller, and a run without -n, end as ever."""
    if not hasattr(config, "workerinput"):   # set on pytest-xdist's workers only
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
