"""What the controller checks before any worker starts: every part's own checks run in
order with `auto` values resolved (validate), and one batch of a user's model, data and
loss tried (trial); where a run starts from (starts); evaluate.py's config, the
checkpoint's model and data (evaluating)."""
