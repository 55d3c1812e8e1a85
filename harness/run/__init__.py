"""compare.py's path, top to bottom: its options (options), the rows they plan (plan), each row's trials, the step
split and the restarts (trials), the worker processes a trial runs in (worker), their records merged into the row
(merge), an interrupted run continued (resume), and the files written after every trial (outputs)."""
