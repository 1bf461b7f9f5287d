"""Widget panels: controls that build an experiment's settings and run it on real ranks.

Every panel with ranks behind it is a :func:`labs.viz.recorded.recorded_panel`: when its cell
runs (for the book, at build time) it runs a small grid of settings and keeps each output, and
its controls switch between them in the browser, so the rendered book's panels work with no
kernel; in a running notebook its button launches the chosen setting on new ranks. The memory
calculators are arithmetic: in the book they compute in the browser
(:mod:`labs.viz.calculators`), in a notebook in Python.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import ipywidgets as w
import matplotlib.pyplot as plt
from IPython.display import display

from labs.collectives import Algorithm, Collective
from labs.experiments.ddp import (
    StepSettings,
    cap_text,
    default_cases,
    measure_step_times,
    measure_timelines,
)
from labs.experiments.recipe import (
    RecipeConfig,
    budget_table,
    loss_report,
    memory_budget,
    recipe_worker,
    unit_sizes,
)
from labs.experiments.sweep import SweepSettings, run_sweep, sweep_tables
from labs.experiments.timing import dtype_name, format_size
from labs.experiments.topology import (
    TopologyRow,
    TopologySettings,
    measure_topology,
    topology_table,
)
from labs.experiments.zero import (
    LAB_SETTINGS,
    MemoryReport,
    Recipe,
    TrafficRow,
    measure_memory,
    measure_traffic,
)
from labs.launcher import launch
from labs.link import Link
from labs.tables import format_table, toy_table
from labs.toy_allreduce import ToyAllReduceConfig, toy_all_reduce_step
from labs.viz.calculators import (
    WithBrowserFallback,
    budget_calculator_html,
    zero_calculator_html,
)
from labs.viz.collectives import plot_collective_bars, plot_toy_allreduce
from labs.viz.ddp import plot_step_times, plot_timeline, step_time_table
from labs.viz.recipe import plot_budget, plot_losses
from labs.viz.recorded import Choice, record, recorded_panel
from labs.viz.topology import plot_flat_vs_hierarchical
from labs.viz.zero import calculator_table, plot_calculator, plot_step_memory
from labs.wrappers import ZERO_STAGES, Wrapper


def show_toy_run(world_size: int, config: ToyAllReduceConfig) -> None:
    """Launch the toy all-reduce on real ranks, then print its table and draw its figure."""
    records = launch(toy_all_reduce_step, world_size, args=(config,), echo=False)
    print(f"world size {world_size}, seed {config.seed}: {records.seconds:.2f} s on "
          f"{world_size} real rank(s) ({records.backend.value})")
    print(toy_table(records))
    fig = plot_toy_allreduce(records)
    display(fig)
    plt.close(fig)


def toy_allreduce_panel(world_size: int = 4, seed: int = 0,
                        world_sizes: Sequence[int] = (1, 2, 3, 4, 8)) -> None:
    """The toy all-reduce at each of ``world_sizes`` (recorded, switched in the browser), and
    a button that runs the chosen world size with any seed on new ranks."""
    seed_box = w.IntText(value=seed, description="seed", layout=w.Layout(width="160px"))
    config = ToyAllReduceConfig(seed=seed)
    recorded_panel(
        [Choice("world size", tuple((str(n), n) for n in world_sizes), world_size)],
        lambda n: show_toy_run(n, config),
        live=lambda n: show_toy_run(n, ToyAllReduceConfig(seed=seed_box.value)),
        live_controls=[seed_box])


# --- chapters 2-4: time a collective --------------------------------------------------------

#: The message sizes the collective panel offers.
PANEL_SIZES: tuple[int, ...] = tuple(4 << (2 * i + 10) for i in range(7))  # 4 KiB .. 16 MiB


def sweep_command(settings: SweepSettings) -> str:
    """The shell command that runs the same experiment as ``settings``: every field that is
    not the default becomes a flag."""
    default = SweepSettings()
    algorithms = ("" if settings.algorithms is None else " --algorithms "
                  + " ".join(a.value.replace(" ", "-") for a in settings.algorithms))
    optional = [
        ("--dtype", settings.dtype != default.dtype, dtype_name(settings.dtype)),
        ("--segment-bytes", settings.segment_bytes != default.segment_bytes,
         " ".join("none" if s is None else format_size(s) for s in settings.segment_bytes)),
        ("--window", settings.window != default.window, str(settings.window)),
        ("--backends", settings.backends != default.backends,
         " ".join(b.value for b in settings.backends)),
        ("--launches", settings.launches != default.launches, str(settings.launches)),
        ("--threads", settings.threads != default.threads, str(settings.threads)),
        ("--min-bytes", settings.min_bytes != default.min_bytes,
         format_size(settings.min_bytes) if settings.min_bytes else "0"),
        ("--timeout", settings.timeout_s != default.timeout_s, f"{settings.timeout_s:g}"),
    ]
    return (f"python -m labs.bench collectives "
            f"--collectives {' '.join(c.value for c in settings.collectives)}{algorithms} "
            f"--sizes {' '.join(format_size(s) for s in settings.sizes)} "
            f"--world-sizes {' '.join(map(str, settings.world_sizes))} "
            f"--iters {settings.iters} --warmup {settings.warmup}"
            + "".join(f" {flag} {value}" for flag, differs, value in optional if differs))


def panel_settings(
    collective: Collective, world_size: int, size_bytes: int,
    algorithms: Sequence[Algorithm] | None = None, iters: int = 5, warmup: int = 1,
) -> SweepSettings:
    """The settings a :func:`collective_panel` run measures: one collective, one size, one
    world size, the chosen algorithms (default: every one the collective supports). Raises
    ValueError, saying what to change, for a combination that cannot run."""
    chosen = collective.algorithms() if algorithms is None else tuple(algorithms)
    if not chosen:
        raise ValueError("choose at least one algorithm to time.")
    wrong = [a for a in chosen if a not in collective.algorithms()]
    if wrong:
        names = ", ".join(a.value for a in collective.algorithms())
        raise ValueError(f"{collective.value} is implemented here by {names}; "
                         f"{wrong[0].value} is not one of them.")
    return SweepSettings(collectives=(collective,), algorithms=tuple(dict.fromkeys(chosen)),
                         sizes=(size_bytes,), world_sizes=(world_size,), iters=iters,
                         warmup=warmup)


def show_collective_run(settings: SweepSettings) -> None:
    """Run ``settings`` on real ranks, then print the nccl-tests style table and draw the
    time and bus-bandwidth bars."""
    start = time.perf_counter()
    timings = run_sweep(settings)
    took = time.perf_counter() - start
    print(f"{len(timings)} case(s) on {settings.world_sizes[0]} real ranks in {took:.1f} s "
          f"(launch included); the same from a shell:\n  {sweep_command(settings)}\n")
    print(sweep_tables(timings))
    fig = plot_collective_bars(timings)
    display(fig)
    plt.close(fig)


def collective_panel(
    collective: Collective, world_size: int = 4, size_bytes: int = 1 << 20,
    world_sizes: Sequence[int] = (2, 4, 8), sizes: Sequence[int] = (4 << 10, 1 << 20),
    iters: int = 5, link: Link | None = None,
) -> None:
    """Every algorithm of ``collective`` at each world size and message size of the grid,
    timed on real ranks (:func:`labs.experiments.sweep.run_sweep`, one launch per world size)
    and switched in the browser; the button times the chosen setting again on new ranks.

    With a ``link`` (all-reduce only), a checkbox beside the button runs labs' own algorithms
    on that emulated network instead (:func:`labs.experiments.link_sweep.measure_on_link`)
    and prints each one's time beside the model's (torch's built-in is left out: the link
    does not carry its messages)."""
    from labs.experiments import link_sweep

    # min_bytes 1 MiB (the sweep's default carries 64 MiB per size): a 4 KiB median is still
    # over 256 calls, and the grid costs a third of the time at every `make book`.
    grid = dataclasses.replace(panel_settings(collective, world_sizes[0], sizes[0], None, iters),
                               sizes=tuple(sizes), world_sizes=tuple(world_sizes),
                               min_bytes=1 << 20)
    start = time.perf_counter()
    timings = run_sweep(grid)
    took = time.perf_counter() - start

    def render(n: int, size: int) -> None:
        mine = [t for t in timings if t.world_size == n and t.case.size_bytes == size]
        print(f"{collective.value} of {format_size(size)} on {n} real ranks, every algorithm "
              f"(the grid took {took:.1f} s); the same from a shell:\n  "
              f"{sweep_command(dataclasses.replace(grid, sizes=(size,), world_sizes=(n,)))}\n")
        print(sweep_tables(mine))
        fig = plot_collective_bars(mine)
        display(fig)
        plt.close(fig)

    on_link = w.Checkbox(value=False, indent=False, layout=w.Layout(width="auto"),
                         description="" if link is None else
                         f"on the emulated link ({link.alpha * 1e3:g} ms, "
                         f"{link.bandwidth / 1e6:g} MB/s)")

    def live(n: int, size: int) -> None:
        if on_link.value and link is not None:
            mine = tuple(a for a in collective.algorithms() if a is not Algorithm.TORCH)
            settings = link_sweep.LinkSweepSettings(link=link, sizes=(size,), world_sizes=(n,),
                                                    algorithms=mine)
            print(link_sweep.link_table(link_sweep.measure_on_link(settings)))
            return
        show_collective_run(panel_settings(collective, n, size, None, iters))

    extra = [on_link] if link is not None and collective is Collective.ALL_REDUCE else []
    recorded_panel(
        [Choice("world size", tuple((str(n), n) for n in world_sizes), world_size),
         Choice("size S", tuple((format_size(b), b) for b in sizes), size_bytes)],
        render, live=live, live_controls=extra)


# --- chapter 5: data parallelism -------------------------------------------------------------

#: Bucket caps the DDP panel offers (MiB): 16 KiB to 25 MiB, torch's default.
DDP_PANEL_CAPS: tuple[float, ...] = (1 / 64, 1 / 16, 1 / 4, 1.0, 4.0, 25.0)


def show_ddp_run(world_size: int, settings: StepSettings, link: Link | None = None) -> None:
    """Time NaiveDDP, labs' DDP and torch DDP on real ranks at ``settings`` (the step-time
    table and bars, median and range), then draw one measured backward pass of NaiveDDP and
    DDP (a Gantt chart). On ``link`` torch's DDP is left out: the link does not carry its
    collectives."""
    start = time.perf_counter()
    cases = [c for c in default_cases(settings.bucket_cap_mb)
             if link is None or c.wrapper is not Wrapper.TORCH_DDP]
    rows = measure_step_times(world_size, settings, cases, link=link)
    timelines = measure_timelines(world_size, settings, link=link)
    where = (f"on an emulated link (alpha {link.alpha * 1e3:g} ms, {link.bandwidth / 1e6:g} MB/s)"
             if link else "on this machine's loopback")
    print(f"world size {world_size}, {settings.parameters:,} parameters, bucket cap "
          f"{cap_text(settings.bucket_cap_mb)}, {settings.accumulation} micro-batch(es) per "
          f"optimizer step (no_sync() around all but the last), {where}: "
          f"{time.perf_counter() - start:.1f} s on real ranks")
    print(step_time_table(rows))
    for fig in (plot_step_times(rows, title="Milliseconds per optimizer step"),
                plot_timeline({impl: t[0] for impl, t in timelines.items()},
                              title="One backward pass, rank 0")):
        display(fig)
        plt.close(fig)


def ddp_panel(world_size: int = 2, bucket_cap_mb: float = 0.25, accumulation: int = 1,
              settings: StepSettings | None = None, link: Link | None = None,
              world_sizes: Sequence[int] = (2, 4), caps: Sequence[float] = (0.25, 25.0)
              ) -> None:
    """World size and bucket cap (recorded on the loopback, switched in the browser), with
    micro-batches per optimizer step and, with ``link``, a box that puts the run on that
    emulated network, beside the button that runs the chosen setting on new ranks
    (:func:`show_ddp_run`)."""
    base = settings or StepSettings()
    micro = w.IntSlider(value=accumulation, min=1, max=8, description="micro-batches")
    on_link = w.Checkbox(value=False, description="on the emulated link", indent=False,
                         layout=w.Layout(display="flex" if link else "none"))

    def render(n: int, cap: float) -> None:
        show_ddp_run(n, dataclasses.replace(base, bucket_cap_mb=cap, accumulation=accumulation))

    def live(n: int, cap: float) -> None:
        show_ddp_run(n, dataclasses.replace(base, bucket_cap_mb=cap, accumulation=micro.value),
                     link if on_link.value else None)

    recorded_panel(
        [Choice("world size", tuple((str(n), n) for n in world_sizes), world_size),
         Choice("bucket cap", tuple((cap_text(c), c) for c in caps), bucket_cap_mb)],
        render, live=live, live_controls=[micro, on_link])


# --- chapter 6: ZeRO and FSDP -------------------------------------------------------------------


def memory_calculator(parameters: float = 7e9, recipe: Recipe = Recipe.MIXED,
                      world_size: int = 8, memory_gb: float = 80.0) -> None:
    """Model size, precision recipe, world size and memory per GPU -> bytes per parameter and
    GB per rank at every ZeRO stage (arithmetic: :func:`labs.experiments.zero.bytes_per_parameter`).
    Every change redraws: in a notebook in Python, in the rendered book in the browser
    (:func:`labs.viz.calculators.zero_calculator_html`, any size a reader types)."""
    size = w.FloatLogSlider(value=parameters, base=10, min=6, max=12, step=0.1,
                            description="parameters", readout_format=".2g")
    recipes = w.Dropdown(options=[(r.value, r) for r in Recipe], value=recipe,
                         description="recipe", layout=w.Layout(width="420px"))
    ranks = w.IntSlider(value=world_size, min=1, max=64, description="world size")
    memory = w.FloatText(value=memory_gb, description="GB per GPU", layout=w.Layout(width="200px"))
    out = w.Output(outputs=record(_show_calculator, parameters, recipe, world_size, memory_gb))

    def show(*_: object) -> None:
        with out:
            out.clear_output(wait=True)
            _show_calculator(size.value, recipes.value, ranks.value, memory.value)

    for control in (size, recipes, ranks, memory):
        control.observe(show, names="value")
    panel = WithBrowserFallback(
        w.VBox([w.HBox([size, ranks]), w.HBox([recipes, memory]), out]),
        zero_calculator_html(parameters, recipe, world_size, memory_gb))
    display(panel)


def _show_calculator(parameters: float, recipe: Recipe, world_size: int, memory_gb: float
                     ) -> None:
    print(calculator_table(parameters, recipe, world_size, memory_gb * 1e9))
    fig = plot_calculator(parameters, recipe, world_size)
    display(fig)
    plt.close(fig)


def show_zero_run(world_size: int, strategy: Wrapper, settings: StepSettings) -> None:
    """Measure one strategy on real ranks: rank 0's memory through one step (every moment
    the strategy exposes) and the bytes it sends."""
    start = time.perf_counter()
    report = measure_memory([world_size], settings, [strategy])[(strategy, world_size)]
    traffic = measure_traffic([world_size], settings, [strategy])[0]
    print(f"measured in {time.perf_counter() - start:.1f} s on real ranks")
    _show_zero_report(world_size, strategy, settings, report, traffic)


def _show_zero_report(world_size: int, strategy: Wrapper, settings: StepSettings,
                      report: MemoryReport, traffic: TrafficRow | None) -> None:
    print(f"{strategy.value}, world size {world_size}, {settings.parameters:,} parameters "
          f"({settings.layers} x Linear({settings.width}, {settings.width})), Adam")
    sent = ("sends nothing: one rank" if traffic is None else
            f"sent {traffic.measured:.3f} S per step (closed form {traffic.expected:.3f} S)")
    print(f"peak {report.peak_bytes / settings.parameters:.2f} bytes per parameter "
          f"({report.peak.moment}); {sent}")
    fig = plot_step_memory(report)
    display(fig)
    plt.close(fig)


def zero_panel(world_size: int = 4, strategy: Wrapper = Wrapper.FSDP,
               settings: StepSettings | None = None,
               world_sizes: Sequence[int] = (1, 2, 4, 8),
               reports: dict[tuple[Wrapper, int], MemoryReport] | None = None,
               traffic: Sequence[TrafficRow] | None = None) -> None:
    """World size and ZeRO stage -> one measured step: rank 0's memory over time and the
    bytes it sent. The grid is ``reports`` and ``traffic`` where the chapter has measured
    them already (:func:`labs.experiments.zero.measure_memory`, ``measure_traffic``), else
    measured here; the button measures the chosen setting again, at any layer width."""
    base = settings or LAB_SETTINGS
    reports = reports or measure_memory(world_sizes, base)
    traffic = list(traffic) if traffic is not None else measure_traffic(
        [n for n in world_sizes if n > 1], base)
    missing = [(s, n) for n in world_sizes for s in ZERO_STAGES if (s, n) not in reports]
    if missing:
        raise ValueError(f"reports lacks {missing[0][0].value} at world size {missing[0][1]}: "
                         "measure every stage at every world size of the panel.")
    width = w.Dropdown(options=sorted({32, 64, 128, 256, base.width}), value=base.width,
                       description="layer width", layout=w.Layout(width="200px"))

    def render(n: int, stage: Wrapper) -> None:
        sent = next((t for t in traffic if t.world_size == n and t.strategy is stage), None)
        _show_zero_report(n, stage, base, reports[(stage, n)], sent)

    recorded_panel(
        [Choice("world size", tuple((str(n), n) for n in world_sizes), world_size),
         Choice("stage", tuple((s.value, s) for s in ZERO_STAGES), strategy)],
        render, live=lambda n, stage: show_zero_run(
            n, stage, dataclasses.replace(base, width=width.value)),
        live_controls=[width])


# --- chapter 7: FSDP in practice ----------------------------------------------------------------


def budget_calculator(config: RecipeConfig | None = None, world_size: int = 8,
                      vocab: int = 50_257) -> None:
    """Width, blocks, sequence, micro-batch, world size, dtype, checkpointing and
    accumulation of a transformer like the recipe's -> the closed form of each thing a rank
    holds at the peak of a step (:func:`labs.experiments.recipe.memory_budget`, arithmetic:
    nothing runs). Every change redraws: in a notebook in Python, in the rendered book in
    the browser (:func:`labs.viz.calculators.budget_calculator_html`)."""
    base = config or RecipeConfig(d_model=2048, n_heads=16, n_layers=24, seq_len=2048,
                                  batch_size=1)
    width = w.Dropdown(options=sorted({256, 512, 1024, 2048, 4096, 8192, base.d_model}),
                       value=base.d_model, description="width")
    blocks = w.IntSlider(value=base.n_layers, min=1, max=96, description="blocks")
    seq = w.Dropdown(options=sorted({128, 512, 1024, 2048, 4096, 8192, base.seq_len}),
                     value=base.seq_len, description="sequence")
    batch = w.IntSlider(value=base.batch_size, min=1, max=32, description="micro-batch")
    ranks = w.IntSlider(value=world_size, min=1, max=256, description="world size")
    dtype = w.Dropdown(options=["fp32", "bf16"], value=base.dtype, description="compute")
    ckpt = w.Checkbox(value=base.activation_checkpointing, description="checkpointing",
                      indent=False, layout=w.Layout(width="150px"))
    accumulation = w.IntSlider(value=base.accumulation, min=1, max=16,
                               description="micro-batches")
    out = w.Output(outputs=record(_show_budget, base, world_size, vocab))

    def show(*_: object) -> None:
        with out:
            out.clear_output(wait=True)
            heads = max(h for h in (1, 2, 4, 8, 16, 32, 64) if width.value % h == 0)
            _show_budget(dataclasses.replace(
                base, d_model=width.value, n_heads=heads, n_layers=blocks.value,
                seq_len=seq.value, batch_size=batch.value, dtype=dtype.value,
                activation_checkpointing=ckpt.value, accumulation=accumulation.value),
                ranks.value, vocab)

    controls = (width, blocks, seq, batch, ranks, dtype, ckpt, accumulation)
    for control in controls:
        control.observe(show, names="value")
    panel = WithBrowserFallback(
        w.VBox([w.HBox(list(controls[:4])), w.HBox(list(controls[4:])), out]),
        budget_calculator_html(base.d_model, base.n_heads, base.n_layers, base.seq_len,
                               base.batch_size, vocab, world_size, base.dtype,
                               base.activation_checkpointing, base.accumulation))
    display(panel)


def _show_budget(config: RecipeConfig, world_size: int, vocab: int) -> None:
    rows = memory_budget(config, world_size, vocab)
    total = sum(r.model_bytes for r in rows)
    parameters = sum(unit_sizes(config, vocab))
    print(f"{parameters / 1e9:.3g} B parameters ({config.n_layers} blocks of width "
          f"{config.d_model}, vocabulary {vocab:,}), world size {world_size}, "
          f"{config.dtype} compute, micro-batch {config.batch_size} x {config.seq_len} tokens, "
          f"{'with' if config.activation_checkpointing else 'without'} checkpointing: "
          f"{total / 2**30:.2f} GiB per rank at the peak")
    print(format_table(["held per rank", "GiB", "closed form"],
                       [[r.name, f"{r.model_bytes / 2**30:.3f}", r.how] for r in rows]))
    fig = plot_budget(rows, title="closed forms at the peak of a step")
    display(fig)
    plt.close(fig)


def show_recipe_run(world_size: int, config: RecipeConfig) -> None:
    """Train the recipe on real ranks, measuring the last step's memory: the loss table,
    the loss curve and the budget beside the measured peak."""
    result = launch(recipe_worker, world_size, args=(dataclasses.replace(
        config, measure_memory=True),), echo=False, timeout=600)[0]
    print(loss_report(result))
    print(budget_table(result))
    fig = plot_losses([(f"{world_size} ranks, {config.dtype}", result)])
    display(fig)
    plt.close(fig)


def recipe_panel(world_size: int = 2, config: RecipeConfig | None = None,
                 world_sizes: Sequence[int] = (1, 2, 4), dtypes: Sequence[str] = ("fp32", "bf16")
                 ) -> None:
    """World size and compute dtype (recorded, switched in the browser) -> a training run of
    the recipe on real ranks; beside the button, checkpointing, micro-batches and steps for a
    new run of the chosen setting."""
    base = config or RecipeConfig(steps=10)
    ckpt = w.Checkbox(value=base.activation_checkpointing, description="checkpointing",
                      indent=False, layout=w.Layout(width="150px"))
    accumulation = w.Dropdown(options=sorted({1, 2, 4, base.accumulation}),
                              value=base.accumulation, description="micro-batches",
                              layout=w.Layout(width="200px"))
    steps = w.IntSlider(value=base.steps, min=2, max=60, description="steps")
    recorded_panel(
        [Choice("world size", tuple((str(n), n) for n in world_sizes), world_size),
         Choice("compute", tuple((d, d) for d in dtypes), base.dtype)],
        lambda n, dtype: show_recipe_run(n, dataclasses.replace(base, dtype=dtype)),
        live=lambda n, dtype: show_recipe_run(n, dataclasses.replace(
            base, dtype=dtype, activation_checkpointing=ckpt.value,
            accumulation=accumulation.value, steps=steps.value)),
        live_controls=[ckpt, accumulation, steps])


# --- chapter 8: beyond one node -----------------------------------------------------------------


def show_topology_run(settings: TopologySettings) -> None:
    """Both all-reduces on real ranks over the emulated topology: the table and the figure."""
    start = time.perf_counter()
    rows = measure_topology(settings)
    print(f"measured in {time.perf_counter() - start:.1f} s on real ranks")
    _show_topology_rows(settings, rows)


def _show_topology_rows(settings: TopologySettings, rows: Sequence[TopologyRow]) -> None:
    print(f"{settings.size_bytes / 2**20:g} MiB all-reduced on nodes of {settings.node_size}: "
          f"intra {settings.intra.bandwidth / 1e6:g} MB/s, inter "
          f"{settings.inter.bandwidth / 1e6:g} MB/s")
    print(topology_table(rows))
    fig = plot_flat_vs_hierarchical(rows)
    display(fig)
    plt.close(fig)


def topology_panel(settings: TopologySettings | None = None, ratios: Sequence[int] = (1, 10),
                   measured: dict[int, Sequence[TopologyRow]] | None = None) -> None:
    """Nodes (``settings.nodes``) and how much slower the link between nodes is than the
    node's own (``ratios``) -> the flat ring and the hierarchical all-reduce on real ranks,
    measured beside the model, switched in the browser. ``measured`` holds the rows of any
    ratio the chapter has timed already (:func:`labs.experiments.topology.measure_topology`
    of ``settings`` at that ratio); the other ratios are measured here. The button runs the
    chosen setting again at the size beside it."""
    base = settings or TopologySettings(nodes=(2, 4), size_bytes=2 << 20,
                                        intra=Link(1e-3, 50e6), inter=Link(1e-3, 5e6))

    def at(ratio: int, node_counts: Sequence[int], size: int) -> TopologySettings:
        inter = Link(base.inter.alpha, base.intra.bandwidth / ratio)
        return dataclasses.replace(base, nodes=tuple(node_counts), size_bytes=size,
                                   inter=inter)

    rows = {ratio: list((measured or {}).get(ratio) or measure_topology(
        at(ratio, base.nodes, base.size_bytes))) for ratio in ratios}
    for ratio, got in rows.items():
        if sorted(r.nodes for r in got) != sorted(base.nodes):
            raise ValueError(f"the rows at ratio {ratio} are for nodes "
                             f"{sorted(r.nodes for r in got)}, the panel's settings for "
                             f"{sorted(base.nodes)}: measure the same settings.")

    def render(count: int, ratio: int) -> None:
        row = next(r for r in rows[ratio] if r.nodes == count)
        _show_topology_rows(at(ratio, (count,), base.size_bytes), [row])

    sizes = sorted({1 << 20, 2 << 20, 4 << 20, 16 << 20, base.size_bytes})
    size = w.Dropdown(options=[(format_size(b), b) for b in sizes], value=base.size_bytes,
                      description="size")
    default_ratio = round(base.intra.bandwidth / base.inter.bandwidth)
    recorded_panel(
        [Choice("nodes", tuple((str(n), n) for n in base.nodes), base.nodes[0]),
         Choice("intra / inter", tuple((f"{r}x", r) for r in ratios),
                default_ratio if default_ratio in ratios else None)],
        render, live=lambda count, ratio: show_topology_run(at(ratio, (count,), size.value)),
        live_controls=[size])
