"""NaiveDDP and DDP on an emulated link (``launch(..., link=Link(...))``): the same gradients as
without it, DDP's communication thread overlapping backward, and faults in that thread.

On a link both wrappers all-reduce with labs' ring (torch's collectives would bypass the
link), and DDP hands each full bucket to a :class:`labs.ddp.CommStream`, a background thread.
The timing test gives every message a modelled cost of at least 50 ms and asserts only wide
margins: under ``pytest -n 2`` on 2 cores a sleeping rank wakes a few milliseconds late.
"""

from __future__ import annotations

import dataclasses
import gc
import itertools
import threading
import time

import matplotlib.pyplot as plt
import pytest
import torch
from torch import nn

from labs import Link, RankError
from labs.ddp import DDP, CommStream, NaiveDDP
from labs.experiments.ddp import (
    Case,
    Measure,
    StepSettings,
    default_cases,
    measure_step_times,
    measure_timelines,
)
from labs.experiments.overlap import compare_to_model
from labs.viz import widgets
from labs.viz.ddp import plot_bucket_sweep, plot_step_times, step_time_table
from labs.wrappers import Wrapper

from parity import (
    DDP_CASES,
    OPTIMIZERS,
    assert_states_match,
    ddp_parity_worker,
    launch,
    reference_run,
)

pytestmark = pytest.mark.usefixtures("no_leftover_processes")

#: Fast enough for the parity tests, which are not timed.
QUICK = Link(alpha=1e-3, bandwidth=1e9)
@pytest.mark.parametrize("world_size", [2, 4])
def test_on_the_link_every_rank_matches_one_process_on_the_full_batch(world_size):
    on_link = launch(ddp_parity_worker, world_size, echo=False, link=QUICK)
    references = {name: reference_run(name) for name in OPTIMIZERS}
    for rank, per_rank in enumerate(on_link):
        assert len(per_rank) == len(OPTIMIZERS) * len(DDP_CASES)
        for key, states in per_rank.items():
            assert_states_match(states, references[key.split("-")[0]], f"{key} rank {rank}")
    if world_size == 2:  # a sum of two is one addition, whichever all-reduce makes it
        loopback = launch(ddp_parity_worker, world_size, echo=False)
        for key, states in on_link[0].items():
            for got, want in zip(states, loopback[0][key], strict=True):
                assert all(torch.equal(got[n], want[n]) for n in want), key


# --- overlap -----------------------------------------------------------------------------------


class _Sleep(torch.autograd.Function):
    """Identity forward; its backward sleeps: a layer whose backward computes for a known
    time without taking a core from the other tests."""

    @staticmethod
    def forward(ctx, x, seconds):  # noqa: ANN001, ANN205
        ctx.seconds = seconds
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        time.sleep(ctx.seconds)
        return grad, None


class SlowNet(nn.Module):
    """``layers`` bias-free Linear layers, each with a backward that takes ``seconds``."""

    def __init__(self, layers: int, width: int, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds
        self.layers = nn.ModuleList(nn.Linear(width, width, bias=False) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = _Sleep.apply(layer(x), self.seconds)
        return x


LAYERS, WIDTH, BACKWARD_S = 4, 64, 0.1
#: 50 ms of latency per message; a layer's 16 KiB of gradient is a ring all-reduce of two
#: messages of 8 KiB each at N = 2: 2 * (50 + 8) = 116 ms per layer.
SLOW = Link(alpha=50e-3, bandwidth=1e6)
PER_LAYER_S = 2 * SLOW.seconds(WIDTH * WIDTH * 4 // 2)


def overlap_worker(rank: int, world_size: int) -> dict[str, object]:
    """Backward, then synchronisation, timed under NaiveDDP and under DDP (one bucket per
    layer); the median of three steps each."""
    x = torch.randn(2, WIDTH, generator=torch.Generator().manual_seed(rank))
    out: dict[str, object] = {}
    for name in ("naive", "ddp"):
        net = SlowNet(LAYERS, WIDTH, BACKWARD_S)
        model = NaiveDDP(net) if name == "naive" else DDP(net, bucket_cap_mb=WIDTH**2 * 4 / 2**20)
        times, backward_end = [], 0.0
        for _ in range(3):
            model.timeline = timeline = type(model.timeline)()
            torch.distributed.barrier()
            start = time.monotonic()
            start_perf = time.perf_counter()
            model(x).sum().backward()
            backward_end = time.perf_counter() - start_perf
            model.finish_gradient_synchronization()
            times.append(time.monotonic() - start)
        out[name] = sorted(times)[1]
        if name == "ddp":
            out["buckets"] = len(model.buckets)
            out["first_done"] = timeline.resolved().done[0] - start_perf
            out["backward_end"] = backward_end
    return out


def test_ddp_on_the_link_sends_while_backward_computes():
    results = launch(overlap_worker, 2, echo=False, link=SLOW, timeout=120)
    compute, comm = LAYERS * BACKWARD_S, LAYERS * PER_LAYER_S
    for r in results:
        assert r["buckets"] == LAYERS
        # NaiveDDP: backward, then every all-reduce: compute + comm (0.4 s + 0.46 s)
        assert r["naive"] >= 0.95 * (compute + comm), r
        # DDP: the first bucket is summed before backward ends, and the step takes about
        # one layer's backward plus the communication (0.56 s), far less than the sum
        assert r["first_done"] < r["backward_end"], r
        assert r["ddp"] < 0.85 * (compute + comm), r
        assert r["ddp"] >= 0.95 * comm, r  # nothing beats the wire


# --- faults and threads ------------------------------------------------------------------------


def test_a_failing_job_surfaces_in_synchronize_and_the_jobs_after_it_are_skipped():
    stream = CommStream()
    ran: list[int] = []

    def fail() -> None:
        raise ValueError("the wire broke")

    stream.submit(lambda: ran.append(1))
    stream.submit(fail)
    skipped = stream.submit(lambda: ran.append(3))
    with pytest.raises(ValueError, match="the wire broke"):
        stream.synchronize()
    with pytest.raises(RuntimeError, match="skipped: an earlier job.*the wire broke"):
        skipped.result(timeout=5)
    assert ran == [1]
    assert stream.thread.daemon
    stream.synchronize()  # nothing pending any more


def test_the_thread_ends_with_its_stream():
    stream = CommStream()
    stream.submit(lambda: None)
    stream.synchronize()
    thread = stream.thread
    del stream
    gc.collect()
    thread.join(timeout=5)
    assert not thread.is_alive()


def broken_bucket_worker(rank: int, world_size: int) -> None:
    """Rank 1's first bucket lives on the meta device, which has no data to send: its
    all-reduce fails in the communication thread."""
    model = DDP(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)), bucket_cap_mb=1e-9)
    if rank == 1:
        model.buckets[0].buffer = model.buckets[0].buffer.to("meta")
    model(torch.ones(2, 8)).sum().backward()
    model.finish_gradient_synchronization()


def test_a_fault_in_the_communication_thread_is_a_rank_error_naming_the_rank():
    started = time.monotonic()
    with pytest.raises(RankError, match=r"rank 1 raised ValueError.*the meta device has none"):
        launch(broken_bucket_worker, 2, echo=False, link=QUICK, timeout=60)
    assert time.monotonic() - started < 30  # rank 0, left waiting for rank 1, was stopped


def threads_worker(rank: int, world_size: int) -> dict[str, object]:
    """Names of the live communication threads: while DDPs are alive, after they are gone.
    (A hooked parameter refers to its wrapper from C++, out of the garbage collector's
    sight, so a wrapper goes once its hooks are removed.)"""
    def comm_threads() -> list[str]:
        return [t.name for t in threading.enumerate() if t.name == "labs-comm-stream"]

    models = [DDP(nn.Linear(4, 4)) for _ in range(3)]
    for model in models:
        model(torch.ones(1, 4)).sum().backward()
        model.finish_gradient_synchronization()
    alive = comm_threads()
    daemons = all(t.daemon for t in threading.enumerate() if t.name == "labs-comm-stream")
    for model in models:
        model.remove_hooks()
    del models, model
    gc.collect()
    deadline = time.monotonic() + 5
    while comm_threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    return {"alive": alive, "daemons": daemons, "after": comm_threads()}


def test_each_ddp_has_one_daemon_thread_on_the_link_and_none_without_it():
    for r in launch(threads_worker, 2, echo=False, link=QUICK):
        assert r == {"alive": ["labs-comm-stream"] * 3, "daemons": True, "after": []}
    for r in launch(threads_worker, 2, echo=False):
        assert r == {"alive": [], "daemons": True, "after": []}


# --- the experiments on the link ---------------------------------------------------------------

SMALL = StepSettings(width=32, layers=3, batch=8, steps=2, warmup=1,
                     bucket_cap_mb=(32 * 32 + 32) * 4 / 2**20)  # one layer per bucket


def test_step_times_on_the_link_keep_every_sample_and_count_rounds_per_optimizer_step():
    settings = dataclasses.replace(SMALL, accumulation=3)
    cases = [Case(Wrapper.LOCAL, 25.0), Case(Wrapper.NAIVE, 25.0),
             Case(Wrapper.DDP, SMALL.bucket_cap_mb, no_sync=False),
             Case(Wrapper.DDP, SMALL.bucket_cap_mb),
             Case(Wrapper.DDP, SMALL.bucket_cap_mb, overlap=False)]
    rows = measure_step_times(2, settings, cases, launches=2, link=QUICK)
    assert [r.buckets for r in rows] == [0, 6, 3 * 3, 3, 3]
    for r in rows:
        assert len(r.samples) == len(r.of(Measure.BACKWARD)) == 2 * settings.steps
        assert r.low <= r.seconds == r.median() <= r.high
        first, third = r.quartiles(Measure.BACKWARD)
        assert min(r.backward) <= first <= third <= max(r.backward)
        assert all(b < s for b, s in zip(r.backward, r.samples, strict=True))
    assert rows[2].case.label == "DDP (4.125 KiB) without no_sync()"
    # every timed step's record, both ranks', for NaiveDDP and labs' DDP (the last micro-batch)
    assert rows[0].records == ()
    for r in rows[1:]:
        assert len(r.records) == 2 * settings.steps and all(len(s) == 2 for s in r.records)
        for rec in (rec for step in r.records for rec in step):
            assert len(rec.nbytes) == r.buckets // (3 if r is rows[2] else 1)
            assert rec.backward_start < rec.backward_end <= rec.synchronised
            assert all(s <= d <= rec.synchronised for s, d in zip(rec.started, rec.done,
                                                                  strict=True))
            # one thread, one bucket at a time, in order
            assert all(d <= s for d, s in zip(rec.done, rec.started[1:], strict=False))
            if r.case.wrapper is Wrapper.DDP:  # each bucket's last gradient, in backward
                assert all(rec.backward_start < t <= rec.backward_end for t in rec.ready)
            if r is rows[4]:  # the control sends nothing before backward has returned
                assert all(s >= rec.backward_end for s in rec.started)
    models = compare_to_model(rows, QUICK)
    assert [m.row.case for m in models] == cases[1:]
    assert [m.after_backward for m in models] == [True, False, False, True]
    table = step_time_table(rows, Measure.BACKWARD)
    assert "backward() to averaged gradients" in table and "torch" not in table
    for fig in (plot_bucket_sweep(rows, measure=Measure.BACKWARD), plot_step_times(rows)):
        plt.close(fig)


def test_torch_ddp_is_refused_on_the_link_before_any_process_starts(refuse_processes):
    with refuse_processes(), pytest.raises(ValueError, match="link does not carry"):
        measure_step_times(2, SMALL, default_cases(1.0), link=QUICK)


def test_the_timeline_on_the_link_names_naive_ddps_parameters_and_ddps_buckets():
    timelines = measure_timelines(2, SMALL, link=QUICK)
    for t in timelines[Wrapper.NAIVE]:
        assert {s.label for s in t.allreduces} == set(t.grad_ready)
        assert all(s.start >= t.backward_end for s in t.allreduces)
    for t in timelines[Wrapper.DDP]:
        assert [s.label for s in t.allreduces] == ["bucket 0", "bucket 1", "bucket 2"]
        assert all(s.start <= s.end <= t.synchronised for s in t.allreduces)
        # the thread sends one bucket at a time, in order
        assert all(a.end <= b.start for a, b in itertools.pairwise(t.allreduces))


def test_the_ddp_panel_offers_the_link_only_when_given_one(monkeypatch):
    import ipywidgets as w

    from labs.viz import recorded

    shown, runs = [], []
    monkeypatch.setattr(recorded, "display", lambda obj, **_: shown.append(obj))
    monkeypatch.setattr(widgets.ddp, "show_ddp_run", lambda *args: runs.append(args))
    widgets.ddp_panel(world_size=2, settings=SMALL, link=QUICK, world_sizes=(2,),
                      caps=(0.25, 25.0))
    assert len(runs) == 2 and all(r[2:] in ((), (None,)) for r in runs)  # loopback grid
    (panel,) = [s for s in shown if isinstance(s, w.VBox)]
    _micro, box, button = panel.children[-2].children
    assert box.layout.display == "flex"
    box.value = True
    button.click()
    assert runs[-1][2] == QUICK
    shown.clear()
    widgets.ddp_panel(world_size=2, settings=SMALL, world_sizes=(2,), caps=(0.25,))
    (panel,) = [s for s in shown if isinstance(s, w.VBox)]
    assert panel.children[-2].children[1].layout.display == "none"
