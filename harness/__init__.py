"""The machinery that runs, measures and reports the translations: loading a framework folder (loader), one
run's spec (spec), the training loop (training), worker processes and their launcher (worker, launch, cores),
timing, checkpoint files and the converter, the run plan, --resume and --merge behind compare.py, reports,
plots, the benchmark, its calibration, and the projection past one machine.

It stands above both other floors: it imports `common/` (the spec) and mounts the framework folders through
loader.py; neither of them imports it."""
