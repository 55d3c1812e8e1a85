"""--resume: a run interrupted after some rows goes on where it stopped. The file it continues must have been
written with the same settings and on the same data: rows of different runs are never mixed."""
import json
import os
import sys

from common.interface import RosettaError

from ..publishing.provenance import commit
from ..spec import RMSPROP_FIELDS, SCHEDULE_FIELDS, default

# What decides a run's rows and numbers: --resume continues a file only if all of these are the same.
SETTINGS = ("frameworks", "model", "width", "bn", "mode", "exec", "layout", "allreduce", "shard", "accumulate", "precision",
            "allreduce_dtype", "loss_scale",
            "loss_scale_interval", "devices", "processes", "cores", "dataset", "n_synthetic",
            "epochs", "batch_size", "lr", "seed", "init", "threads", "repeats", "benchmark", "optimizer", "momentum",
            *RMSPROP_FIELDS, "weight_decay", "lr_schedule", "warmup_epochs", *SCHEDULE_FIELDS, "clip_norm", "lr_scaling",
            "reference_batch", "per_device_batch", "target_accuracy", "resume_from")

# Settings added since files were first written, and the value a file without one ran with.
ADDED = {"accumulate": [1], "shard": ["none"], "precision": ["fp32"], "allreduce_dtype": ["fp32"], "loss_scale": 2.0 ** 16,
         "loss_scale_interval": 2000, "resume_from": None,
         **{name: json.loads(json.dumps(default(name))) for name in (*SCHEDULE_FIELDS, *RMSPROP_FIELDS)}}


def settings(args):
    """This command's SETTINGS, as the JSON file stores them."""
    return json.loads(json.dumps({k: getattr(args, k) for k in SETTINGS}))


def previous_run(args):
    """The file --resume continues, refused unless written with these settings (the data's fingerprint
    is checked once the data is loaded, by check_same_data)."""
    if not os.path.exists(args.json):
        print(f"--resume: {args.json} does not exist yet; running every row", file=sys.stderr)
        return None
    try:
        with open(args.json) as f:
            old = json.load(f)
    except (OSError, ValueError) as err:
        raise RosettaError(f"--resume: cannot read {args.json} ({err})")
    if not isinstance(old, dict) or not isinstance(old.get("settings"), dict):
        raise RosettaError(f"--resume: {args.json} was not written by compare.py --json (it holds no settings)")
    written = {**ADDED, **old["settings"]}
    differ = [f"{k} {written.get(k)!r} there, {v!r} here" for k, v in settings(args).items() if written.get(k) != v]
    if differ:
        raise RosettaError(f"--resume: {args.json} holds a run with other settings ({'; '.join(differ)}); "
                           f"run without --resume to start afresh, or give another --json")
    here, there = commit()[0], (old.get("environment") or {}).get("commit")
    if here and there and here != there:   # every row of a file carries the file's one commit
        raise RosettaError(f"--resume: {args.json} was written at commit {there}, this checkout is at {here}: rows of "
                           "two versions of the code are never mixed; run without --resume to start afresh, or give "
                           "another --json")
    return old


def check_same_data(old, dataset, path):
    if old and old["dataset"].get("fingerprint") != dataset["fingerprint"]:
        raise RosettaError(f"--resume: {path} holds a run on other data (fingerprint "
                           f"{old['dataset'].get('fingerprint')} there, {dataset['fingerprint']} here); run without "
                           f"--resume to start afresh, or give another --json")


def kept_trials(old, label):
    """The trials of a row that the previous file holds as ok (a row keeps each trial's metrics)."""
    row = next((r for r in old["runs"] if r.get("row") == label and r["status"] == "ok"), None)
    return [{**row, **metrics} for metrics in row.get("trial_metrics", [{}])] if row else []
