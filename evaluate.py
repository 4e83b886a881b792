"""Evaluate a checkpoint: `python evaluate.py ckpt=PATH [group=option ...]`."""

from parallab.commands import evaluate

if __name__ == "__main__":
    evaluate()
