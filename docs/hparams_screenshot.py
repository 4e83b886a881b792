"""Redo docs/hparams.png: TensorBoard's HParams view over a real 2 x 2 sweep.

    python docs/hparams_screenshot.py [SWEEP_DIR]

Without SWEEP_DIR it first runs `python train.py -m parallel=ddp parallel.world_size=1,2
data.batch_size=32,64` on synthetic data. Needs a Chromium (`apt-get install chromium`).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
from parallab.observe.board import serve  # noqa: E402

SWEEP = ["-m", "parallel=ddp", "parallel.world_size=1,2", "data.batch_size=32,64",
         "data=synthetic", "trainer.epochs=2", "device=cpu"]


def main() -> None:
    if len(sys.argv) > 1:
        sweep_dir = Path(sys.argv[1])
    else:
        sweep_dir = Path(tempfile.mkdtemp(prefix="parallab-hparams-")) / "sweep"
        subprocess.run([sys.executable, str(REPO / "train.py"), *SWEEP,
                        f"hydra.sweep.dir={sweep_dir}"], check=True)
    browser = next(filter(None, map(shutil.which, ("chromium", "chromium-browser",
                                                    "google-chrome"))), None)
    if browser is None:
        sys.exit("no Chromium found: apt-get install chromium")
    out = REPO / "docs" / "hparams.png"
    with serve(sweep_dir, runs=4) as board:
        subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu",
                        "--hide-scrollbars", "--window-size=1600,900",
                        "--virtual-time-budget=20000", f"--screenshot={out}",
                        f"{board.url}/?darkMode=false#hparams"], check=True,
                       capture_output=True)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
