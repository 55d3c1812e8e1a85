"""A run's processes: starting them and making sure they end (launch), where they run and what each framework's
launcher would tell them (cluster; slurm, for a task srun started), and the cores each may use (cores)."""
