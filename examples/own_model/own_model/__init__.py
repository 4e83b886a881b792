"""A user's own project trained by parallab: its model, its data, its YAML (see README.md)."""
