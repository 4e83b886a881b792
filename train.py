"""Train: `python train.py [group=option ...] [key=value ...]` (see README.md)."""

from parallab.launching.preemption import ended_by_interrupt

if __name__ == "__main__":
    with ended_by_interrupt():  # Ctrl-C while the package imports: one line, not a traceback
        from parallab.cli import train

        train()
