"""The machinery that runs, measures and publishes the translations, grouped by what it does:

    run/          compare.py's path: options, plan, trials, worker, merge, resume, outputs
    studies/      measurements beyond a row: the benchmark's statistics, calibration, the step split, the
                  projection, the expert's step, optimizer conventions, step checks, the linear scaling rule
    training/     what one process does: the training loop, its timer, checkpoints and their conversion, --profile
    processes/    a run's processes: launching them, their hosts and ports, SLURM, cores
    publishing/   the tables, the figure, provenance, and the Rosetta site with its published runs

and, beneath them all: loader.py (the one way to reach a framework folder), spec.py (one run, named once), cli.py
(the command line's manners) and files.py (a file written whole or not at all). A package imports only the packages
listed after it (training/, processes/ and publishing/ none of each other) and the four modules beneath them all,
which import no package: no import runs back up (tests/test_imports.py).

It stands above both other floors: it imports `common/` (the spec) and mounts the framework folders through
loader.py; neither of them imports it."""
