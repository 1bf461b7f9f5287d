"""labs.experiments.timing, labs.experiments.sweep and labs.bench.collectives: the collectives
timing worker on real ranks, its correctness verdict, and the ``python -m labs.bench
collectives`` command line (flags refused before any process starts, tiny sweeps that write
CSV, JSON and a PNG)."""

from __future__ import annotations

import csv
import json
import math
import os
import statistics
import subprocess
import sys

import pytest
import torch
from hypothesis import given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st

from labs import Backend, bench
from labs import __main__ as labs_cli
from labs.bench.collectives import DEFAULT_OUT
from labs.collectives import (
    DEFAULT_SEGMENT_BYTES,
    DEFAULT_WINDOW,
    Algorithm,
    Collective,
    shard_bounds,
)
from labs.experiments import sweep, timing
from labs.experiments.sweep import SweepSettings, read_timings
from labs.experiments.timing import (
    CollectiveCase,
    CollectiveTiming,
    Statistic,
    calls_per_case,
    format_size,
    measure_collectives,
    parse_size,
    results_match,
    seeded_input,
    timing_from_record,
)

pytestmark = pytest.mark.usefixtures("no_leftover_processes")

EVERY_PAIR = [(c, a) for c in Collective for a in c.algorithms()]


# --- the worker on real ranks ---------------------------------------------------------------------


@pytest.mark.parametrize("world_size", [2, 3])
def test_every_algorithm_is_correct_on_real_ranks(world_size):
    # 4 B: one element, so some ranks' chunks are empty; 28 B: 7 elements, uneven chunks.
    cases = [CollectiveCase(c, a, size) for size in (4, 28, 1024) for c, a in EVERY_PAIR]
    cases.append(CollectiveCase(Collective.ALL_REDUCE, Algorithm.RING, 1024, torch.float32,
                                segment_bytes=None))
    cases.append(CollectiveCase(Collective.ALL_REDUCE, Algorithm.RING, 4096, torch.float32,
                                segment_bytes=64, window=2))
    timings = measure_collectives(cases, world_size, iters=2, warmup=1, backend="gloo")
    assert [t.case for t in timings] == cases  # same order as asked
    wrong = [(t.case.collective.value, t.case.label, t.case.size_bytes) for t in timings
             if not t.correct]
    assert not wrong, f"incorrect results: {wrong}"
    for t in timings:
        assert t.world_size == world_size and t.backend == "gloo"
        assert len(t.all_seconds) == 2 and all(s > 0 for s in t.all_seconds)
        assert t.seconds == pytest.approx(sum(t.all_seconds) / 2)  # the median of two
        assert t.algbw_gbps == pytest.approx(t.case.size_bytes / t.seconds / 1e9)
        factor = (2 if t.case.collective is Collective.ALL_REDUCE else 1) * (world_size - 1)
        assert t.busbw_gbps == pytest.approx(t.algbw_gbps * factor / world_size)


def test_bfloat16_sums_are_exact_and_checked():
    cases = [CollectiveCase(c, a, 256, torch.bfloat16) for c, a in EVERY_PAIR
             if a in (Algorithm.RING, Algorithm.TORCH)]
    timings = measure_collectives(cases, 2, iters=1, warmup=0, backend="gloo")
    assert all(t.correct for t in timings)


# --- the correctness verdict can say no -----------------------------------------------------------


def test_results_match_rejects_wrong_values_shapes_and_dtypes():
    expected = torch.tensor([1.0, -2.0, 3.0])
    assert results_match(expected.clone(), expected)
    off_by_one = expected.clone()
    off_by_one[1] += 1
    assert not results_match(off_by_one, expected)
    assert not results_match(expected[:2], expected)
    assert not results_match(expected.double(), expected)
    assert not results_match(expected.reshape(3, 1), expected)


def test_the_oracle_catches_typical_wrong_collectives():
    """The expected results the worker compares with are exact sums of every rank's seeded
    input, and typical mistakes (a rank's contribution missing, the wrong chunk, an average
    instead of a sum) give a different tensor."""
    world_size, numel = 3, 10
    case = CollectiveCase(Collective.ALL_REDUCE, Algorithm.RING, numel * 4)
    inputs = timing._Inputs.build([case], 0, world_size, torch.device("cpu"))
    contributions = [seeded_input(numel, r, torch.float32) for r in range(world_size)]
    total = contributions[0] + contributions[1] + contributions[2]
    assert results_match(total, timing._expected(case, inputs, 0))
    assert not results_match(contributions[0] + contributions[1], timing._expected(case, inputs, 0))
    assert not results_match(total / world_size, timing._expected(case, inputs, 0))
    assert torch.all(contributions[0] == contributions[0].round())  # integers: exact sums
    scatter = CollectiveCase(Collective.REDUCE_SCATTER, Algorithm.RING, numel * 4)
    inputs = timing._Inputs.build([scatter], 1, world_size, torch.device("cpu"))
    bounds = shard_bounds(numel, world_size)
    assert results_match(total[bounds[1]:bounds[2]], timing._expected(scatter, inputs, 1))
    assert not results_match(total[bounds[0]:bounds[1]], timing._expected(scatter, inputs, 1))


# --- cases, settings and records ------------------------------------------------------------------


@pytest.mark.parametrize(("text", "size"), [("1K", 1024), ("64K", 65536), ("16M", 1 << 24),
                                            ("1G", 1 << 30), ("4096", 4096), ("8B", 8),
                                            ("1.5K", 1536), ("2MiB", 2 << 20)])
def test_parse_size(text, size):
    assert parse_size(text) == size
    assert parse_size(format_size(size)) == size


@pytest.mark.parametrize("text", ["0", "-1K", "abc", "1.3", "12Q", "", "nan", "K"])
def test_parse_size_refuses(text):
    with pytest.raises(ValueError, match="size"):
        parse_size(text)


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"collective": Collective.ALL_GATHER, "algorithm": Algorithm.NAIVE}, "not one of them"),
    ({"size_bytes": 6}, "multiple of 4"),
    ({"size_bytes": 0}, "multiple of 4"),
    ({"dtype": torch.int32}, "dtype"),
    ({"algorithm": Algorithm.TORCH, "segment_bytes": 4096}, "only|defaults"),
    ({"segment_bytes": 2}, "segment_bytes"),
    ({"window": 0}, "window"),
    ({"collective": "all-reduce"}, "Collective"),
])
def test_collective_case_refuses_bad_settings(kwargs, match):
    settings = {"collective": Collective.ALL_REDUCE, "algorithm": Algorithm.RING,
                "size_bytes": 1024, **kwargs}
    with pytest.raises((ValueError, TypeError), match=match):
        CollectiveCase(**settings)


def test_sweep_cases_follow_the_algorithms_each_collective_supports():
    settings = SweepSettings(sizes=(1024,), algorithms=(Algorithm.RING, Algorithm.NAIVE))
    pairs = [(c.collective, c.algorithm) for c in settings.cases()]
    assert pairs == [(Collective.ALL_REDUCE, Algorithm.RING), (Collective.ALL_REDUCE,
                     Algorithm.NAIVE), (Collective.REDUCE_SCATTER, Algorithm.RING),
                     (Collective.ALL_GATHER, Algorithm.RING)]
    everything = SweepSettings(sizes=(1024, 4096))
    assert len(everything.cases()) == 2 * sum(len(c.algorithms()) for c in Collective)
    segments = SweepSettings(collectives=(Collective.ALL_REDUCE,), sizes=(4096,),
                             algorithms=(Algorithm.RING,), segment_bytes=(None, 1024))
    assert [c.label for c in segments.cases()] == ["ring (lock-step)",
                                                   f"ring (segment 1K, window {DEFAULT_WINDOW})"]
    # the double binary tree posts its receives up front: gloo runs it, NCCL would hang
    on = {backend: [c.algorithm for c in everything.cases_on(backend)] for backend in Backend}
    assert Algorithm.DOUBLE_TREE in on[Backend.GLOO]
    assert Algorithm.DOUBLE_TREE not in on[Backend.NCCL]
    assert len(on[Backend.NCCL]) == len(on[Backend.GLOO]) - 2  # one per size


def test_records_round_trip():
    case = CollectiveCase(Collective.REDUCE_SCATTER, Algorithm.RING, 4096, torch.float64,
                          segment_bytes=None)
    timing = CollectiveTiming(case, 4, "gloo", 2e-3, (1e-3, 2e-3, 5e-3), False)
    record = json.loads(json.dumps(timing.as_record()))
    assert timing_from_record(record) == timing
    as_csv = {k: str(v) for k, v in record.items()}
    as_csv["all_seconds"] = "0.001 0.002 0.005"
    assert timing_from_record(as_csv) == timing
    assert timing.summary(Statistic.MIN) == 1e-3 and timing.summary(Statistic.MEDIAN) == 2e-3


# --- the command line -----------------------------------------------------------------------------


@pytest.fixture
def no_launch(monkeypatch):
    """Any launch of a sweep fails the test: bad flags must be refused before."""
    def refuse(*args, **kwargs):
        raise AssertionError("a launch started although the flags were bad")
    monkeypatch.setattr(timing, "launch", refuse)


@pytest.mark.parametrize(("flags", "message"), [
    (["--sizes", "3Q"], "--sizes"),
    (["--sizes", "6"], "--sizes"),
    (["--world-sizes", "1"], "--world-sizes"),
    (["--world-sizes", "2", "99"], "--world-sizes"),
    (["--iters", "0"], "--iters"),
    (["--warmup", "-1"], "--warmup"),
    (["--collectives", "broadcast"], "--collectives"),
    (["--collectives", "all-gather", "--algorithms", "naive"], "--algorithms"),
    (["--collectives", "all-gather", "--algorithms", "ring", "naive"], "--algorithms"),
    (["--algorithms", "fastest"], "--algorithms"),
    (["--backends", "mpi"], "--backends"),
    (["--dtype", "int8"], "--dtype"),
    (["--segment-bytes", "2"], "--segment-bytes"),
    (["--window", "0"], "--window"),
    (["--threads", "0"], "--threads"),
    (["--min-bytes", "-1"], "--min-bytes"),
    (["--min-bytes", "3Q"], "--min-bytes"),
    (["--out", "results.txt"], "--out"),
    (["--plot", "figure.svg"], "--plot"),
    (["--timeout", "0"], "--timeout"),
])
def test_cli_refuses_bad_flags_before_launching(no_launch, capsys, flags, message):
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["collectives", *flags])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err, err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without CUDA")
def test_cli_skips_nccl_without_cuda(no_launch, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["collectives", "--backends", "nccl"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "skipping nccl" in err and "--backends gloo" in err


@pytest.mark.slow  # make test's budget (7 s)
def test_cli_tiny_sweep_writes_csv_json_and_png(tmp_path, capsys, monkeypatch):
    out = tmp_path / "sweep.csv"
    bench.main(["collectives", "--sizes", "1K", "4K", "--world-sizes", "2", "--iters", "2",
                "--out", str(out)])
    printed = capsys.readouterr().out
    assert "world size 2" in printed and "busbw / torch" in printed
    assert "ring busbw / torch busbw" in printed  # the summary table
    with out.open(newline="") as handle:
        rows = list(csv.DictReader(handle))
    expected = 2 * sum(len(c.algorithms()) for c in Collective)
    assert len(rows) == expected
    assert {r["correct"] for r in rows} == {"True"}
    assert all(float(r["seconds"]) > 0 and float(r["busbw_gbps"]) > 0 for r in rows)
    assert len(read_timings(out)) == expected
    png = out.with_suffix(".png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    out_json, plot = tmp_path / "sweep.json", tmp_path / "figs" / "busbw.png"
    real_launch, threads = timing.launch, []

    def launch_and_note_threads(*args, **kwargs):
        threads.append(kwargs["threads"])
        return real_launch(*args, **kwargs)

    monkeypatch.setattr(timing, "launch", launch_and_note_threads)
    bench.main(["collectives", "--collectives", "all-reduce", "--algorithms", "ring", "torch",
                "--sizes", "1K", "--world-sizes", "2", "--iters", "2", "--segment-bytes",
                "none", "256", "--out", str(out_json), "--plot", str(plot), "--threads", "2"])
    assert threads == [2]  # the ranks were launched with the threads asked for
    document = json.loads(out_json.read_text())
    assert document["settings"]["threads"] == 2
    labels = [r["label"] for r in document["timings"]]
    assert labels == ["ring (lock-step)", f"ring (segment 256B, window {DEFAULT_WINDOW})",
                      "torch"]
    assert document["settings"]["segment_bytes"] == [None, 256]
    assert document["machine"]["cores"] >= 1
    assert all(math.isfinite(t.seconds) for t in read_timings(out_json))
    assert plot.read_bytes()[:4] == b"\x89PNG"


def test_lab_collectives_times_and_checks_on_local_ranks(capsys):
    """`python -m labs collectives`: the same cases and table, on ranks it launches itself."""
    labs_cli.main(["collectives", "--world-size", "2", "--collectives", "all-gather",
                   "--sizes", "4K", "--iters", "1"])
    printed = capsys.readouterr().out
    rows = [line.split() for line in printed.splitlines()
            if line.startswith("all-gather") and line.split()[-2] in ("True", "False")]
    assert [(r[1], r[-2]) for r in rows] == [("ring", "True"), ("torch", "True")], printed


@pytest.mark.parametrize(("flags", "message"), [
    (["--world-size", "1"], "at least 2 ranks"),
    (["--sizes", "6"], "--sizes"),
    (["--collectives", "all-gather", "--algorithms", "naive"], "--algorithms"),
])
def test_lab_collectives_refuses_bad_flags_before_launching(monkeypatch, capsys, flags,
                                                             message):
    def refuse(*args, **kwargs):
        raise AssertionError("a launch started although the flags were bad")
    monkeypatch.setattr(labs_cli, "launch", refuse)
    with pytest.raises(SystemExit) as exit_info:
        labs_cli.main(["collectives", *flags])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.slow  # make test runs labs under torchrun in test_toy_allreduce (one node and two)
def test_lab_collectives_runs_under_torchrun():
    """torchrun's env:// rendezvous (--standalone), two processes: rank 0 prints one table."""
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    out = subprocess.run(
        [torchrun, "--standalone", "--nproc_per_node=2", "-m", "labs", "collectives",
         "--collectives", "all-reduce", "--algorithms", "ring", "torch", "--sizes", "64K",
         "--iters", "2", "--backend", "gloo"],
        capture_output=True, text=True, timeout=180,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("gloo, world size 2") == 1, out.stdout
    rows = [line.split() for line in out.stdout.splitlines()
            if line.startswith("all-reduce") and line.split()[-2] in ("True", "False")]
    assert [(r[1], r[-2]) for r in rows] == [("ring", "True"), ("torch", "True")], out.stdout


def test_cli_default_output_path():
    assert DEFAULT_OUT.suffix == ".csv" and DEFAULT_SEGMENT_BYTES > 0


@pytest.mark.parametrize("field", ["launches", "threads"])
def test_launches_and_threads_must_be_positive_ints(field) -> None:
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match=f"--{field}"):
            sweep.SweepSettings(**{field: bad})


@pytest.mark.parametrize(("size", "iters", "min_bytes", "calls"), [
    (1 << 20, 5, 64 << 20, 64),   # 64 calls of 1 MiB carry 64 MiB
    (3 << 20, 5, 64 << 20, 22),   # rounded up: 21 calls would carry 63 MiB
    (16 << 20, 5, 64 << 20, 5),   # 4 would do; iters is the floor
    (1 << 10, 5, 64 << 20, timing.MAX_CALLS),  # 65536 wanted, capped
    (1 << 10, 500, 64 << 20, 500),  # iters above the cap is still iters
    (1 << 20, 5, 0, 5),           # off
])
def test_calls_per_case_carries_min_bytes_between_iters_and_the_cap(size, iters, min_bytes,
                                                                    calls):
    assert calls_per_case(size, iters, min_bytes) == calls


@pytest.mark.parametrize("bad", [-1, 1.5, True, "64M"])
def test_min_bytes_is_refused_before_any_rank_starts(no_launch, bad):
    case = CollectiveCase(Collective.ALL_REDUCE, Algorithm.TORCH, 1 << 10)
    with pytest.raises(ValueError, match="min_bytes"):
        measure_collectives([case], 2, min_bytes=bad)
    with pytest.raises(ValueError, match="--min-bytes"):
        SweepSettings(min_bytes=bad)


def test_small_sizes_get_more_calls_in_every_launch_and_the_table_says_so():
    """Real ranks, two launches, min_bytes 256 KiB and iters 2: 4 KiB gets 64 calls per
    launch and 64 KiB gets 4; the pooled timings keep both launches' calls."""
    settings = SweepSettings(collectives=(Collective.ALL_REDUCE,),
                             algorithms=(Algorithm.RING, Algorithm.TORCH),
                             sizes=(4 << 10, 64 << 10), world_sizes=(2,), iters=2,
                             min_bytes=256 << 10, launches=2)
    timings = sweep.run_sweep(settings)
    calls = {(t.case.algorithm, t.case.size_bytes): len(t.all_seconds) for t in timings}
    assert calls == {(Algorithm.RING, 4 << 10): 128, (Algorithm.TORCH, 4 << 10): 128,
                     (Algorithm.RING, 64 << 10): 8, (Algorithm.TORCH, 64 << 10): 8}
    assert all(t.correct and len(t.launch_medians()) == 2 for t in timings)
    assert "median of 8 to 128 iterations, the most at the smallest size" in (
        sweep.sweep_tables(timings))


def test_pooled_launches_keep_every_iteration_and_any_wrong_result() -> None:
    case = CollectiveCase(Collective.ALL_REDUCE, Algorithm.RING, 1 << 10)
    first = CollectiveTiming(case, 2, "gloo", 2.0, (1.0, 2.0, 3.0), True)
    second = CollectiveTiming(case, 2, "gloo", 20.0, (10.0, 20.0, 30.0), False)
    pooled = sweep._pool([first, second])
    assert pooled.all_seconds == (1.0, 2.0, 3.0, 10.0, 20.0, 30.0)
    assert pooled.seconds == 6.5  # the median of all six, not of the two medians
    assert not pooled.correct
    assert sweep._pool([first, first]).correct
    assert pooled.launches == 2 and pooled.launch_medians() == [2.0, 20.0]


def _pooled(algorithm: Algorithm, per_launch: list[tuple[float, ...]]) -> CollectiveTiming:
    case = CollectiveCase(Collective.ALL_REDUCE, algorithm, 1 << 20)
    runs = [CollectiveTiming(case, 2, "gloo", statistics.median(t), t, True) for t in per_launch]
    return sweep._pool(runs)


def test_ratio_table_shows_each_launch_range() -> None:
    """One launch had the ring twice as fast as torch, the other half as fast: the table must
    show that spread beside the pooled ratio, the median of the six per-call ratios
    (2, 2, 2, 0.5, 0.5, 0.5: 1.25)."""
    ring = _pooled(Algorithm.RING, [(1.0, 1.0, 1.0), (4.0, 4.0, 4.0)])
    torch_ = _pooled(Algorithm.TORCH, [(2.0, 2.0, 2.0), (2.0, 2.0, 2.0)])
    assert sweep.call_ratios(ring, torch_) == [2.0, 2.0, 2.0, 0.5, 0.5, 0.5]
    assert sweep.launch_ratios(ring, [ring, torch_]) == [2.0, 0.5]
    table = sweep.ring_vs_torch_table([ring, torch_])
    assert "1.25 (0.50-2.00)" in table.splitlines()[-1]
    assert "lowest and highest" in sweep.sweep_tables([ring, torch_])
    # one launch: a plain ratio, no bracket
    single = [CollectiveTiming(ring.case, 2, "gloo", 1.0, (1.0,), True),
              CollectiveTiming(torch_.case, 2, "gloo", 2.0, (2.0,), True)]
    assert sweep.launch_ratios(single[0], single) is None
    assert sweep.ring_vs_torch_table(single).splitlines()[-1].split()[-1] == "2.00"
    # the launch count survives a CSV round trip
    assert timing_from_record(ring.as_record()).launches == 2


def test_ratio_pairs_each_call_with_the_torch_call_beside_it() -> None:
    """Calls 4 and 5 were slow for both algorithms (the machine was busy), call 3 for the ring
    alone. Beside its torch call the ring was 1.25x as fast in four calls of five, and the
    paired ratio says 1.25; the ratio of the two medians (5 / 8) would say 0.625."""
    ring = _pooled(Algorithm.RING, [(4.0, 4.0, 8.0, 8.0, 8.0)])
    torch_ = _pooled(Algorithm.TORCH, [(5.0, 5.0, 5.0, 10.0, 10.0)])
    assert sweep.call_ratios(ring, torch_) == [1.25, 1.25, 0.625, 1.25, 1.25]
    assert sweep.ratio_to_torch(ring, [ring, torch_]) == 1.25
    assert torch_.seconds / ring.seconds == 0.625
    # timings that did not run side by side (different numbers of calls): ratio of medians
    lone = _pooled(Algorithm.TORCH, [(2.0, 2.0, 2.0)])
    assert sweep.call_ratios(ring, lone) is None
    assert sweep.ratio_to_torch(ring, [ring, lone]) == 0.25
    assert sweep.launch_ratios(ring, [ring, lone]) is None


def test_a_rows_ratio_is_the_ratio_of_the_medians_it_shows() -> None:
    """The same calls as above: the row's time column shows the medians 8 and 5, so its
    "busbw / torch" must say 0.62 (5 / 8), not the paired 1.25, which the reader cannot
    derive from the row (chapter 4's panel showed 1285.6 us against torch's 1395.9 us beside
    a ratio of 0.65)."""
    ring = _pooled(Algorithm.RING, [(4.0, 4.0, 8.0, 8.0, 8.0)])
    torch_ = _pooled(Algorithm.TORCH, [(5.0, 5.0, 5.0, 10.0, 10.0)])
    assert sweep.median_ratio_to_torch(ring, [ring, torch_]) == 0.625
    assert sweep.median_ratio_to_torch(torch_, [ring, torch_]) is None
    assert sweep.median_ratio_to_torch(ring, [ring]) is None
    rows = {line.split()[1]: line.split() for line in sweep.sweep_tables([ring, torch_])
            .splitlines() if line.startswith("all-reduce ")}
    assert float(rows["ring"][3]) / float(rows["torch"][3]) == 8.0 / 5.0
    assert rows["ring"][-1] == "0.62" and rows["torch"][-1] == "-"


@pytest.mark.parametrize(("seconds", "shown"), [(15595.2e-6, "15600"), (708.14e-6, "708.1"),
                                                (487.0e-6, "487"), (2.0e-6, "2")])
def test_a_time_is_shown_to_four_significant_digits(seconds: float, shown: str) -> None:
    assert sweep._four_digits(seconds * 1e6) == shown


@given(launches=st.integers(2, 4), calls=st.integers(1, 6), data=st.data())
@hypothesis_settings(max_examples=300, deadline=None)
def test_pooled_ratio_lies_within_the_launch_range(launches: int, calls: int,
                                                   data: st.DataObject) -> None:
    """The table's first number can never fall outside its own brackets."""
    times = st.floats(0.5, 20.0, allow_nan=False)
    per_launch = [[tuple(data.draw(st.lists(times, min_size=calls, max_size=calls)))
                   for _ in range(launches)] for _ in range(2)]
    ring, torch_ = _pooled(Algorithm.RING, per_launch[0]), _pooled(Algorithm.TORCH, per_launch[1])
    spread = sweep.launch_ratios(ring, [ring, torch_])
    pooled = sweep.ratio_to_torch(ring, [ring, torch_])
    assert spread is not None and pooled is not None
    assert min(spread) - 1e-12 <= pooled <= max(spread) + 1e-12, (pooled, spread)


@pytest.mark.slow  # make test runs a bench's CLI in test_cli_tiny_sweep_writes_csv_json_and_png
def test_cli_ddp_and_fsdp_benchmarks_print_their_tables(capsys):
    """`python -m labs.bench ddp` and `fsdp` on a tiny model: real ranks, every row printed."""
    bench.main(["ddp", "--world-size", "2", "--width", "32", "--layers", "2", "--batch", "4",
                "--steps", "2", "--launches", "1"])
    out = capsys.readouterr().out
    for row in ("NaiveDDP", "DDP (25 MiB)", "torch DDP (25 MiB)", "1.00x"):
        assert row in out, out
    bench.main(["fsdp", "--width", "32", "--layers", "2", "--memory-world-size", "2",
                "--batches", "4", "--steps", "2"])
    out = capsys.readouterr().out
    assert "FSDP / DDP: " in out and "with communication buffers too" in out, out
    assert out.count("x\n") >= 1 and "FSDP (ZeRO-3)" in out, out
    assert "of the bytes (target <= 1/3)" in out and "bf16 compute, fp32 reduce" in out, out
    assert "prefetch 1 vs 0 (reshard on)" in out and "model / measured" in out, out


@pytest.mark.slow  # chapter 9 runs each of these measurements; here the command line prints them
def test_bench_faults_prints_the_cost_the_deaths_and_the_stragglers(capsys):
    bench.main(["faults", "--repeats", "5", "--group-timeout", "1", "--straggler-sizes", "2"])
    out = capsys.readouterr().out
    for title in ("What watching collectives costs", "A rank killed or stopped",
                  "Stragglers: an exponential delay"):
        assert title in out, out
    assert out.count("RankDied") == 2 and out.count("PeerLost") == 2  # killed x2, stopped x2
    assert "check_collectives adds" in out and "H_N" in out
