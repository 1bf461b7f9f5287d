"""Run a learner's code in a sandbox: its own user, filesystem view, network and process table,
within limits.

The grader runs a learner's notebook (its kernel, and the ranks the kernel starts) through
:func:`isolated`, which runs this file as a script. The script makes the namespaces itself
(``unshare(2)`` through ctypes, no helper binary), builds the sandbox's filesystem, gives up
every privilege and ``exec``s the command:

* **a user namespace, always.** Where the grader is root, the namespace maps its root to the
  machine's root only while the sandbox is built, and the learner's code runs as
  :data:`SANDBOX_UID` (``nobody``), mapped to the same unprivileged id outside: no capability,
  no file of root's it could read or write, no ``mount``. Where the grader is a user, the
  namespace maps that user to root, and the code runs as it with every capability dropped.
  Either way ``no_new_privs`` is set, so no set-user-id program gives a privilege back, and the
  capability bounding set is empty.
* **a fresh root** (a ``tmpfs``) holding, read-only and ``nosuid``, only what Python needs: the
  system's ``/usr``, ``/bin``, ``/lib*``, ``/etc``, the interpreter's prefixes (the virtual
  environment included) and the ``labs`` package; the rest of the machine (the reference
  notebooks, the repository, ``$HOME``, other users' files) is not there at all. The old root
  is detached after ``pivot_root``, so no path leads back out.
* **a ``/dev`` of four devices** (``null``, ``zero``, ``random``, ``urandom``) and a
  ``/dev/shm`` for torch's shared tensors; no disk, no terminal. ``/proc`` is the sandbox's
  own (a new PID namespace: it sees only its own processes) and ``/proc/sys`` is read-only.
* **one writable host directory**, the scratch directory the grader gave (handed to the
  sandbox's user), and empty ``/tmp``, ``/var/tmp``, ``$HOME`` and ``/dev/shm`` whose sizes are
  capped and which vanish with the sandbox.
* **a network namespace** with only its own loopback, so the ranks reach each other on
  127.0.0.1 and nothing else (not the grading machine's own 127.0.0.1).
* **limits** (:class:`Limits`): the address space of each process, the number of processes
  and threads, the size of any one file, no core dumps. When the script's first process ends,
  every process in the sandbox ends too, and when the grader kills the script, so does the
  sandbox.

:func:`isolation_problem` says why a sandbox cannot be made on this machine (not Linux, user
namespaces disabled...), so ``grade`` can refuse before it starts anything.
"""

from __future__ import annotations

import ctypes
import enum
import fcntl
import os
import resource
import signal
import socket
import stat
import struct
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

#: Read-only paths every sandbox holds, where they exist: the system's programs and libraries
#: and its configuration (``/etc/hosts`` resolves ``localhost``; ``/etc/passwd`` names users).
SYSTEM_PATHS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")
#: The only devices a sandbox holds.
DEVICES = ("null", "zero", "random", "urandom")
#: The user (and group) the learner's code runs as when the grader is root: ``nobody``, the
#: same id inside and outside the sandbox, so that what it writes in the scratch folder is
#: owned by an unprivileged user on the grading machine too.
SANDBOX_UID = SANDBOX_GID = 65534
#: The sandbox's mount point of the old root while it is detached (inside the new root).
_OLD_ROOT = ".old-root"
_GIB, _MIB = 1 << 30, 1 << 20

# linux/sched.h, linux/mount.h, linux/sockios.h, linux/if.h, linux/prctl.h, linux/securebits.h
_CLONE_NEWNS, _CLONE_NEWUTS, _CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
_CLONE_NEWUSER, _CLONE_NEWPID, _CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC, _MS_REMOUNT, _MS_BIND = 1, 2, 4, 8, 32, 4096
_MS_NOATIME, _MS_NODIRATIME, _MS_RELATIME = 1024, 2048, 1 << 21
_MS_REC, _MS_PRIVATE = 16384, 1 << 18
_MNT_DETACH = 2
_SIOCGIFFLAGS, _SIOCSIFFLAGS, _IFF_UP = 0x8913, 0x8914, 0x1
_PR_SET_PDEATHSIG, _PR_CAPBSET_DROP, _PR_SET_NO_NEW_PRIVS = 1, 24, 38
_PR_SET_SECUREBITS = 28
_SECBIT_ALL_LOCKED = 0x2F  # NOROOT, NOROOT_LOCKED, NO_SETUID_FIXUP(_LOCKED), KEEP_CAPS_LOCKED
_CAP_VERSION_3 = 0x20080522
_CAP_LAST_CAP_FILE = Path("/proc/sys/kernel/cap_last_cap")
#: pivot_root(2)'s number where glibc has no wrapper for it; elsewhere util-linux's program.
_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}


class Isolation(enum.Enum):
    """How a learner's code was run."""

    SANDBOX = "sandbox"
    """In :func:`isolated`'s namespaces: it saw only the environment and its scratch folder."""
    NONE = "none"
    """With the grader's own rights: the instructor chose to grade without isolation."""


@dataclass(frozen=True)
class Limits:
    """What one sandbox may use. Every process started in it inherits the same limits."""

    address_space: int = 6 * _GIB
    """Bytes of virtual memory per process (``RLIMIT_AS``). A rank that imported torch maps
    about 0.7 GiB; an allocation past the limit raises ``MemoryError``."""
    processes: int = 1024
    """Processes and threads of the sandbox's user (``RLIMIT_NPROC``): a kernel, its ranks
    and their threads use about 100."""
    file_size: int = 256 * _MIB
    """Bytes of any one file it writes (``RLIMIT_FSIZE``)."""
    tmpfs_size: int = 512 * _MIB
    """Bytes each of ``/tmp``, ``/var/tmp``, ``$HOME`` and ``/dev/shm`` may hold."""

    def args(self) -> list[str]:
        return [f"--address-space={self.address_space}", f"--processes={self.processes}",
                f"--file-size={self.file_size}", f"--tmpfs-size={self.tmpfs_size}"]

    def words(self) -> str:
        """The limits as an instructor reads them in a verdict."""
        return (f"{self.address_space / _GIB:g} GiB of memory per process, "
                f"{self.processes} processes and threads, {self.file_size / _MIB:g} MiB per "
                f"file, {self.tmpfs_size / _MIB:g} MiB in each of /tmp, $HOME and /dev/shm")


def isolation_problem() -> str:
    """Why :func:`isolated` cannot work here, in words, or "" when it can (it starts one
    sandbox running ``python -c pass``)."""
    if not sys.platform.startswith("linux"):
        return f"a sandbox needs Linux namespaces; this is {sys.platform}"
    closed = closed_to_the_sandbox_user()
    if closed:
        return (f"the sandbox runs a learner's code as nobody (uid {SANDBOX_UID}), who cannot "
                f"read {', '.join(map(str, closed))}, where the kernel's packages are; make "
                f"it readable to everyone (chmod a+rX {closed[0]})")
    probe = isolated([sys.executable, "-c", "pass"], scratch=Path("/"), probe=True)
    try:
        done = subprocess.run(probe, capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"a sandbox could not be started: {err}"
    if done.returncode != 0:
        why = (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1]
        hint = ("" if os.geteuid() == 0 else "; unprivileged user namespaces may be off "
                "(sysctl kernel.unprivileged_userns_clone=1, or "
                "kernel.apparmor_restrict_unprivileged_userns=0 on Ubuntu)")
        return f"a sandbox could not be started: {why}{hint}"
    return ""


def closed_to_the_sandbox_user() -> list[Path]:
    """The folders of :func:`readable_paths` that the sandbox's user cannot enter: with a
    root grader that user is nobody, for whom a folder needs read and execute for others
    (``mktemp -d`` makes one with mode 0700). Empty when the grader is not root: the sandbox
    then keeps the grader's own user."""
    if os.geteuid() != 0:
        return []
    others = stat.S_IROTH | stat.S_IXOTH
    return [p for p in readable_paths()
            if p.is_dir() and (p.stat().st_mode & others) != others]


def readable_paths() -> list[Path]:
    """What a sandbox may read: the system's paths, Python's prefixes, the labs package (an
    editable install keeps it outside site-packages) and every folder on the path that holds
    installed distributions (``pip install --target DIR`` with ``DIR`` on ``PYTHONPATH``, as
    ``make test-gpu`` installs the kernel's packages beside a box's own torch), each where it
    exists. A folder on the path that holds no distribution (a checkout on ``PYTHONPATH``,
    with its reference notebooks) is not bound."""
    import labs  # noqa: PLC0415 - the package this module belongs to, located at run time

    paths = [Path(p) for p in SYSTEM_PATHS]
    paths += [Path(p) for p in {sys.prefix, sys.base_prefix, sys.exec_prefix}]
    paths.append(Path(labs.__file__).resolve().parent)
    paths.append(Path(sys.executable).resolve().parent)
    paths += site_folders()
    return _outermost(p for p in paths if p.exists())


def site_folders() -> list[Path]:
    """The folders on ``sys.path`` that hold installed distributions (a ``*.dist-info``)."""
    found = []
    for entry in sys.path:
        folder = Path(entry or os.curdir).resolve()
        if folder.is_dir() and next(folder.glob("*.dist-info"), None) is not None:
            found.append(folder)
    return found


def _outermost(paths: object) -> list[Path]:
    """The paths with any path inside another one dropped (binding the outer one is enough)."""
    unique = sorted({Path(os.path.abspath(p)) for p in paths},  # type: ignore[attr-defined]
                    key=lambda p: len(p.parts))
    kept: list[Path] = []
    for path in unique:
        if not any(path == k or k in path.parents for k in kept):
            kept.append(path)
    return kept


def isolated(command: Sequence[str], *, scratch: Path, probe: bool = False,
             limits: Limits = Limits(), share_pids: bool = False) -> list[str]:
    """``command`` wrapped to run in a new sandbox whose one writable directory is
    ``scratch`` (it must exist; the command starts there). ``probe`` builds the sandbox but
    binds no scratch (for :func:`isolation_problem`). ``share_pids`` keeps the caller's PID
    namespace (and its /proc): the judge's ranks sandbox (:mod:`labs.grading.ranks`), whose
    processes the launcher outside must signal by the pids it was told."""
    # Run as a script, not ``-m labs.grading.isolation``: importing the labs package would
    # import torch, seconds of start-up for every sandbox. -I: no user site, no environment
    # variables steer this interpreter, and the current directory is not on its path.
    inner = [sys.executable, "-I", str(Path(__file__).resolve()), "--home", str(Path.home()),
             *limits.args()]
    if share_pids:
        inner.append("--share-pids")
    if not probe:
        inner += ["--scratch", str(Path(scratch).resolve())]
    inner += [f"--read={p}" for p in readable_paths()]
    return [*inner, "--", *command]


# --- system calls --------------------------------------------------------------------------------


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"sandbox: {what}: {os.strerror(errno)}")


def _prctl(option: int, arg: int) -> None:
    _check(_libc().prctl(option, ctypes.c_ulong(arg), 0, 0, 0), f"prctl({option})")


def _mount(source: str | None, target: Path, fstype: str | None, flags: int,
           data: str | None = None) -> None:
    encode = (lambda s: None if s is None else s.encode())  # noqa: E731
    _check(_libc().mount(encode(source), str(target).encode(), encode(fstype),
                         ctypes.c_ulong(flags), encode(data)),
           f"mount {source or fstype} on {target}")


# --- outside: the namespaces and the id maps -----------------------------------------------------


def privileged() -> bool:
    """Whether this process may map ids other than its own into a new user namespace: root
    with its capabilities (a root grader), not the root of a sandbox that dropped them."""
    if os.geteuid() != 0:
        return False
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        return False
    effective = next((int(line.split()[1], 16) for line in status.splitlines()
                      if line.startswith("CapEff:")), 0)
    setuid_setgid = (1 << 7) | (1 << 6)  # CAP_SETUID, CAP_SETGID
    return effective & setuid_setgid == setuid_setgid


def _id_maps(outer_uid: int, outer_gid: int, root: bool) -> tuple[str, str, str]:
    """(uid_map, gid_map, setgroups) for the new user namespace. Privileged ``root`` maps
    itself (to build the sandbox) and :data:`SANDBOX_UID` (to run in it); anyone else may map
    only itself, to root."""
    if root:
        uids = f"0 0 1\n{SANDBOX_UID} {SANDBOX_UID} 1\n"
        gids = f"0 0 1\n{SANDBOX_GID} {SANDBOX_GID} 1\n"
        return uids, gids, "allow"
    return f"0 {outer_uid} 1\n", f"0 {outer_gid} 1\n", "deny"


def _enter_namespaces(root: bool, new_pids: bool = True) -> None:
    """Make this process the first of new user, mount, network, IPC, UTS and (``new_pids``)
    PID namespaces: a child unshares them and waits while this process (still privileged
    outside) writes its id maps (``root``: :func:`privileged`); the child forks the sandbox's
    first process (pid 1 of the new PID namespace) and returns in it. This process and the
    child only wait, pass on their fate and exit: a kill of this process kills the sandbox."""
    uid, gid = os.geteuid(), os.getegid()
    unshared_r, unshared_w = os.pipe()
    mapped_r, mapped_w = os.pipe()
    child = os.fork()
    if child == 0:
        os.close(unshared_r)
        os.close(mapped_w)
        _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        _check(_libc().unshare(_CLONE_NEWUSER | _CLONE_NEWNS | _CLONE_NEWNET | _CLONE_NEWIPC
                               | _CLONE_NEWUTS | (_CLONE_NEWPID if new_pids else 0)),
               "unshare")
        os.write(unshared_w, b"1")
        if os.read(mapped_r, 1) != b"1":
            os._exit(125)
        os.setresgid(0, 0, 0)
        os.setresuid(0, 0, 0)
        first = os.fork()  # the first process of the new PID namespace
        if first == 0:
            _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
            return
        os._exit(_wait(first))
    os.close(unshared_w)
    os.close(mapped_r)
    signal.signal(signal.SIGTERM, lambda *_: os.kill(child, signal.SIGKILL))
    signal.signal(signal.SIGINT, lambda *_: os.kill(child, signal.SIGKILL))
    ok = os.read(unshared_r, 1) == b"1"
    if ok:
        uids, gids, setgroups = _id_maps(uid, gid, root)
        try:
            Path(f"/proc/{child}/setgroups").write_text(setgroups)
            Path(f"/proc/{child}/uid_map").write_text(uids)
            Path(f"/proc/{child}/gid_map").write_text(gids)
        except OSError as err:
            print(f"sandbox: cannot map the sandbox's user: {err}", file=sys.stderr)
            ok = False
    os.write(mapped_w, b"1" if ok else b"0")
    os._exit(_wait(child))


def _wait(pid: int) -> int:
    """Wait for ``pid``; its exit code, or 128 + the signal that killed it (as a shell says)."""
    while True:
        try:
            _, status = os.waitpid(pid, 0)
        except ChildProcessError:
            return 125
        except InterruptedError:
            continue
        return os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else (
            128 + os.WTERMSIG(status))


# --- inside: the filesystem ----------------------------------------------------------------------


def _kept_flags(target: Path) -> int:
    """The flags of the mount at ``target`` that a user namespace may not drop on remount (its
    ``nodev``, ``noexec`` and atime flags), plus ``nosuid``."""
    stat = os.statvfs(target)
    flags = _MS_NOSUID
    for st, ms in ((os.ST_NODEV, _MS_NODEV), (os.ST_NOEXEC, _MS_NOEXEC),
                   (os.ST_NOATIME, _MS_NOATIME),
                   (os.ST_NODIRATIME, _MS_NODIRATIME), (os.ST_RELATIME, _MS_RELATIME)):
        if stat.f_flag & st:
            flags |= ms
    return flags


def _bind(source: Path, target: Path, *, writable: bool, device: bool = False) -> None:
    """``source`` at ``target`` (created), ``nosuid``, and read-only unless ``writable``;
    ``nodev`` unless it is a ``device``."""
    if source.is_dir():
        target.mkdir(parents=True, exist_ok=True)
    else:
        target.parent.mkdir(parents=True, exist_ok=True)
        target.touch()
    _mount(str(source), target, None, _MS_BIND | _MS_REC)
    flags = _kept_flags(target) | (0 if writable else _MS_RDONLY) | (0 if device else _MS_NODEV)
    _mount(None, target, None, _MS_REMOUNT | _MS_BIND | flags)


def _tmpfs(target: Path, size: int, mode: str = "1777") -> None:
    target.mkdir(parents=True, exist_ok=True)
    _mount("tmpfs", target, "tmpfs", _MS_NOSUID | _MS_NODEV, f"mode={mode},size={size}")


def _loopback_up() -> None:
    """Bring up the new network namespace's ``lo`` (it starts down)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        request = struct.pack("16sh", b"lo", 0)
        flags = struct.unpack("16sh", fcntl.ioctl(sock, _SIOCGIFFLAGS, request))[1]
        fcntl.ioctl(sock, _SIOCSIFFLAGS, struct.pack("16sh", b"lo", flags | _IFF_UP))


def _dev(dev: Path, tmpfs_size: int) -> None:
    """A ``/dev`` holding :data:`DEVICES`, the standard links and a ``/dev/shm``."""
    _tmpfs(dev, 1 * _MIB, mode="0755")
    for name in DEVICES:
        _bind(Path("/dev") / name, dev / name, writable=True, device=True)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"),
                         ("stdout", "/proc/self/fd/1"), ("stderr", "/proc/self/fd/2")):
        (dev / name).symlink_to(target)
    _tmpfs(dev / "shm", tmpfs_size)  # torch shares tensors between processes here


def build_root(new_root: Path, read: Sequence[Path], scratch: Path | None, home: Path,
               tmpfs_size: int, own_proc: bool = True) -> None:
    """Inside fresh namespaces: make ``new_root`` the root holding ``read`` (read-only),
    ``scratch`` (writable), four devices, a /proc and empty /tmp, /var/tmp, /dev/shm and
    ``home``. The /proc is a new one with a read-only /proc/sys where the sandbox has its own
    PID namespace (``own_proc``), else the caller's, bound read-only (a sandbox nested in
    another may not mount a proc of its own over one whose /proc/sys is covered)."""
    _mount(None, Path("/"), None, _MS_REC | _MS_PRIVATE)  # nothing propagates back out
    _tmpfs(new_root, 16 * _MIB, mode="0755")
    # The empty writable folders first: a read-only path may lie inside one (a pyenv Python
    # under $HOME), and is then bound on top of it.
    for path in (Path("/tmp"), Path("/var/tmp"), home):
        _tmpfs(new_root / path.relative_to("/"), tmpfs_size)
    for path in read:
        _bind(path, new_root / path.relative_to("/"), writable=False)
    _dev(new_root / "dev", tmpfs_size)
    if scratch is not None:
        _bind(scratch, new_root / scratch.relative_to("/"), writable=True)
    proc = new_root / "proc"
    proc.mkdir(exist_ok=True)
    if own_proc:
        _mount("proc", proc, "proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC)
        _bind(proc / "sys", proc / "sys", writable=False)
    else:
        _bind(Path("/proc"), proc, writable=False)
    old = new_root / _OLD_ROOT
    old.mkdir()
    number = _PIVOT_ROOT.get(os.uname().machine)
    if number is None:
        subprocess.run(["pivot_root", str(new_root), str(old)], check=True)
    else:
        _check(_libc().syscall(number, str(new_root).encode(), str(old).encode()), "pivot_root")
    os.chdir("/")
    _check(_libc().umount2(f"/{_OLD_ROOT}".encode(), _MNT_DETACH), "detach the old root")
    os.rmdir(f"/{_OLD_ROOT}")


def _hand_over(scratch: Path, uid: int, gid: int) -> None:
    """Make the scratch folder and what the grader put in it the sandbox user's (never
    following a link)."""
    for folder, dirs, files in os.walk(scratch):
        for name in [*dirs, *files]:
            os.chown(os.path.join(folder, name), uid, gid, follow_symlinks=False)
    os.chown(scratch, uid, gid)


# --- inside: giving up privileges ----------------------------------------------------------------


def _drop_privileges(root_outside: bool) -> None:
    """Leave the sandbox's code no way to a privilege: an empty capability bounding set,
    ``no_new_privs``, and either the unprivileged :data:`SANDBOX_UID` (the grader was root) or
    the namespace's root with no capability and root's special treatment locked off."""
    last = int(_CAP_LAST_CAP_FILE.read_text()) if _CAP_LAST_CAP_FILE.exists() else 40
    for cap in range(last + 1):
        _prctl(_PR_CAPBSET_DROP, cap)
    if root_outside:
        os.setgroups([SANDBOX_GID])
        os.setresgid(SANDBOX_GID, SANDBOX_GID, SANDBOX_GID)
        os.setresuid(SANDBOX_UID, SANDBOX_UID, SANDBOX_UID)  # clears every capability
    else:
        _prctl(_PR_SET_SECUREBITS, _SECBIT_ALL_LOCKED)
        header = (ctypes.c_uint32 * 2)(_CAP_VERSION_3, 0)
        data = (ctypes.c_uint32 * 6)()  # effective, permitted, inheritable x 2: all zero
        _check(_libc().capset(header, data), "capset")
    _prctl(_PR_SET_NO_NEW_PRIVS, 1)


def _set_limits(address_space: int, processes: int, file_size: int) -> None:
    for which, value in ((resource.RLIMIT_AS, address_space),
                         (resource.RLIMIT_NPROC, processes),
                         (resource.RLIMIT_FSIZE, file_size), (resource.RLIMIT_CORE, 0)):
        resource.setrlimit(which, (value, value))


def main(argv: Sequence[str] | None = None) -> int:
    """``python labs/grading/isolation.py [--scratch DIR] --read=PATH... -- COMMAND...``, as
    :func:`isolated` writes it."""
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
    parser.add_argument("--share-pids", action="store_true")
    parser.add_argument("--read", type=Path, action="append", default=[])
    defaults = Limits()
    parser.add_argument("--address-space", type=int, default=defaults.address_space)
    parser.add_argument("--processes", type=int, default=defaults.processes)
    parser.add_argument("--file-size", type=int, default=defaults.file_size)
    parser.add_argument("--tmpfs-size", type=int, default=defaults.tmpfs_size)
    options = parser.parse_args(args[:split])
    command = args[split + 1:]
    if not command:
        parser.error("no command after --")
    root_outside = privileged()
    _enter_namespaces(root_outside, new_pids=not options.share_pids)  # returns inside
    # The new root is built on a directory only this mount namespace sees: the tmpfs is
    # mounted over /mnt's view here, and /mnt itself is not touched outside.
    new_root = Path("/mnt") if Path("/mnt").is_dir() else Path(tempfile.mkdtemp(prefix=".root-"))
    build_root(new_root, options.read, options.scratch, options.home, options.tmpfs_size,
               own_proc=not options.share_pids)
    _loopback_up()
    if options.scratch is not None and root_outside:
        _hand_over(options.scratch, SANDBOX_UID, SANDBOX_GID)
    _set_limits(options.address_space, options.processes, options.file_size)
    _drop_privileges(root_outside)
    os.environ["HOME"] = str(options.home)
    os.environ["TMPDIR"] = "/tmp"
    os.chdir(options.scratch if options.scratch is not None else "/")
    os.execvp(command[0], command)
    return 127  # not reached


if __name__ == "__main__":
    sys.exit(main())
