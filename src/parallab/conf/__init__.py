"""parallab's config groups (found by Hydra as pkg://parallab.conf)."""
