"""One constraints file from the base image's packages and our pin files, each package pinned once.

    python3 scripts/merge_constraints.py BASE.txt requirements/project.txt requirements/gpu-constraints.txt > c.txt

The base image's pins win, then the files in the order given: torch, vLLM, flash-attn and their CUDA libraries
are built against each other, and the base's versions of shared small packages are the ones its own stack was
tested with. Our files add the packages the base lacks (rocksdict, kafka-python, verl, TransferQueue, ...). Two
`-c` files naming one package at different versions would make pip fail on a conflict that is only a duplicate.
"""

from __future__ import annotations

import re
import sys


def package(line: str) -> str | None:
    """The normalized package name a constraints line pins, or None for comments and blank lines."""
    line = line.split("#", 1)[0].strip()
    if not line:
        return None
    name = re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", line)
    if name is None:
        raise ValueError(f"not a constraint: {line!r}")
    return re.sub(r"[-_.]+", "-", name.group(0)).lower()


def merge(*files: list[str]) -> list[str]:
    """The lines of each file, in order, for packages no earlier line pins (comments dropped)."""
    pinned: set[str] = set()
    out = []
    for lines in files:
        for line in lines:
            name = package(line)
            if name is not None and name not in pinned:
                pinned.add(name)
                out.append(line.split("#", 1)[0].strip())
    return out


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print("usage: merge_constraints.py BASE.txt PINS.txt...", file=sys.stderr)
        return 2
    files = []
    for path in argv:
        with open(path) as handle:
            files.append(handle.readlines())
    print("\n".join(merge(*files)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
