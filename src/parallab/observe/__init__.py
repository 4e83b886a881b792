"""Observing a run: what it reports and where. The loggers (metrics.json, TensorBoard, CSV,
MLflow, W&B), the progress bar or log lines, profiler traces, MFU, memory, the bytes sent
per step, a sweep's summary, and the tensorboard server over a dir."""
