"""Train: `python train.py [group=option ...] [key=value ...]` (see README.md)."""

from parallab.cli import train

if __name__ == "__main__":
    train()
