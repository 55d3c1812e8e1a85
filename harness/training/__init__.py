"""What one process of a run does: the training loop every framework and mode shares (loop), its timer (timing),
its checkpoints and their conversion between frameworks (checkpoints, convert), and --profile's window of steps
(profile)."""
