"""Run a learner's code in a sandbox: its own filesystem view, network and process table.

The grader runs a learner's notebook (its kernel, and the ranks the kernel starts) through
:func:`isolated`: the command is started by util-linux ``unshare`` in new mount, network and
PID namespaces (and a user namespace where the grader is not root), then this module's
``__main__`` builds the sandbox's filesystem before it ``exec``s the command:

* a fresh root (a ``tmpfs``) holding, read-only, only what Python needs: the system's
  ``/usr``, ``/bin``, ``/lib*``, ``/etc``, the interpreter's prefixes (the virtual
  environment included) and the ``labs`` package; the rest of the machine (the reference
  notebooks, the repository, ``$HOME``, other users' files) is not there at all;
* one writable directory, the scratch directory the grader gave (the composed notebook, the
  pickled functions, the verdicts), which the grader deletes after the exercise; and empty
  writable ``/tmp``, ``/dev/shm`` and ``$HOME`` that vanish with the sandbox;
* a network namespace with only its own loopback, so the ranks reach each other on
  127.0.0.1 and nothing else (not the grading machine's own 127.0.0.1);
* a PID namespace with its own ``/proc``: no other process of the machine can be seen or
  signalled, and when the sandbox's first process ends, every process in it ends too.

The root is switched with ``pivot_root`` and the old one detached, so no path leads back out
(a ``chroot`` can be escaped by a process that is root inside it).

:func:`isolation_problem` says why a sandbox cannot be made on this machine (no ``unshare``,
user namespaces disabled...), so ``grade`` can refuse before it starts anything.
"""

from __future__ import annotations

import ctypes
import enum
import fcntl
import os
import shutil
import socket
import struct
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

UNSHARE = "unshare"
#: Read-only paths every sandbox holds, where they exist: the system's programs and libraries
#: and its configuration (``/etc/hosts`` resolves ``localhost``; ``/etc/passwd`` names users).
SYSTEM_PATHS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")
#: The sandbox's mount point of the old root while it is detached (inside the new root).
_OLD_ROOT = ".old-root"

# linux/mount.h, linux/sockios.h, linux/if.h
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_REMOUNT, _MS_BIND = 1, 2, 4, 32, 4096
_MS_REC, _MS_PRIVATE = 16384, 1 << 18
_MNT_DETACH = 2
_SIOCGIFFLAGS, _SIOCSIFFLAGS, _IFF_UP = 0x8913, 0x8914, 0x1


class Isolation(enum.Enum):
    """How a learner's code was run."""

    SANDBOX = "sandbox"
    """In :func:`isolated`'s namespaces: it saw only the environment and its scratch folder."""
    NONE = "none"
    """With the grader's own rights: the instructor chose to grade without isolation."""


def unshare_command() -> list[str]:
    """The ``unshare`` call that starts a sandbox: new mount, network and PID namespaces,
    the child killed with it, and a user namespace (the grader mapped to root) where the
    grader is not root."""
    command = [UNSHARE, "--mount", "--net", "--pid", "--fork", "--kill-child"]
    if os.geteuid() != 0:
        command.insert(1, "--map-root-user")
    return command


def isolation_problem() -> str:
    """Why :func:`isolated` cannot work here, in words, or "" when it can (it starts one
    sandbox running ``true``)."""
    if not sys.platform.startswith("linux"):
        return f"a sandbox needs Linux namespaces; this is {sys.platform}"
    if shutil.which(UNSHARE) is None:
        return ("util-linux `unshare` is not installed (Debian: apt-get install util-linux; "
                "bubblewrap's bwrap is not used)")
    probe = [*isolated([sys.executable, "-c", "pass"], scratch=Path("/"), probe=True)]
    try:
        done = subprocess.run(probe, capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"`unshare` could not start a sandbox: {err}"
    if done.returncode != 0:
        why = (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1]
        hint = ("" if os.geteuid() == 0 else "; unprivileged user namespaces may be off "
                "(sysctl kernel.unprivileged_userns_clone=1, or "
                "kernel.apparmor_restrict_unprivileged_userns=0 on Ubuntu)")
        return f"`unshare` could not start a sandbox: {why}{hint}"
    return ""


def readable_paths() -> list[Path]:
    """What a sandbox may read: the system's paths, Python's prefixes and the labs package
    (an editable install keeps it outside site-packages), each where it exists."""
    import labs  # noqa: PLC0415 - the package this module belongs to, located at run time

    paths = [Path(p) for p in SYSTEM_PATHS]
    paths += [Path(p) for p in {sys.prefix, sys.base_prefix, sys.exec_prefix}]
    paths.append(Path(labs.__file__).resolve().parent)
    paths.append(Path(sys.executable).resolve().parent)
    return _outermost(p for p in paths if p.exists())


def _outermost(paths: object) -> list[Path]:
    """The paths with any path inside another one dropped (binding the outer one is enough)."""
    unique = sorted({Path(os.path.abspath(p)) for p in paths},  # type: ignore[attr-defined]
                    key=lambda p: len(p.parts))
    kept: list[Path] = []
    for path in unique:
        if not any(path == k or k in path.parents for k in kept):
            kept.append(path)
    return kept


def isolated(command: Sequence[str], *, scratch: Path, probe: bool = False) -> list[str]:
    """``command`` wrapped to run in a new sandbox whose one writable directory is
    ``scratch`` (it must exist; the command starts there). ``probe`` builds the sandbox but
    binds no scratch (for :func:`isolation_problem`)."""
    # Run as a script, not ``-m labs.grading.isolation``: importing the labs package would
    # import torch, seconds of start-up for every sandbox.
    inner = [sys.executable, str(Path(__file__).resolve()), "--home", str(Path.home())]
    if not probe:
        inner += ["--scratch", str(Path(scratch).resolve())]
    inner += [f"--read={p}" for p in readable_paths()]
    return [*unshare_command(), *inner, "--", *command]


# --- inside the namespaces -------------------------------------------------------------------


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _mount(source: str | None, target: Path, fstype: str | None, flags: int,
           data: str | None = None) -> None:
    libc = _libc()
    encode = (lambda s: None if s is None else s.encode())  # noqa: E731
    if libc.mount(encode(source), str(target).encode(), encode(fstype), ctypes.c_ulong(flags),
                  encode(data)) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"sandbox: mount {source or fstype} on {target}: "
                             f"{os.strerror(errno)}")


def _bind(source: Path, target: Path, *, writable: bool) -> None:
    """``source`` at ``target`` (created), read-only unless ``writable``. The read-only
    remount keeps the flags a user namespace may not drop (nosuid, nodev)."""
    if source.is_dir():
        target.mkdir(parents=True, exist_ok=True)
    else:
        target.parent.mkdir(parents=True, exist_ok=True)
        target.touch()
    _mount(str(source), target, None, _MS_BIND | _MS_REC)
    if not writable:
        stat = os.statvfs(target)
        kept = (_MS_NOSUID if stat.f_flag & os.ST_NOSUID else 0) | (
            _MS_NODEV if stat.f_flag & os.ST_NODEV else 0)
        _mount(None, target, None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY | kept)


def _tmpfs(target: Path) -> None:
    target.mkdir(parents=True, exist_ok=True)
    _mount("tmpfs", target, "tmpfs", _MS_NOSUID | _MS_NODEV, "mode=1777")


def _loopback_up() -> None:
    """Bring up the new network namespace's ``lo`` (it starts down)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        request = struct.pack("16sh", b"lo", 0)
        flags = struct.unpack("16sh", fcntl.ioctl(sock, _SIOCGIFFLAGS, request))[1]
        fcntl.ioctl(sock, _SIOCSIFFLAGS, struct.pack("16sh", b"lo", flags | _IFF_UP))


def build_root(new_root: Path, read: Sequence[Path], scratch: Path | None, home: Path) -> None:
    """Inside fresh namespaces: make ``new_root`` the root holding ``read`` (read-only),
    ``scratch`` (writable), /dev, a new /proc, and empty /tmp, /dev/shm and ``home``."""
    _mount(None, Path("/"), None, _MS_REC | _MS_PRIVATE)  # nothing propagates back out
    _tmpfs(new_root)
    # The empty writable folders first: a read-only path may lie inside one (a pyenv Python
    # under $HOME), and is then bound on top of it.
    for path in (Path("/tmp"), Path("/var/tmp"), home):
        _tmpfs(new_root / path.relative_to("/"))
    for path in read:
        _bind(path, new_root / path.relative_to("/"), writable=False)
    _bind(Path("/dev"), new_root / "dev", writable=True)  # null, zero, urandom, the tty
    _tmpfs(new_root / "dev" / "shm")  # torch shares tensors between processes here
    if scratch is not None:
        _bind(scratch, new_root / scratch.relative_to("/"), writable=True)
    (new_root / "proc").mkdir(exist_ok=True)
    _mount("proc", new_root / "proc", "proc", _MS_NOSUID | _MS_NODEV)
    old = new_root / _OLD_ROOT
    old.mkdir()
    subprocess.run(["pivot_root", str(new_root), str(old)], check=True)
    os.chdir("/")
    if _libc().umount2(f"/{_OLD_ROOT}".encode(), _MNT_DETACH) != 0:
        raise OSError(ctypes.get_errno(), "sandbox: cannot detach the old root")
    os.rmdir(f"/{_OLD_ROOT}")


def main(argv: Sequence[str] | None = None) -> int:
    """``python labs/grading/isolation.py [--scratch DIR] --read=PATH... -- COMMAND...``,
    run by :func:`isolated` inside the new namespaces (as pid 1 of the new PID namespace)."""
    import argparse  # noqa: PLC0415

    args = list(sys.argv[1:] if argv is None else argv)
    if "--" not in args:
        print("usage: python labs/grading/isolation.py [--scratch DIR] --read=PATH ... "
              "-- COMMAND ...", file=sys.stderr)
        return 2
    split = args.index("--")
    parser = argparse.ArgumentParser(prog="labs/grading/isolation.py")
    parser.add_argument("--scratch", type=Path)
    parser.add_argument("--home", type=Path, default=Path("/root"))
    parser.add_argument("--read", type=Path, action="append", default=[])
    options = parser.parse_args(args[:split])
    command = args[split + 1:]
    # The new root is built on a directory only this mount namespace sees: the tmpfs is
    # mounted over /mnt's view here, and /mnt itself is not touched outside.
    build_root(Path("/mnt"), options.read, options.scratch, options.home)
    _loopback_up()
    os.environ["HOME"] = str(options.home)
    os.environ["TMPDIR"] = "/tmp"
    if options.scratch is not None:
        os.chdir(options.scratch)
    os.execvp(command[0], command)
    return 127  # not reached


if __name__ == "__main__":
    sys.exit(main())
