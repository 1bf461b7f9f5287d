"""labs.grid: the one grid of process groups. The layout (pure): row-major coordinates, the
groups along each dimension as torch's ``arange(N).view(shape)`` cuts them, the creation order,
the course's layouts (the hierarchical all-reduce's nodes, HSDP's), and a bad shape refused
with what to pick before any process starts. On real ranks (gloo): the groups
``ProcessGrid.build`` makes have the members the layout says, at two shapes (a 2-D and a 3-D
grid with a dimension of one), through ``HierarchicalGroups`` and HSDP's ``hybrid_groups``
too, and a grid that does not fit its process group is refused on every rank before any group
is made."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st

from labs import launch
from labs.collectives import HierarchicalGroups
from labs.grid import GridLayout, ProcessGrid, hybrid_groups, hybrid_layout, node_layout

# --- the layout, without processes ------------------------------------------------------------


def torch_groups(layout: GridLayout, name: str) -> list[tuple[int, ...]]:
    """The oracle: the groups along ``name`` as ``DeviceMesh`` cuts ``arange(N).view(shape)``,
    that dimension moved last and every other flattened, in row-major order."""
    mesh = torch.arange(layout.world_size).view(layout.shape)
    rows = mesh.movedim(layout.dim(name), -1).reshape(-1, layout.size(name))
    return [tuple(int(r) for r in row) for row in rows]


def test_a_4_by_2_grid_cuts_nodes_and_columns():
    layout = GridLayout(("replicate", "shard"), (4, 2))
    assert layout.world_size == 8 and layout.strides == (2, 1)
    assert layout.groups("shard") == [(0, 1), (2, 3), (4, 5), (6, 7)]  # inside each node
    assert layout.groups("replicate") == [(0, 2, 4, 6), (1, 3, 5, 7)]  # across nodes
    assert [layout.coordinate(r) for r in (0, 1, 5, 7)] == [(0, 0), (0, 1), (2, 1), (3, 1)]
    assert layout.group_of(5, "shard") == (4, 5) and layout.group_index(5, "shard") == 2
    assert layout.group_of(5, "replicate") == (1, 3, 5, 7)
    assert str(layout) == "replicate=4 x shard=2"


def test_the_creation_order_is_dimension_by_dimension():
    layout = GridLayout(("dp", "pp", "tp"), (2, 3, 2))
    order = layout.creation_order()
    assert [name for name, _ in order] == ["dp"] * 6 + ["pp"] * 4 + ["tp"] * 6  # N / s_d each
    assert order[6:10] == [("pp", (0, 2, 4)), ("pp", (1, 3, 5)), ("pp", (6, 8, 10)),
                           ("pp", (7, 9, 11))]


@hypothesis_settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 4), min_size=1, max_size=4))
def test_every_grid_matches_torch_and_partitions_the_ranks(shape):
    layout = GridLayout(tuple(f"d{i}" for i in range(len(shape))), tuple(shape))
    ranks = range(layout.world_size)
    for rank in ranks:
        assert layout.rank_at(layout.coordinate(rank)) == rank
    assert [layout.coordinate(r) for r in ranks] == sorted(layout.coordinate(r) for r in ranks)
    for d, name in enumerate(layout.names):
        groups = layout.groups(name)
        assert groups == torch_groups(layout, name)
        assert sorted(r for g in groups for r in g) == list(ranks)  # disjoint, every rank
        for group in groups:
            # members differ only on d, and a member's coordinate on d is its place in the group
            others = {layout.coordinate(r)[:d] + layout.coordinate(r)[d + 1:] for r in group}
            assert len(others) == 1
            assert [layout.coordinate(r)[d] for r in group] == list(range(len(group)))
            assert all(layout.group_of(r, name) == group for r in group)
    assert len(layout.creation_order()) == sum(layout.world_size // s for s in shape)


def test_the_course_layouts():
    """The hierarchical all-reduce's (nodes of g consecutive ranks) and HSDP's, the layouts
    chapter 8 lays out by hand in its text."""
    nodes = node_layout(6, 2)
    assert nodes.names == ("cross", "node") and nodes.shape == (3, 2)
    assert nodes.groups("node") == [(0, 1), (2, 3), (4, 5)]
    assert nodes.groups("cross") == [(0, 2, 4), (1, 3, 5)]
    hsdp = hybrid_layout(8, 2)
    assert hsdp.names == ("replicate", "shard")
    assert hsdp.groups("shard") == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert hsdp.groups("replicate") == [(0, 2, 4, 6), (1, 3, 5, 7)]
    assert hybrid_layout(4, 4).groups("replicate") == [(0,), (1,), (2,), (3,)]
    assert hybrid_layout(4, 1).groups("replicate") == [(0, 1, 2, 3)]


def test_of_infers_one_size():
    assert GridLayout.of(8, replicate=None, shard=2) == GridLayout(("replicate", "shard"), (4, 2))
    assert GridLayout.of(12, dp=2, pp=None, tp=2).shape == (2, 3, 2)
    assert GridLayout.of(4, a=2, b=2).shape == (2, 2)


@pytest.mark.parametrize("make, message", [
    (lambda: GridLayout.of(6, replicate=None, shard=4),
     r"6 rank\(s\) cannot be laid out as a grid of replicate=None, shard=4: the sizes multiply "
     r"to 4, which does not divide 6. Pick shard among the divisors of 6: 1, 2, 3, 6."),
    (lambda: GridLayout.of(8, dp=2, tp=2), "multiply to 4, which is not 8"),
    (lambda: GridLayout.of(8, dp=None, tp=None), "at most one dimension's size"),
    (lambda: GridLayout.of(8, dp=None, tp=0), r"tp=0: a dimension's size must be an int >= 1"),
    (lambda: GridLayout.of(0, dp=None), "world_size must be an int >= 1"),
    (lambda: GridLayout(("a", "a"), (2, 2)), "different non-empty strings"),
    (lambda: GridLayout(("a", "b"), (2,)), "one name per dimension"),
    (lambda: GridLayout(("a",), (True,)), "int >= 1"),
    (lambda: node_layout(4, 3), "Pick node among the divisors of 4: 1, 2, 4"),
    (lambda: GridLayout(("a", "b"), (2, 2)).groups("c"), "no dimension 'c'"),
    (lambda: GridLayout(("a", "b"), (2, 2)).coordinate(4), r"in \[0, 4\)"),
])
def test_a_bad_shape_is_refused_before_any_process_starts(make, message, refuse_processes):
    with refuse_processes(), pytest.raises(ValueError, match=message):
        make()


# --- on real ranks ----------------------------------------------------------------------------

#: The two shapes made on 4 ranks: a 2-D grid, and a 3-D one with a dimension of one.
SHAPES = (GridLayout(("replicate", "shard"), (2, 2)), GridLayout(("dp", "pp", "tp"), (2, 1, 2)))


def members(group: dist.ProcessGroup | None) -> tuple[int, ...]:
    """The global ranks ``group`` connects, found by all-gathering each member's rank over it:
    a collective, so a group is shown by what it connects, not by what it was asked for."""
    mine = torch.tensor([dist.get_rank()])
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, mine, group=group)
    return tuple(int(t) for t in gathered)


def grid_worker(rank: int, world_size: int) -> dict[str, object]:
    """Each shape's grid, the hierarchical all-reduce's groups and HSDP's, each group's members
    measured over it."""
    out: dict[str, object] = {}
    for layout in SHAPES:
        grid = ProcessGrid.build(layout)
        out[str(layout)] = {name: (members(grid[name]), grid.ranks(name))
                            for name in layout.names}
        out[f"{layout} coordinate"] = grid.coordinate
    hier = HierarchicalGroups.build(2)
    out["hierarchical"] = {"node": members(hier.node), "cross": members(hier.cross)}
    hsdp = hybrid_groups(2)
    out["hsdp"] = {"shard": members(hsdp.shard), "replicate": members(hsdp.replicate)}
    made = [0]
    new_group = dist.new_group

    def counted(*args: object, **kwargs: object) -> dist.ProcessGroup:
        made[0] += 1
        return new_group(*args, **kwargs)

    dist.new_group = counted  # a rank's process: nothing to undo
    whole = hybrid_groups(4)  # plain FSDP: no group is made
    out["fsdp"] = (whole.shard is None, whole.replicate is None, made[0])
    return out


@pytest.fixture(scope="module")
def grid_results():
    return launch(grid_worker, 4, echo=False, timeout=120)


def test_every_group_has_the_members_the_layout_says(grid_results, no_leftover_processes):
    for rank, got in enumerate(grid_results):
        for layout in SHAPES:
            assert got[f"{layout} coordinate"] == layout.coordinate(rank)
            for name in layout.names:
                measured, told = got[str(layout)][name]
                assert measured == told == layout.group_of(rank, name), (rank, layout, name)


def test_the_hierarchical_and_hsdp_groups_come_from_the_grid(grid_results):
    for rank, got in enumerate(grid_results):
        nodes, hsdp = node_layout(4, 2), hybrid_layout(4, 2)
        assert got["hierarchical"] == {"node": nodes.group_of(rank, "node"),
                                       "cross": nodes.group_of(rank, "cross")}
        assert got["hsdp"] == {"shard": hsdp.group_of(rank, "shard"),
                               "replicate": hsdp.group_of(rank, "replicate")}
        assert got["fsdp"] == (True, True, 0)


def refused_worker(rank: int, world_size: int) -> list[tuple[str, int]]:
    """(message, groups made before it) of each grid that does not fit its process group."""
    pair = dist.new_group([0, 1])  # every rank makes it; ranks 0 and 1 are in it
    made = [0]
    new_group = dist.new_group

    def counted(*args: object, **kwargs: object) -> dist.ProcessGroup:
        made[0] += 1
        return new_group(*args, **kwargs)

    dist.new_group = counted  # a rank's process: nothing to undo
    attempts = [lambda: ProcessGrid.build(GridLayout(("a", "b"), (3, 1)))]
    if rank < 2:
        attempts.append(lambda: ProcessGrid.build(GridLayout(("a",), (2,)), pair))
    out = []
    for attempt in attempts:
        try:
            attempt()
            out.append(("no error", made[0]))
        except ValueError as err:
            out.append((str(err), made[0]))
    members(None)  # the ranks are still in step
    return out


def test_a_grid_that_does_not_fit_its_group_is_refused_on_every_rank():
    for rank, got in enumerate(launch(refused_worker, 4, echo=False, timeout=60)):
        assert got[0] == ("the grid a=3 x b=1 holds 3 rank(s), but the process group has 4: "
                          "lay out a grid of 4.", 0)
        if rank < 2:
            message, made = got[1]
            assert "dist.new_group needs every rank of the default group" in message
            assert made == 0
