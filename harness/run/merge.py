"""A run's result from its processes' records, checked: every process ok, on the same data, ending with the
same weights. compare.py merges the records of the workers it started; `--merge` those of a hand-launched
run (torchrun, TF_CONFIG, DMLC_*, JAX_*), read from their out-{rank}.json files."""
import json

from common.data import load_dataset
from common.interface import RosettaError

from ..studies.benchmark import aggregate
from ..spec import RunSpec
from ..training.loop import summarize


def merge_records(records, fingerprint):
    """A run's result from its processes' records (a run whose processes drifted apart computed something else)."""
    if any(r["status"] != "ok" for r in records):
        return next(r for r in records if r["status"] != "ok")
    if {r["fingerprint"] for r in records} != {fingerprint}:
        return {"status": "failed", "error": "a worker saw different data (fingerprint mismatch)"}
    if len({r["digest"] for r in records}) != 1:
        return {"status": "failed", "error": "the processes ended with different weights"}
    if len({r.get("final_loss_scale") for r in records}) != 1:   # fp16: one skipped a step another took
        return {"status": "failed", "error": "the processes ended at different loss scales"}
    traces = [r["profile"] for r in records if r.get("profile")]   # --profile: rank 0's trace
    return {"status": "ok", "error": None, "fingerprint": fingerprint, "digest": records[0]["digest"],
            "profile": traces[0] if traces else None,
            "device_names": sum((r["device_names"] for r in records), []), **summarize(records)}


def read_worker_records(paths):
    """The workers' records grouped by run (a run is its spec)."""
    runs = {}
    for path in paths:
        try:
            with open(path) as f:
                record = json.load(f)
        except (OSError, ValueError) as err:
            raise RosettaError(f"{path}: cannot be read as a worker's JSON record ({err})")
        if not isinstance(record, dict) or "status" not in record:
            what = "compare.py's --json output, " if isinstance(record, dict) and "runs" in record else ""
            raise RosettaError(f"{path}: not a worker's record ({what}no status); --merge takes the "
                               "out-{rank}.json files that python -m harness.run.worker writes")
        if record.get("status") != "ok":
            raise RosettaError(f"{path}: the worker {record.get('status')}: {record.get('error')}")
        if "spec" not in record:
            raise RosettaError(f"{path}: no run spec in the record (written by python -m harness.run.worker?)")
        runs.setdefault(RunSpec.of(record["spec"]), []).append(record)
    return list(runs.items())


def merge_files(paths):
    """(data set summary, rows) of the hand-launched runs among `paths`: one row per run, every rank once."""
    runs, datasets = [], {}   # datasets: (name, data_dir, size, seed) -> summary of the local copy
    for spec, records in read_worker_records(paths):
        world = records[0]["world"]
        ranks = sorted(r["rank"] for r in records)
        if ranks != list(range(world)):
            raise RosettaError(f"{spec.framework} {spec.mode} run of {world} processes: found rank(s) "
                               f"{', '.join(map(str, ranks))}; give one file per rank")
        source = (spec.dataset, spec.data_dir, spec.n_synthetic, spec.seed)
        if source not in datasets:
            datasets[source] = load_dataset(*source).summary()
        row = spec.replace(processes=world).row()
        runs.append(aggregate([{**row, **merge_records(records, datasets[source]["fingerprint"])}]))
    summaries = {d["fingerprint"]: d for d in datasets.values()}
    if len(summaries) != 1:
        raise RosettaError(f"the runs used {len(summaries) or 'no'} different data sets; merge the runs of "
                           "one data set at a time")
    return next(iter(summaries.values())), runs
