"""Pretraining data read in place (data=token_files, data/token_files.py): token files
opened by memory map (files.py), windows of seq_len + 1 tokens and their seeded order
(windows.py), a weighted mixture of sources as one global order of samples (blend.py), the
loaders that read it for each rank (loader.py) and `parallab prepare-data`, which writes
such files from text (prepare.py)."""
