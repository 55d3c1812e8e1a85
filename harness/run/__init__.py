"""compare.py's path, top to bottom: its options (options), the rows they plan (plan), the worker processes a row
runs in (worker), their records merged into the row (merge), an interrupted run continued (resume), and the files
written after every trial (outputs)."""
