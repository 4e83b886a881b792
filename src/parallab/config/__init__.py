"""A run's configuration and the checks made on it before any worker starts.

schema (the dataclasses: keys, defaults and their words), errors (the one-line refusal),
targets (a `_target_`'s checks) are the bottom layer every other part imports; validate,
trial and help are the controller's, above everything they check.
"""
