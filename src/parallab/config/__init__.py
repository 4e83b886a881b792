"""A run's configuration: schema (the dataclasses: keys, defaults and their words), errors
(the one-line refusal), targets (a `_target_` checked against what it names), help (the
words of --help and docs/config.md, from the schema). The ground every other part stands on;
the checks that read the whole config are the controller's (parallab.checks)."""
