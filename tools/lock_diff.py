"""Print what the running environment has that differs from a lock file.

    python tools/lock_diff.py requirements.lock

One row per package whose installed version is not the locked one, or that only one side
has. `make test-latest` prints it before it runs the suite against the newest releases, so
that a failure there can be read against the releases that changed.
"""

from __future__ import annotations

import re
import sys
from importlib import metadata
from pathlib import Path


def canonical(name: str) -> str:
    """A distribution name as pip compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def read_lock(path: Path) -> dict[str, str]:
    """``{name: version}`` of every ``name==version`` line of a pip-compile lock."""
    pins = {}
    for line in path.read_text().splitlines():
        found = re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)", line)
        if found:
            pins[canonical(found.group(1))] = found.group(2)
    return pins


def installed() -> dict[str, str]:
    """``{name: version}`` of every distribution in this environment but the project and the
    installer (the venv's own pip, which the lock does not pin)."""
    found = {canonical(d.metadata["Name"]): d.version for d in metadata.distributions()}
    for name in ("labs", "pip"):
        found.pop(name, None)
    return found


def differences(locked: dict[str, str], here: dict[str, str]) -> list[tuple[str, str, str]]:
    """``(name, locked, here)`` for each package whose version differs ("-" where absent).
    A local version label (``2.13.0+cpu``) counts as its public version."""
    rows = []
    for name in sorted(set(locked) | set(here)):
        a, b = locked.get(name, "-"), here.get(name, "-")
        if a.split("+")[0] != b.split("+")[0]:
            rows.append((name, a, b))
    return rows


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__.strip().splitlines()[0], "\nusage: python tools/lock_diff.py LOCKFILE")
        return 2
    rows = differences(read_lock(Path(argv[0])), installed())
    if not rows:
        print(f"This environment has exactly the versions of {argv[0]}.")
        return 0
    width = max(len(r[0]) for r in rows)
    print(f"{len(rows)} package(s) differ from {argv[0]}:")
    print(f"{'package':<{width}}  {'locked':<14}  here")
    for name, a, b in rows:
        print(f"{name:<{width}}  {a:<14}  {b}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
