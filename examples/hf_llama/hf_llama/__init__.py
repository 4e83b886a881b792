"""A transformers user's project trained by parallab: a tiny Llama built from its config and
a Dataset of dict samples, nothing else (see README.md)."""
