"""Chapter 9's widget panel: a rank killed or stopped in a loop of all-reduces, with torch's
all-reduce or labs' ring: when its peers saw it and what ``launch`` reported.

A :func:`labs.viz.recorded.recorded_panel`: its cell records every setting for the rendered
book (reusing the chapter's runs), and its button runs the chosen one on new ranks, with the
group timeout beside it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import ipywidgets as w

from labs.experiments.faults import (
    COLLECTIVES,
    HOW,
    DeathRow,
    DeathSettings,
    death_table,
    measure_death,
)
from labs.viz.recorded import Choice, recorded_panel


def show_death(row: DeathRow) -> None:
    """One failure: the table row and the first lines of launch's report."""
    print(death_table([row]))
    print("\nlaunch raised:\n" + row.report)


def death_panel(base: DeathSettings = DeathSettings(group_timeout_s=2.0),
                measured: Sequence[DeathRow] = ()) -> None:
    """How the victim goes (killed, stopped) x the all-reduce (torch's, labs' ring) -> the
    failure on real ranks, switched in the browser. ``measured`` holds rows the chapter ran
    already (any of them with ``base``'s other settings is reused)."""
    rows = {(r.config.how, r.config.collective): r for r in measured
            if dataclasses.replace(r.config, how=base.how, collective=base.collective) == base}

    def render(how: str, collective: str) -> None:
        if (how, collective) not in rows:
            rows[how, collective] = measure_death(
                dataclasses.replace(base, how=how, collective=collective))
        show_death(rows[how, collective])

    timeout = w.FloatSlider(value=base.group_timeout_s, min=0.5, max=10.0, step=0.5,
                            description="group timeout (s)",
                            style={"description_width": "initial"})
    recorded_panel(
        [Choice("victim", tuple((h, h) for h in HOW), base.how),
         Choice("all-reduce", tuple((c, c) for c in COLLECTIVES), base.collective)],
        render,
        live=lambda how, collective: show_death(measure_death(dataclasses.replace(
            base, how=how, collective=collective, group_timeout_s=timeout.value))),
        live_controls=[timeout])
