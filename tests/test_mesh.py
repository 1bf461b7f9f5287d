"""Process groups and 2-D meshes (labs.experiments.mesh, labs.viz.mesh) on real ranks: the
groups built by hand with new_group agree with init_device_mesh's, a DTensor
(Replicate(), Shard(0)) holds the rows it should on each rank, and the figure draws."""

from __future__ import annotations

import dataclasses

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from labs.experiments.mesh import (  # noqa: E402
    MeshSettings,
    device_mesh_available,
    dtensor_table,
    group_table,
    groups_agree,
    measured_groups,
    run_mesh,
)
from labs.viz.mesh import plot_mesh  # noqa: E402

AVAILABLE, WHY = device_mesh_available()
needs_mesh = pytest.mark.skipif(not AVAILABLE, reason=WHY)


def test_layout_of_a_4_by_2_mesh():
    settings = MeshSettings()
    assert settings.world_size == 8
    assert settings.groups(1) == [(0, 1), (2, 3), (4, 5), (6, 7)]  # inside each node
    assert settings.groups(0) == [(0, 2, 4, 6), (1, 3, 5, 7)]  # across nodes
    assert [settings.coordinate(r) for r in (0, 1, 5, 7)] == [(0, 0), (0, 1), (2, 1), (3, 1)]
    with pytest.raises(ValueError, match="dims 0 and 1"):
        settings.groups(2)


def test_this_torch_builds_meshes():
    # torch 2.13 here; the guard's message is what an older torch prints instead
    assert AVAILABLE, WHY
    assert WHY.startswith("init_device_mesh and DTensor")


@pytest.fixture(scope="module")
def mesh_reports():
    return run_mesh(MeshSettings())


@needs_mesh
def test_new_group_and_init_device_mesh_agree(mesh_reports, no_leftover_processes):
    settings = MeshSettings()
    assert [r.rank for r in mesh_reports] == list(range(8))
    assert groups_agree(mesh_reports, settings)
    assert measured_groups(mesh_reports, "shard") == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert measured_groups(mesh_reports, "replicate") == [(0, 2, 4, 6), (1, 3, 5, 7)]
    for name in settings.dim_names:
        assert (measured_groups(mesh_reports, name, torch_mesh=True)
                == measured_groups(mesh_reports, name))
    for r in mesh_reports:
        assert r.skipped is None
        assert r.mesh_coordinate == r.coordinate == settings.coordinate(r.rank)
    table = group_table(mesh_reports, settings)
    assert table.count("yes") == 6 and "NO" not in table


@needs_mesh
def test_dtensor_replicate_shard_local_shapes(mesh_reports):
    settings = MeshSettings()  # 5 x 3 over Shard(0) on 2 ranks: 3 rows, then 2
    full = settings.full_tensor()
    for r in mesh_reports:
        shard = r.dtensor
        assert shard is not None and shard.full_matches
        assert shard.global_shape == (5, 3)
        assert "Replicate()" in shard.placements and "Shard(dim=0)" in shard.placements
        rows = (0, 1, 2) if r.coordinate[1] == 0 else (3, 4)
        assert shard.local_shape == (len(rows), 3)
        assert shard.rows_held == rows
        torch.testing.assert_close(shard.local, full[list(rows)], rtol=0, atol=0)
    table = dtensor_table(mesh_reports)
    assert "(3, 3)" in table and "(2, 3)" in table


@needs_mesh
def test_a_2_by_2_mesh_with_an_empty_shard(no_leftover_processes):
    settings = MeshSettings(shape=(2, 2), rows=1, cols=4)  # torch.chunk: 1 row, then none
    reports = run_mesh(settings)
    assert groups_agree(reports, settings)
    assert measured_groups(reports, "shard") == [(0, 1), (2, 3)]
    shapes = {r.rank: r.dtensor.local_shape for r in reports}
    assert shapes == {0: (1, 4), 1: (0, 4), 2: (1, 4), 3: (0, 4)}
    assert all(r.dtensor.full_matches for r in reports)
    assert reports[1].dtensor.rows_held == ()


@needs_mesh
def test_a_wrong_group_is_caught(mesh_reports):
    settings = MeshSettings()
    wrong = list(mesh_reports)
    bad = dict(wrong[2].new_group, shard=(2, 4))  # a "node" that crosses nodes
    wrong[2] = dataclasses.replace(wrong[2], new_group=bad)
    assert not groups_agree(wrong, settings)
    assert "NO" in group_table(wrong, settings)
    skipped = [dataclasses.replace(r, device_mesh=None) for r in mesh_reports]
    assert not groups_agree(skipped, settings)  # nothing to agree with is not agreement


def test_figure_from_the_layout_and_from_the_ranks(mesh_reports):
    fig = plot_mesh()
    assert isinstance(fig, Figure)
    labels = {t.get_text() for t in fig.axes[0].texts}
    assert {f"rank {r}" for r in range(8)} <= labels
    assert {"node 0", "node 3", "{0, 2, 4, 6}"} <= labels
    plt.close(fig)
    fig = plot_mesh(MeshSettings(), mesh_reports)
    labels = {t.get_text() for t in fig.axes[0].texts}
    if AVAILABLE:
        assert {"rows 0-2", "rows 3-4"} <= labels
    plt.close(fig)
    fig = plot_mesh(MeshSettings(shape=(2, 4)))
    assert isinstance(fig, Figure)
    plt.close(fig)


@pytest.mark.parametrize("bad, message", [
    (dict(shape=(0, 2)), "two positive ints"),
    (dict(shape=(4, 2, 1)), "two positive ints"),
    (dict(shape=(8, 8)), "at most"),
    (dict(dim_names=("dp", "dp")), "different"),
    (dict(dim_names=("dp",)), "different"),
    (dict(rows=0), "at least one row"),
])
def test_bad_settings_are_refused(bad, message, refuse_processes):
    with refuse_processes(), pytest.raises(ValueError, match=message):
        MeshSettings(**bad)
