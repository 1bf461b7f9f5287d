"""Chapter 9: uneven data and crashed jobs, on real ranks.

**Uneven data** (:func:`run_uneven`). Rank r holds ``batches[r]`` batches and trains labs' DDP
on them, on a process group whose timeout is ``group_timeout_s``. Without ``join()`` the rank
that runs out leaves the loop while its peers enter the next step's all-reduce, which nobody
will join: they wait until the group's timeout. With ``DDP.join()`` the rank that ran out
shadows its peers' all-reduces with zeros until every rank has run out.
:func:`join_parity` trains the same uneven data under labs' ``join()`` and under torch DDP's.

**A crashed job, resumed** (:func:`crash_and_resume`). The recipe of chapter 7 runs
uninterrupted; then again with a checkpoint every ``K`` steps and rank 1 raising as step
``S`` starts; then resumed from that checkpoint on the same ranks and on fewer ranks (with
the accumulation scaled so that a step sees the same batches). The crash at the start of
step S loses the steps done since the last checkpoint, ``(S - 1) mod K``, at most ``K - 1``
finished steps (:func:`lost_steps` measures it over a sweep of S).
"""

from __future__ import annotations

import dataclasses
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from labs.ddp import DDP
from labs.experiments.recipe import (
    RecipeConfig,
    RecipeResult,
    read_recipe,
    recipe_worker,
)
from labs.launcher import launch
from labs.rank_errors import RankError
from labs.tables import format_table

# --- uneven data ------------------------------------------------------------------------------


def uneven_batches(rank: int, count: int) -> list[torch.Tensor]:
    """Rank ``rank``'s ``count`` batches (5 x 6), the same in every run."""
    generator = torch.Generator().manual_seed(100 + rank)
    return [torch.randn(5, 6, generator=generator) for _ in range(count)]


def uneven_net() -> nn.Module:
    """The small model every rank starts from, the same in every run."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def train_batches(model: nn.Module, batches: Sequence[torch.Tensor],
                  sync: bool = True) -> int:
    """SGD over ``batches``; ``sync``: labs' DDP, whose averaging is called after backward
    (torch DDP's runs in its hooks). Returns the steps taken."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for x in batches:
        model(x).square().mean().backward()
        if sync:
            model.finish_gradient_synchronization()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return len(batches)


@dataclass(frozen=True)
class UnevenOutcome:
    """How one rank's loop ended."""

    rank: int
    steps: int
    """The steps this rank took (its own batches)."""
    error: str
    """What its last collective raised, type and message ('' when it returned)."""
    seconds: float
    """From the first step to the end of its loop."""


def uneven_worker(rank: int, world_size: int, batches: tuple[int, ...], join: bool,
                  group_timeout_s: float) -> UnevenOutcome:
    """Train labs' DDP on this rank's batches, inside ``join()`` or not; the outcome kept."""
    group = dist.new_group(timeout=timedelta(seconds=group_timeout_s))
    model = DDP(uneven_net(), process_group=group)
    mine = uneven_batches(rank, batches[rank])
    started = time.perf_counter()
    try:
        if join:
            with model.join():
                steps = train_batches(model, mine)
        else:
            steps = train_batches(model, mine)
    except Exception as err:  # noqa: BLE001 - what the loop raised is the lesson
        return UnevenOutcome(rank, -1, f"{type(err).__name__}: {str(err).strip()[:2000]}",
                             time.perf_counter() - started)
    return UnevenOutcome(rank, steps, "", time.perf_counter() - started)


def run_uneven(batches: Sequence[int] = (2, 3), join: bool = False,
               group_timeout_s: float = 2.0, check: bool = False) -> list[UnevenOutcome]:
    """Each rank's outcome, rank r holding ``batches[r]`` batches (``check``: under
    ``check_collectives=True``)."""
    if len(batches) < 2 or any(isinstance(b, bool) or not isinstance(b, int) or b < 0
                               for b in batches):
        raise ValueError(f"batches must give each of 2 or more ranks a count >= 0, got "
                         f"{list(batches)}.")
    return list(launch(uneven_worker, len(batches), args=(tuple(batches), join, group_timeout_s),
                       backend="gloo", device="cpu", timeout=group_timeout_s + 60, echo=False,
                       check_collectives=check))


#: What labs' check says of a peer that returned: its rank and how many collectives it issued.
_RETURNED = re.compile(r"rank \d+ returned from its worker after \d+ collective\(s\)")


def uneven_table(outcomes: dict[str, Sequence[UnevenOutcome]],
                 batches: Sequence[int]) -> str:
    """Each run (a row per rank): its batches and how its loop ended."""
    rows = []
    for name, run in outcomes.items():
        for o in run:
            returned = _RETURNED.search(o.error)
            ended = o.error.splitlines()[0][:60] if o.error \
                else f"returned after {o.steps} steps"
            if "Timed out" in o.error:
                ended = "gloo: timed out waiting for a peer"
            elif returned:
                ended = f"CollectiveMismatch: {returned.group(0)}"
            rows.append([name, o.rank, batches[o.rank], ended, f"{o.seconds:.2f}"])
    return format_table(["run", "rank", "batches", "its loop", "seconds"], rows)


def join_worker(rank: int, world_size: int, batches: tuple[int, ...], initial: bool
                ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The same uneven batches under labs' ``DDP.join()`` and torch DDP's ``join()``: each
    model's parameters at the end."""
    mine = uneven_batches(rank, batches[rank])
    ours = DDP(uneven_net())
    with ours.join(divide_by_initial_world_size=initial):
        train_batches(ours, mine)
    theirs = nn.parallel.DistributedDataParallel(uneven_net())
    with theirs.join(divide_by_initial_world_size=initial):
        train_batches(theirs, mine, sync=False)
    return ([p.detach() for p in ours.module.parameters()],
            [p.detach() for p in theirs.module.parameters()])


def join_parity(batches: Sequence[int], initial: bool = True) -> float:
    """The largest difference between a parameter trained under labs' join() and under torch
    DDP's, over every rank (0.0: the same)."""
    results = launch(join_worker, len(batches), args=(tuple(batches), initial), backend="gloo",
                     device="cpu", timeout=120, echo=False)
    return max(float((a - b).abs().max()) for ours, theirs in results
               for a, b in zip(ours, theirs, strict=True))


# --- a crashed job, resumed ---------------------------------------------------------------------


@dataclass(frozen=True)
class ResumeRun:
    """The uninterrupted run, the crash, and the resumes."""

    config: RecipeConfig
    fail_at_step: int
    whole: RecipeResult
    crash: str
    """The RankError's first line: which rank raised what."""
    saved_step: int
    """The step of the last checkpoint the crash left."""
    resumed: RecipeResult
    """Resumed on the same ranks."""
    fewer: RecipeResult
    """Resumed on fewer ranks, from a copy of the same checkpoint."""


def crash_and_resume(config: RecipeConfig, directory: str | Path, fail_at_step: int,
                     checkpoint_every: int, world_size: int = 2, fewer: int = 1) -> ResumeRun:
    """Run ``config`` whole on ``world_size`` ranks; again, crashing as ``fail_at_step``
    starts, with a checkpoint every ``checkpoint_every`` steps in ``directory``; then resume
    on ``world_size`` ranks, and, from a copy of the crash's checkpoint, on ``fewer`` ranks
    with ``world_size / fewer`` times the accumulation."""
    if not (1 <= fewer < world_size and world_size % fewer == 0):
        raise ValueError(f"fewer must divide world_size and be smaller, got {fewer} and "
                         f"{world_size}.")
    root = Path(directory)
    whole = launch(recipe_worker, world_size, args=(config,), echo=False, timeout=300)[0]
    crashing = dataclasses.replace(config, checkpoint=str(root / "run"),
                                   checkpoint_every=checkpoint_every, fail_at_step=fail_at_step)
    try:
        launch(recipe_worker, world_size, args=(crashing,), echo=False, timeout=300)
        raise RuntimeError(f"the run did not fail at step {fail_at_step}.")
    except RankError as err:
        crash = str(err).splitlines()[0]
    shutil.copytree(root / "run", root / "copy")
    saved = int(read_recipe(str(root / "run"))["step"])
    resume = dataclasses.replace(crashing, fail_at_step=None, resume=True)
    resumed = launch(recipe_worker, world_size, args=(resume,), echo=False, timeout=300)[0]
    smaller = dataclasses.replace(resume, checkpoint=str(root / "copy"),
                                  accumulation=config.accumulation * world_size // fewer)
    on_fewer = launch(recipe_worker, fewer, args=(smaller,), echo=False, timeout=300)[0]
    return ResumeRun(config, fail_at_step, whole, crash, saved, resumed, on_fewer)


def resume_table(run: ResumeRun) -> str:
    """Every step's loss: uninterrupted, resumed on the same ranks, resumed on fewer."""
    first = run.resumed.start_step + 1
    rows = []
    for step in range(1, run.config.steps + 1):
        whole = run.whole.losses[step - 1]
        row = [step, f"{whole:.8f}"]
        for result in (run.resumed, run.fewer):
            row.append(f"{result.losses[step - first]:.8f}" if step >= first else "")
        rows.append([*row, f"{abs(run.fewer.losses[step - first] - whole):.1e}"
                     if step >= first else ""])
    return format_table(["step", f"uninterrupted ({run.whole.world_size} ranks)",
                         f"resumed on {run.resumed.world_size}",
                         f"resumed on {run.fewer.world_size}", "|difference|"], rows)


def lost_steps(config: RecipeConfig, directory: str | Path, fail_steps: Sequence[int],
               checkpoint_every: int, world_size: int = 2) -> list[tuple[int, int, int]]:
    """For each step S of ``fail_steps``: a run crashing as S starts, checkpointing every
    ``checkpoint_every`` steps; ``(S, the checkpoint's step, steps lost)``."""
    out = []
    for step in fail_steps:
        path = Path(directory) / f"fail-{step}"
        crashing = dataclasses.replace(config, checkpoint=str(path),
                                       checkpoint_every=checkpoint_every, fail_at_step=step)
        try:
            launch(recipe_worker, world_size, args=(crashing,), echo=False, timeout=300)
        except RankError:
            pass
        saved = int(read_recipe(str(path))["step"]) if (path / "index.json").exists() else 0
        out.append((step, saved, step - 1 - saved))
    return out


@dataclass(frozen=True)
class TorchrunRun:
    """``python -m labs fsdp`` under ``torchrun --max-restarts=1``, crashing once."""

    command: str
    """The command as a reader would type it (the checkpoint directory as DIR)."""
    returncode: int
    stdout: str
    stderr: str

    @property
    def excerpt(self) -> str:
        """The failing rank's last line, then what rank 0 printed after the restart."""
        failed = [line for line in self.stderr.splitlines() if "InjectedFailure:" in line]
        return "\n".join([*failed[-1:], "...", self.stdout.rstrip()])


def torchrun_command(config: RecipeConfig, directory: str, fail_at_step: int,
                     checkpoint_every: int, world_size: int = 2) -> list[str]:
    """The torchrun command line that runs ``config`` and crashes once (``config``'s settings
    that the command line has: the model's heads and sequence length stay the defaults)."""
    defaults = RecipeConfig()
    if (config.n_heads, config.seq_len) != (defaults.n_heads, defaults.seq_len):
        raise ValueError("python -m labs fsdp has no --heads or --seq-len: keep n_heads="
                         f"{defaults.n_heads} and seq_len={defaults.seq_len}.")
    args = ["--steps", config.steps, "--batch-size", config.batch_size, "--accumulation",
            config.accumulation, "--lr", config.lr, "--seed", config.seed, "--d-model",
            config.d_model, "--layers", config.n_layers, "--dtype", config.dtype,
            "--max-norm", config.max_norm or 0, "--checkpoint", directory,
            "--checkpoint-every", checkpoint_every, "--fail-at-step", fail_at_step]
    if not config.activation_checkpointing:
        args.append("--no-checkpointing")
    return ["torchrun", "--standalone", f"--nproc_per_node={world_size}", "--max-restarts=1",
            "-m", "labs", "fsdp", *map(str, args)]


def torchrun_restart(config: RecipeConfig, directory: str | Path, fail_at_step: int,
                     checkpoint_every: int, world_size: int = 2,
                     timeout: float = 300.0) -> TorchrunRun:
    """Run :func:`torchrun_command` (torchrun as ``python -m torch.distributed.run`` of this
    Python) and keep what it printed."""
    command = torchrun_command(config, str(directory), fail_at_step, checkpoint_every,
                               world_size)
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", *command[1:]],
                          capture_output=True, text=True, timeout=timeout, check=False)
    shown = shlex.join(command).replace(shlex.quote(str(directory)), "DIR")
    return TorchrunRun(shown, done.returncode, done.stdout, done.stderr)
