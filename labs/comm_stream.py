"""The communication stream of labs' wrappers on an emulated link: one background thread that
runs collectives in the order they are handed over, as a CUDA stream runs NCCL's beside the
stream that computes. :class:`labs.ddp.DDP` sends its buckets on one, :class:`labs.fsdp.FSDP`
its all-gathers and reduce-scatters."""

from __future__ import annotations

import queue
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future


class CommStream:
    """One background thread that runs the jobs handed to it one at a time, in the order they
    were handed over: labs' stand-in for the CUDA stream on which torch's DDP (through NCCL)
    runs its all-reduces beside the stream that computes backward.

    :class:`DDP` uses it on an emulated link, where an all-reduce is labs' ring, plain Python
    that would block the thread calling it. The main thread goes on with backward while this
    one sends; the link's waits are sleeps and torch's kernels release the GIL, so the two
    overlap even on one core per rank. One thread keeps the order: every rank hands its
    buckets over in the same order, so every rank's thread makes the same calls in the same
    order, as a stream would.

    The rule that goes with it: while jobs are pending, the main thread makes no collective
    of its own (two threads calling one process group at once could interleave their
    messages); :meth:`synchronize` first. A job that raises fails its future, and every job
    after it is skipped; :meth:`synchronize` re-raises the first failure in the caller. The
    thread is a daemon, so it never keeps a rank process alive, and it ends once its stream
    is garbage-collected (a :class:`DDP` is, once :meth:`DDP.remove_hooks` has run: until
    then its parameters' hooks refer to it).
    """

    def __init__(self, name: str = "labs-comm-stream") -> None:
        self._jobs: queue.SimpleQueue[tuple[Callable[[], None], Future[None]] | None] = (
            queue.SimpleQueue())
        self._pending: list[Future[None]] = []
        self.thread = threading.Thread(target=_serve, args=(self._jobs,), name=name,
                                       daemon=True)
        self.thread.start()
        # The thread holds only the queue, never the stream: once the stream is collected,
        # the sentinel ends the thread.
        weakref.finalize(self, self._jobs.put, None)

    def submit(self, job: Callable[[], None]) -> Future[None]:
        """Queue ``job`` behind the jobs already handed over; returns at once."""
        future: Future[None] = Future()
        self._pending.append(future)
        self._jobs.put((job, future))
        return future

    def synchronize(self) -> None:
        """Wait for every job handed over so far; re-raise the first failure here."""
        pending, self._pending = self._pending, []
        for future in pending:
            future.result()


def _serve(jobs: queue.SimpleQueue[tuple[Callable[[], None], Future[None]] | None]) -> None:
    """The body of a :class:`CommStream`'s thread: run jobs in order until the sentinel."""
    failed: str | None = None  # the first failure, as text (its traceback holds frames)
    while (item := jobs.get()) is not None:
        job, future = item
        del item  # while waiting for the next job, hold nothing the last one referred to
        if failed is not None:
            future.set_exception(RuntimeError(
                f"skipped: an earlier job on this stream failed ({failed})"))
        else:
            try:
                job()
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
                failed = repr(exc)
                future.set_exception(exc)
            else:
                future.set_result(None)
        del job, future
