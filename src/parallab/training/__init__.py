"""A rank's run: building it (run), the loop (trainer), checkpoints and weights on disk, the
run dir, early stopping and the best checkpoint (monitor), the batch-size finder."""
