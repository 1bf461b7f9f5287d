"""A measured timeline as a Chrome trace: the JSON that Perfetto (ui.perfetto.dev) and
chrome://tracing open, as they open a trace from ``torch.profiler``.

:func:`ddp_trace` turns chapter 5's timelines of one backward pass
(:class:`labs.experiments.ddp.BackwardTimeline`, one per rank and wrapper) into the trace event
format: one process per wrapper and rank, a track for backward's computation and one for the
all-reduces, an instant for each gradient that became ready. :func:`download_link` shows the
JSON as a link that saves it, in JupyterLab and in the book alike (the data is in the link).
"""

from __future__ import annotations

import base64
import html
import json
from collections.abc import Mapping, Sequence
from typing import Any

from IPython.display import HTML

from labs.experiments.ddp import BackwardTimeline
from labs.wrappers import Wrapper

_US = 1e6  # the format counts microseconds
COMPUTE, COMMUNICATION = 1, 2  # the two tracks (thread ids) of every process


def ddp_trace(timelines: Mapping[Wrapper, Sequence[BackwardTimeline]]) -> dict[str, Any]:
    """The trace of one backward pass per wrapper and rank; time 0 is each rank's start of
    ``loss.backward()``."""
    events: list[dict[str, Any]] = []
    for w, (wrapper, per_rank) in enumerate(timelines.items()):
        for rank, t in enumerate(per_rank):
            pid = 100 * w + rank
            events += [_meta("process_name", pid, None, f"{wrapper.value}, rank {rank}"),
                       _meta("process_sort_index", pid, None, pid),
                       _meta("thread_name", pid, COMPUTE, "backward"),
                       _meta("thread_name", pid, COMMUNICATION, "all-reduce")]
            events.append(_span("backward", "compute", pid, COMPUTE, 0.0, t.backward_end))
            events += [{"name": f"{name} ready", "cat": "gradient", "ph": "i", "s": "t",
                        "pid": pid, "tid": COMPUTE, "ts": at * _US}
                       for name, at in sorted(t.grad_ready.items(), key=lambda kv: kv[1])]
            events += [_span(s.label, "communication", pid, COMMUNICATION, s.start, s.end)
                       for s in t.allreduces]
            events.append({"name": "gradients averaged", "cat": "sync", "ph": "i", "s": "p",
                           "pid": pid, "tid": COMMUNICATION, "ts": t.synchronised * _US})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def _span(name: str, cat: str, pid: int, tid: int, start: float, end: float) -> dict[str, Any]:
    return {"name": name, "cat": cat, "ph": "X", "pid": pid, "tid": tid, "ts": start * _US,
            "dur": max(end - start, 0.0) * _US}


def _meta(kind: str, pid: int, tid: int | None, value: object) -> dict[str, Any]:
    key = "sort_index" if kind.endswith("sort_index") else "name"
    event: dict[str, Any] = {"name": kind, "ph": "M", "pid": pid, "args": {key: value}}
    if tid is not None:
        event["tid"] = tid
    return event


def download_link(trace: Mapping[str, Any], filename: str, text: str) -> HTML:
    """A link that saves ``trace`` as ``filename`` (the JSON travels inside the link, so the
    page needs no file beside it)."""
    data = base64.b64encode(json.dumps(trace, separators=(",", ":")).encode()).decode()
    return HTML(f'<a download="{html.escape(filename)}" '
                f'href="data:application/json;base64,{data}">{html.escape(text)}</a>')
