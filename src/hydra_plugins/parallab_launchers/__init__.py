"""parallab's Hydra plugins (Hydra instantiates plugins from the hydra_plugins package only)."""
