"""Widget panels: controls that build an experiment's settings and run it on real ranks."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

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
from labs.experiments.topology import TopologySettings, measure_topology, topology_table
from labs.experiments.zero import (
    LAB_SETTINGS,
    Recipe,
    measure_memory,
    measure_traffic,
)
from labs.launcher import launch
from labs.link import Link
from labs.tables import format_table, toy_table
from labs.toy_allreduce import ToyAllReduceConfig, toy_all_reduce_step
from labs.viz.collectives import plot_collective_bars, plot_toy_allreduce
from labs.viz.ddp import plot_step_times, plot_timeline, step_time_table
from labs.viz.recipe import plot_budget, plot_losses
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


def _run_button(out: w.Output, action: Callable[[], None]) -> w.Button:
    """A "Run on real ranks" button: each click clears ``out`` and shows ``action``'s output
    there; the button is disabled while the ranks run, so a second click cannot start a
    second launch."""
    button = w.Button(description="Run on real ranks", button_style="primary", icon="play")

    def run(_: w.Button) -> None:
        button.disabled, button.description = True, "Running..."
        try:
            with out:
                out.clear_output(wait=True)
                action()
        finally:
            button.disabled, button.description = False, "Run on real ranks"

    button.on_click(run)
    return button


def toy_allreduce_panel(world_size: int = 4, seed: int = 0) -> None:
    """World size, seed and a run button. The default run is shown at once, as ordinary
    output (so a rendered page shows it); each click shows its own run in the panel."""
    size = w.IntSlider(value=world_size, min=1, max=8, description="world size")
    seed_box = w.IntText(value=seed, description="seed", layout=w.Layout(width="160px"))
    out = w.Output()
    button = _run_button(out, lambda: show_toy_run(size.value,
                                                   ToyAllReduceConfig(seed=seed_box.value)))
    display(w.VBox([w.HBox([size, seed_box, button]), out]))
    show_toy_run(world_size, ToyAllReduceConfig(seed=seed))


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
    algorithms: Sequence[Algorithm] | None = None, iters: int = 5, link: Link | None = None,
) -> None:
    """World size, message size and algorithms for ``collective``, and a run button that times
    them on real ranks (:func:`labs.bench.collectives.run_sweep`). The default run is shown at
    once, as ordinary output (so a rendered page shows it); each click shows its own run in
    the panel. A collective needs two ranks, so the world size starts at 2.

    With a ``link`` (all-reduce only), a checkbox runs labs' own algorithms on that emulated
    network instead (:func:`labs.experiments.link_sweep.measure_on_link`) and prints each
    one's time beside the model's (torch's built-in is left out: the link does not carry its
    messages)."""
    from labs.experiments import link_sweep

    default = panel_settings(collective, world_size, size_bytes, algorithms, iters)
    options = [(format_size(s), s) for s in sorted({*PANEL_SIZES, size_bytes})]
    size = w.IntSlider(value=world_size, min=2, max=8, description="world size")
    message = w.Dropdown(options=options, value=size_bytes, description="size S",
                         layout=w.Layout(width="180px"))
    boxes = {a: w.Checkbox(value=a in default.algorithms_of(collective), description=a.value,
                           indent=False, layout=w.Layout(width="auto"))
             for a in collective.algorithms()}
    on_link = w.Checkbox(value=False, indent=False, layout=w.Layout(width="auto"),
                         description="" if link is None else
                         f"on the emulated link ({link.alpha * 1e3:g} ms, "
                         f"{link.bandwidth / 1e6:g} MB/s)")
    out = w.Output()

    def run_on_link(chosen: list[Algorithm]) -> None:
        assert link is not None
        mine = tuple(a for a in chosen if a is not Algorithm.TORCH)
        if not mine:
            print("Cannot run: choose at least one of labs' own algorithms (the link does not "
                  "carry torch's messages).")
            return
        settings = link_sweep.LinkSweepSettings(link=link, sizes=(message.value,),
                                                world_sizes=(size.value,), algorithms=mine)
        print(link_sweep.link_table(link_sweep.measure_on_link(settings)))

    def run() -> None:
        chosen = [a for a, box in boxes.items() if box.value]
        if on_link.value:
            run_on_link(chosen)
            return
        try:
            settings = panel_settings(collective, size.value, message.value, chosen, iters)
        except ValueError as err:
            print(f"Cannot run: {err}")
            return
        show_collective_run(settings)

    button = _run_button(out, run)
    extra = [on_link] if link is not None and collective is Collective.ALL_REDUCE else []
    display(w.VBox([w.HBox([size, message, button]),
                    w.HBox([w.Label("algorithms:"), *boxes.values(), *extra]), out]))
    show_collective_run(default)


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
              settings: StepSettings | None = None, link: Link | None = None) -> None:
    """World size, bucket cap and micro-batches per optimizer step, with ``link`` a box that
    puts the run on that emulated network, and a run button (:func:`show_ddp_run`). The
    default run (on the loopback) is shown at once, as ordinary output."""
    base = settings or StepSettings()
    size = w.IntSlider(value=world_size, min=1, max=4, description="world size")
    cap = w.Dropdown(options=[(cap_text(c), c) for c in sorted({*DDP_PANEL_CAPS,
                                                                 bucket_cap_mb})],
                     value=bucket_cap_mb, description="bucket cap",
                     layout=w.Layout(width="200px"))
    micro = w.IntSlider(value=accumulation, min=1, max=8, description="micro-batches")
    on_link = w.Checkbox(value=False, description="on the emulated link", indent=False,
                         layout=w.Layout(display="flex" if link else "none"))
    out = w.Output()

    def run() -> None:
        show_ddp_run(size.value, dataclasses.replace(base, bucket_cap_mb=cap.value,
                                                     accumulation=micro.value),
                     link if on_link.value else None)

    button = _run_button(out, run)
    display(w.VBox([w.HBox([size, cap, micro]), w.HBox([on_link, button]), out]))
    show_ddp_run(world_size, dataclasses.replace(base, bucket_cap_mb=bucket_cap_mb,
                                                 accumulation=accumulation))


# --- chapter 6: ZeRO and FSDP -------------------------------------------------------------------


def memory_calculator(parameters: float = 7e9, recipe: Recipe = Recipe.MIXED,
                      world_size: int = 8, memory_gb: float = 80.0) -> None:
    """Model size, precision recipe, world size and memory per GPU -> bytes per parameter and
    GB per rank at every ZeRO stage (arithmetic: :func:`labs.experiments.zero.bytes_per_parameter`).
    The default is shown at once; every change redraws."""
    size = w.FloatLogSlider(value=parameters, base=10, min=6, max=12, step=0.1,
                            description="parameters", readout_format=".2g")
    recipes = w.Dropdown(options=[(r.value, r) for r in Recipe], value=recipe,
                         description="recipe", layout=w.Layout(width="420px"))
    ranks = w.IntSlider(value=world_size, min=1, max=64, description="world size")
    memory = w.FloatText(value=memory_gb, description="GB per GPU", layout=w.Layout(width="200px"))
    out = w.Output()

    def show(*_: object) -> None:
        with out:
            out.clear_output(wait=True)
            _show_calculator(size.value, recipes.value, ranks.value, memory.value)

    for control in (size, recipes, ranks, memory):
        control.observe(show, names="value")
    display(w.VBox([w.HBox([size, ranks]), w.HBox([recipes, memory]), out]))
    _show_calculator(parameters, recipe, world_size, memory_gb)


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
    print(f"{strategy.value}, world size {world_size}, {settings.parameters:,} parameters "
          f"({settings.layers} x Linear({settings.width}, {settings.width})), Adam: "
          f"{time.perf_counter() - start:.1f} s on real ranks")
    print(f"peak {report.peak_bytes / settings.parameters:.2f} bytes per parameter "
          f"({report.peak.moment}); sent {traffic.measured:.3f} S per step (closed form "
          f"{traffic.expected:.3f} S)")
    fig = plot_step_memory(report)
    display(fig)
    plt.close(fig)


def zero_panel(world_size: int = 4, strategy: Wrapper = Wrapper.FSDP,
               settings: StepSettings | None = None) -> None:
    """World size, ZeRO stage and model width -> one measured step: memory over time and
    traffic. The default run is shown at once, as ordinary output."""
    base = settings or LAB_SETTINGS
    size = w.IntSlider(value=world_size, min=1, max=8, description="world size")
    stage = w.Dropdown(options=[(s.value, s) for s in ZERO_STAGES], value=strategy,
                       description="stage", layout=w.Layout(width="260px"))
    width = w.Dropdown(options=sorted({32, 64, 128, 256, base.width}), value=base.width,
                       description="layer width",
                       layout=w.Layout(width="200px"))
    out = w.Output()
    button = _run_button(out, lambda: show_zero_run(
        size.value, stage.value, dataclasses.replace(base, width=width.value)))
    display(w.VBox([w.HBox([size, stage, width]), button, out]))
    show_zero_run(world_size, strategy, base)


# --- chapter 7: FSDP in practice ----------------------------------------------------------------


def budget_calculator(config: RecipeConfig | None = None, world_size: int = 8,
                      vocab: int = 50_257) -> None:
    """Width, blocks, sequence, micro-batch, world size, dtype, checkpointing and
    accumulation of a transformer like the recipe's -> the closed form of each thing a rank
    holds at the peak of a step (:func:`labs.experiments.recipe.memory_budget`, arithmetic:
    nothing runs). The default is shown at once; every change redraws."""
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
    out = w.Output()

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
    display(w.VBox([w.HBox(list(controls[:4])), w.HBox(list(controls[4:])), out]))
    _show_budget(base, world_size, vocab)


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


def recipe_panel(world_size: int = 2, config: RecipeConfig | None = None) -> None:
    """World size, compute dtype, checkpointing, micro-batches and steps -> a training run
    of the recipe on real ranks. The default run is shown at once, as ordinary output."""
    base = config or RecipeConfig(steps=10)
    size = w.Dropdown(options=[1, 2, 4], value=world_size, description="world size")
    dtype = w.Dropdown(options=["fp32", "bf16"], value=base.dtype, description="compute")
    ckpt = w.Checkbox(value=base.activation_checkpointing, description="checkpointing",
                      indent=False, layout=w.Layout(width="150px"))
    accumulation = w.Dropdown(options=[1, 2, 4], value=base.accumulation,
                              description="micro-batches")
    steps = w.IntSlider(value=base.steps, min=2, max=60, description="steps")
    out = w.Output()
    button = _run_button(out, lambda: show_recipe_run(size.value, dataclasses.replace(
        base, dtype=dtype.value, activation_checkpointing=ckpt.value,
        accumulation=accumulation.value, steps=steps.value)))
    display(w.VBox([w.HBox([size, dtype, ckpt]), w.HBox([accumulation, steps]), button, out]))
    show_recipe_run(world_size, base)


# --- chapter 8: beyond one node -----------------------------------------------------------------


def show_topology_run(settings: TopologySettings) -> None:
    """Both all-reduces on real ranks over the emulated topology: the table and the figure."""
    start = time.perf_counter()
    rows = measure_topology(settings)
    print(f"{settings.size_bytes / 2**20:g} MiB all-reduced on nodes of {settings.node_size}: "
          f"intra {settings.intra.bandwidth / 1e6:g} MB/s, inter "
          f"{settings.inter.bandwidth / 1e6:g} MB/s ({time.perf_counter() - start:.1f} s on "
          "real ranks)")
    print(topology_table(rows))
    fig = plot_flat_vs_hierarchical(rows)
    display(fig)
    plt.close(fig)


def topology_panel(settings: TopologySettings | None = None) -> None:
    """Nodes, how much slower the link between nodes is, and the size -> the flat ring and
    the hierarchical all-reduce on real ranks, measured beside the model. The default run is
    shown at once, as ordinary output."""
    base = settings or TopologySettings(nodes=(2,), size_bytes=4 << 20,
                                        intra=Link(1e-3, 100e6), inter=Link(1e-3, 10e6))
    nodes = w.Dropdown(options=[1, 2, 4], value=base.nodes[0], description="nodes")
    ratio = w.Dropdown(options=[1, 2, 5, 10, 20], description="intra / inter",
                       value=round(base.intra.bandwidth / base.inter.bandwidth))
    size = w.Dropdown(options=[("1 MiB", 1 << 20), ("4 MiB", 4 << 20), ("16 MiB", 16 << 20)],
                      value=base.size_bytes, description="size")
    out = w.Output()

    def chosen() -> TopologySettings:
        inter = Link(base.inter.alpha, base.intra.bandwidth / ratio.value)
        return dataclasses.replace(base, nodes=(nodes.value,), size_bytes=size.value,
                                   inter=inter)

    button = _run_button(out, lambda: show_topology_run(chosen()))
    display(w.VBox([w.HBox([nodes, ratio, size]), button, out]))
    show_topology_run(base)
