"""Sharded checkpoints (labs.checkpoint) on real ranks: save on 4, resume on 2, 1 and 3.

The oracle: the state gathered on the ranks that saved. After loading on any number of ranks,
every parameter (the tied one, the frozen layer and the buffer included) and every piece of
Adam's state gathered again must be bit-identical to it, and the next step on the new ranks
(the same global batch, split their way) must equal the next step on the 4 ranks that saved
(``assert_close``: the ranks add the same gradients in another order). The shard mapping is
checked against a brute-force map of every element; each broken checkpoint must be refused
on every rank, naming the file, with every parameter and state left as it was.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch

from labs import launch
from labs.checkpoint import (
    INDEX,
    REPLICATED,
    CheckpointError,
    Problem,
    inspect,
    load,
    save,
    shard_file_name,
    shard_pieces,
)
from labs.experiments.checkpoints import (
    CheckpointSettings,
    ResumeResult,
    dcp_available,
    dcp_side_by_side,
    gather_optimizer_state,
    resume_on_ranks,
    save_and_resume,
    train_step,
)
from labs.fsdp import FSDP
from labs.models import TiedNet
from labs.zero import shard_numel

SETTINGS = CheckpointSettings()  # TiedNet 11 x 6: units of 42 and 66 elements; saved on 4
DCP_OK, DCP_WHY = dcp_available()


@pytest.fixture(scope="module")
def resumed(tmp_path_factory: pytest.TempPathFactory) -> ResumeResult:
    """Save on 4 ranks, then load on 2 and on 1 (one launch each)."""
    return save_and_resume(SETTINGS, tmp_path_factory.mktemp("checkpoint") / "run")


# --- the mapping -----------------------------------------------------------------------------


def mapping_errors(fn, numel: int, saved_world_size: int, world_size: int) -> list[str]:
    """What is wrong with ``fn``'s pieces for every new rank, against a brute-force map:
    element e of the flat vector lives at (e // k_old, e % k_old) in the saved shards; a new
    rank's real elements, grouped into maximal runs of one saved shard, are its pieces."""
    k_old = shard_numel(numel, saved_world_size)
    k_new = shard_numel(numel, world_size)
    flat = torch.arange(numel)
    saved = [flat[s * k_old:min((s + 1) * k_old, numel)] for s in range(saved_world_size)]
    errors = []
    for rank in range(world_size):
        mine = range(rank * k_new, min((rank + 1) * k_new, numel))
        want: list[list[int]] = []
        for e in mine:
            s, offset = divmod(e, k_old)
            if want and want[-1][0] == s and want[-1][2] == offset:
                want[-1][2] = offset + 1
            else:
                want.append([s, offset, offset + 1])
        got = fn(numel, saved_world_size, world_size, rank)
        if [tuple(p) for p in got] != [tuple(w) for w in want]:
            errors.append(f"numel {numel} {saved_world_size}->{world_size} rank {rank}: "
                          f"{got} != {want}")
            continue
        values = [saved[s][a:b] for s, a, b in got]
        joined = torch.cat(values) if values else torch.zeros(0, dtype=flat.dtype)
        if not torch.equal(joined, flat[mine.start:mine.stop]):
            errors.append(f"numel {numel} {saved_world_size}->{world_size} rank {rank}: values")
    return errors


CASES = [(numel, n_old, n_new) for numel in [*range(0, 14), 17, 42, 66, 97, 100]
         for n_old in range(1, 7) for n_new in range(1, 7)]


def test_shard_pieces_match_a_brute_force_map_of_every_element():
    """Every (numel, N_old, N_new) of CASES: numel < N, numel not divisible, 0, equal N."""
    errors = [e for case in CASES for e in mapping_errors(shard_pieces, *case)]
    assert not errors, errors[:5]
    assert shard_pieces(3, 4, 2, 1) == [(2, 0, 1)]  # saved: [0],[1],[2],[]; new: [0,1],[2]
    assert shard_pieces(3, 2, 4, 3) == []  # rank 3 of 4 holds only padding
    assert shard_pieces(42, 4, 2, 1) == [(1, 10, 11), (2, 0, 11), (3, 0, 9)]


def test_wrong_mappings_fail_the_brute_force_check():
    def reads_padding(numel, n_old, n, rank):  # forgets that the last shard is short
        k_old, k = shard_numel(numel, n_old), shard_numel(numel, n)
        start, stop = rank * k, (rank + 1) * k
        out = []
        while start < stop:
            s = start // k_old
            end = min(stop, (s + 1) * k_old)
            out.append((s, start - s * k_old, end - s * k_old))
            start = end
        return out

    def new_k_for_offsets(numel, n_old, n, rank):  # cuts the saved shards with k_new
        k = shard_numel(numel, n)
        return [(p[0], rank * k - p[0] * k, rank * k - p[0] * k + p[2] - p[1])
                for p in shard_pieces(numel, n_old, n, rank)]

    assert mapping_errors(reads_padding, 42, 2, 4)  # rank 3 of 4: 2 padding elements
    assert mapping_errors(new_k_for_offsets, 42, 4, 2)
    assert mapping_errors(lambda *a: [], 42, 4, 2)


@pytest.mark.parametrize("args, match", [
    ((-1, 2, 2, 0), "numel"), ((4, 0, 2, 0), "saved_world_size"), ((4, 2, 0, 0), "world_size"),
    ((4, 2, 2, 2), "rank"), ((4, 2, 2, -1), "rank"), ((4, True, 2, 0), "saved_world_size"),
    ((4.0, 2, 2, 0), "numel")])
def test_shard_pieces_refuses_bad_input(args, match):
    with pytest.raises(ValueError, match=match):
        shard_pieces(*args)


# --- save on 4, load on 2 and on 1 ------------------------------------------------------------


def test_each_rank_writes_its_real_elements_and_rank_0_the_index(resumed):
    index = resumed.index
    directory = index.path
    assert index.world_size == 4
    assert [(u.name, u.numel) for u in index.units] == [("hidden", 42), ("root", 66)]
    assert index.units[1].params[0].names == ("embed.weight", "head.weight")  # tied
    assert dict(index.replicated) == {"scale": (6,), "frozen.weight": (6, 6),
                                      "frozen.bias": (6,)}
    assert index.optimizer is not None and index.optimizer.class_name == "Adam"
    assert index.optimizer.param_groups[0][1]["lr"] == SETTINGS.lr
    assert index.extra == {"step": SETTINGS.steps}
    names = sorted(p.name for p in directory.iterdir())
    assert names == sorted([INDEX, REPLICATED, *(shard_file_name(r, 4) for r in range(4))])
    for rank in range(4):
        content = torch.load(directory / shard_file_name(rank, 4), weights_only=True)
        assert (directory / index.files[rank]).stat().st_size == index.file_bytes[rank]
        for unit in index.units:
            k = shard_numel(unit.numel, 4)
            real = min(k, unit.numel - rank * k)  # no padding: hidden's last rank holds 9
            entry = content["units"][unit.name]
            assert entry["param"].shape == (real,)
            assert {k: v.shape for k, v in entry["state"].items()} == {
                "exp_avg": (real,), "exp_avg_sq": (real,)}
    raw = json.loads((directory / INDEX).read_text())
    assert raw["version"] == 1 and raw["world_size"] == 4
    written = [r.bytes_written for r in resumed.saves]
    assert written[1] == index.file_bytes[1]
    assert written[0] == index.file_bytes[0] + index.replicated_bytes + (
        directory / INDEX).stat().st_size
    # the tensors saved and the tensors read back on any number of ranks are the same bytes
    tensors = sum(r.tensor_bytes_written for r in resumed.saves)
    assert tensors > 0
    for reports in resumed.loads.values():
        assert sum(r.bytes_read for r in reports) == tensors


@pytest.mark.parametrize("world_size", [2, 1])
def test_loading_on_fewer_ranks_is_bit_identical_to_what_was_saved(resumed, world_size):
    saved = resumed.saves[0]
    for report in resumed.loads[world_size]:
        assert report.loaded.keys() == saved.saved.keys()
        for name, value in saved.saved.items():
            assert torch.equal(report.loaded[name], value), name
        assert report.loaded_optimizer.keys() == saved.saved_optimizer.keys()
        assert {"hidden.step", "hidden.exp_avg", "root.exp_avg_sq"} <= set(
            report.loaded_optimizer)
        for name, value in saved.saved_optimizer.items():
            assert torch.equal(report.loaded_optimizer[name], value), name
    # the fresh model's buffer was 1001: it came from the checkpoint
    assert torch.equal(resumed.loads[world_size][0].loaded["scale"], torch.ones(6))
    assert resumed.mismatches(world_size) == []


@pytest.mark.parametrize("world_size", [2, 1])
def test_the_next_step_after_loading_equals_continuing_on_4_ranks(resumed, world_size):
    want = resumed.saves[0].continued
    for report in resumed.loads[world_size]:
        for name in want:
            torch.testing.assert_close(report.next_step[name], want[name], msg=name)
        assert not torch.equal(report.next_step["hidden.weight"],
                               resumed.saves[0].saved["hidden.weight"])  # it did step


def test_the_verdicts_catch_a_wrong_load(resumed):
    """ResumeResult's checks fail when one element of a loaded tensor is off."""
    good = resumed.loads[2][0]
    bad_param = {**good.loaded, "hidden.bias": good.loaded["hidden.bias"].clone()}
    bad_param["hidden.bias"][-1] += 1e-7
    bad_state = {**good.loaded_optimizer, "root.step": good.loaded_optimizer["root.step"] + 1}
    broken = dataclasses.replace(good, loaded=bad_param, loaded_optimizer=bad_state,
                                 next_step={**good.next_step,
                                            "embed.weight": good.next_step["embed.weight"] + 1})
    wrong = dataclasses.replace(resumed, loads={2: (broken, *resumed.loads[2][1:])})
    assert wrong.mismatches(2) == ["hidden.bias", "root.step"]
    assert wrong.next_step_difference(2) >= 1.0 > resumed.next_step_difference(2)
    assert "NO" in wrong.table() and "NO" not in resumed.table()


def test_each_rank_reads_as_much_as_it_will_hold(resumed):
    per_element = 4 * 3  # fp32 parameter, exp_avg, exp_avg_sq
    for world_size, reports in resumed.loads.items():
        for r in reports:
            real = sum(min(shard_numel(n, world_size), n - r.rank * shard_numel(n, world_size))
                       for n in (42, 66))
            assert r.bytes_read == real * per_element
        assert sum(r.bytes_read for r in reports) == (42 + 66) * per_element
    assert [r.files_read for r in resumed.loads[2]] == [2, 3]
    assert [r.files_read for r in resumed.loads[1]] == [4]


def test_units_smaller_than_the_world_size_and_an_odd_world_size(tmp_path):
    """vocab 2, dim 1: units of 2 elements, so ranks 2 and 3 of 4 hold only padding (their
    files hold empty tensors); loaded on 3 ranks, rank 2 gets padding only again."""
    settings = CheckpointSettings(vocab=2, dim=1, load_world_sizes=(3,))
    result = save_and_resume(settings, tmp_path / "tiny")
    content = torch.load(tmp_path / "tiny" / shard_file_name(3, 4), weights_only=True)
    assert all(entry["param"].numel() == 0 for entry in content["units"].values())
    assert result.mismatches(3) == []
    for report in result.loads[3]:
        for name, value in result.saves[0].continued.items():
            torch.testing.assert_close(report.next_step[name], value, msg=name)
    assert [r.bytes_read for r in result.loads[3]] == [24, 24, 0]


# --- broken checkpoints ----------------------------------------------------------------------


def state_of(model, optimizer):
    return {**model.gather_full_params(), **{f"opt.{k}": v for k, v in
                                             gather_optimizer_state(model, optimizer).items()}}


def refusal_worker(rank, world_size, cases, good):
    """For each (path, settings, optimizer name): a trained model and optimizer, then a load
    that must fail; report the error and whether anything changed. Then a load while a unit
    is gathered (refused), and a load of ``good`` into an optimizer built with another lr
    (restored), saved back on this world size (the stale shard files must go)."""
    out = []
    for path, settings, opt_name in cases:
        model = FSDP(settings.model(rank, fresh=True))
        cls = torch.optim.Adam if opt_name == "adam" else torch.optim.SGD
        optimizer = cls(model.parameters(), lr=settings.lr)
        train_step(model, optimizer, settings, 0, rank, world_size)
        before = state_of(model, optimizer)
        lr = optimizer.param_groups[0]["lr"]
        try:
            load(path, model, optimizer)
            error = None
        except CheckpointError as e:
            error = (e.problem, e.path, str(e))
        after = state_of(model, optimizer)
        unchanged = before.keys() == after.keys() and all(
            torch.equal(before[k], after[k]) for k in before)
        out.append((error, unchanged and optimizer.param_groups[0]["lr"] == lr))
    model = FSDP(SETTINGS.model(rank, fresh=True))
    optimizer = torch.optim.Adam(model.parameters(), lr=123.0)
    model.unshard(model.units[0])  # as inside that unit's forward
    try:
        load(good, model, optimizer)
        mid_step = None
    except CheckpointError as e:
        mid_step = e.problem
    model.reshard(model.units[0])
    load(good, model, optimizer)
    save(good, model, optimizer)
    return out, mid_step, optimizer.param_groups[0]["lr"]


def broken_copies(source: Path, tmp_path: Path) -> dict[str, Path]:
    copies = {}
    for name in ("missing", "truncated", "corrupt", "no_index", "good"):
        copies[name] = tmp_path / name
        shutil.copytree(source, copies[name])
    (copies["missing"] / shard_file_name(3, 4)).unlink()  # only rank 1 of 2 reads it
    truncated = copies["truncated"] / shard_file_name(2, 4)  # rank 1 of 2 again
    truncated.write_bytes(truncated.read_bytes()[:1000])
    corrupt = copies["corrupt"] / shard_file_name(0, 4)  # rank 0 of 2 only: same size
    data = corrupt.read_bytes()
    corrupt.write_bytes(data[:-300] + bytes(300))  # the zip's central directory, zeroed
    (copies["no_index"] / INDEX).unlink()
    return copies


def test_a_broken_checkpoint_is_refused_on_every_rank_before_anything_changes(
        resumed, tmp_path, no_leftover_processes):
    copies = broken_copies(resumed.index.path, tmp_path)
    other_model = dataclasses.replace(SETTINGS, dim=7)
    cases = [  # (path, settings, optimizer, rank that finds it, problem, file named)
        (copies["missing"], SETTINGS, "adam", 1, Problem.MISSING_FILE, shard_file_name(3, 4)),
        (copies["truncated"], SETTINGS, "adam", 1, Problem.CORRUPT_FILE, shard_file_name(2, 4)),
        (copies["corrupt"], SETTINGS, "adam", 0, Problem.CORRUPT_FILE, shard_file_name(0, 4)),
        (copies["no_index"], SETTINGS, "adam", None, Problem.MISSING_INDEX, INDEX),
        (copies["good"], other_model, "adam", None, Problem.OTHER_MODEL, INDEX),
        (copies["good"], SETTINGS, "sgd", None, Problem.OTHER_OPTIMIZER, INDEX),
    ]
    results = launch(refusal_worker, 2, args=([(str(p), s, o) for p, s, o, *_ in cases],
                                              str(copies["good"])), echo=False, timeout=120)
    for i, (path, _, _, finder, problem, file) in enumerate(cases):
        for rank, (per_rank, _, _) in enumerate(results):
            error, unchanged = per_rank[i]
            assert unchanged, f"case {i} rank {rank}: the model or optimizer changed"
            assert error is not None, f"case {i} rank {rank}: no error"
            found, named, message = error
            if finder is None or rank == finder:
                assert found is problem, (i, rank, message)
                assert named == str(path / file) and str(path / file) in message, message
            else:
                assert found is Problem.OTHER_RANK, (i, rank, message)
                assert f"failed on rank {finder}" in message and file in message, message
    other_model, other_optimizer = results[0][0][4][0][2], results[0][0][5][0][2]
    assert "unit 'hidden' has 42 elements in the checkpoint, 56 here" in other_model
    assert "of optimizer class Adam, and this optimizer is a SGD" in other_optimizer
    assert [mid_step for _, mid_step, _ in results] == [Problem.MID_STEP] * 2
    assert [lr for _, _, lr in results] == [SETTINGS.lr] * 2  # restored from the index
    # the good copy, saved again on 2 ranks: 2 shard files, the 4-rank ones removed
    resaved = inspect(copies["good"])
    assert resaved.world_size == 2
    assert sorted(p.name for p in copies["good"].glob("shard-*")) == [
        shard_file_name(0, 2), shard_file_name(1, 2)]


def test_inspect_refuses_a_broken_checkpoint_before_any_process_starts(
        resumed, tmp_path, refuse_processes):
    copies = broken_copies(resumed.index.path, tmp_path)
    expected = [("missing", Problem.MISSING_FILE, shard_file_name(3, 4)),
                ("truncated", Problem.CORRUPT_FILE, shard_file_name(2, 4)),
                ("no_index", Problem.MISSING_INDEX, INDEX)]
    with refuse_processes():
        for name, problem, file in expected:
            with pytest.raises(CheckpointError, match="copy|save again|Give the directory"
                               ) as caught:
                resume_on_ranks(SETTINGS, copies[name], 2)
            assert caught.value.problem is problem
            assert str(copies[name] / file) in str(caught.value)
        with pytest.raises(CheckpointError, match="directory does not exist"):
            inspect(tmp_path / "nowhere")
        (copies["good"] / INDEX).write_text("{not json")
        with pytest.raises(CheckpointError, match="not a readable") as caught:
            inspect(copies["good"])
        assert caught.value.problem is Problem.BAD_INDEX
        with pytest.raises(ValueError, match="cannot be split into 5"):
            resume_on_ranks(SETTINGS, resumed.index.path, 5)
    assert inspect(resumed.index.path).world_size == 4


@pytest.mark.parametrize("changes, match", [
    ({"batch": 8, "load_world_sizes": (3,)}, "cannot be split into 3"),
    ({"steps": 0}, "steps must be a positive int"),
    ({"lr": -1.0}, "lr must be a positive number"),
    ({"load_world_sizes": ()}, "non-empty tuple"),
    ({"save_world_size": 64}, "world size must be an int in 1..32"),
])
def test_settings_refuse_bad_values(changes, match):
    with pytest.raises(ValueError, match=match):
        CheckpointSettings(**changes)


# --- torch.distributed.checkpoint, side by side ----------------------------------------------


@pytest.mark.skipif(not DCP_OK, reason=DCP_WHY)
def test_torch_dcp_saves_a_fully_shard_model_on_4_and_loads_it_on_2(tmp_path):
    result = dcp_side_by_side(SETTINGS, tmp_path / "dcp", load_world_size=2)
    assert not result.skipped
    saved, loaded = result.saves[0], result.loads[0]
    assert {"embed.weight", "head.weight", "frozen.weight", "scale"} <= saved.state.keys()
    assert {"hidden.weight.exp_avg", "embed.weight.step"} <= saved.optimizer_state.keys()
    assert result.mismatches() == []
    assert torch.equal(loaded.state["scale"], torch.ones(6))  # the fresh model had 1001
    assert all(r.bytes_written > 0 for r in result.saves)
    wrong = dataclasses.replace(result, loads=(dataclasses.replace(
        loaded, state={**loaded.state, "scale": loaded.state["scale"] * 2}),))
    assert wrong.mismatches() == ["scale"]


def test_dcp_side_by_side_says_why_where_this_torch_cannot(tmp_path, refuse_processes):
    if DCP_OK:
        assert DCP_WHY.startswith("torch.distributed.checkpoint with fully_shard from")
        return
    with refuse_processes():
        result = dcp_side_by_side(SETTINGS, tmp_path / "dcp", load_world_size=2)
    assert result.skipped == DCP_WHY and result.mismatches() == []


def hybrid_worker(rank: int, world_size: int, path: str) -> bool:
    model = FSDP(TiedNet(11, 6, 0), shard_size=2)
    try:
        save(path, model, torch.optim.Adam(model.parameters()))
    except CheckpointError as err:
        return err.problem is Problem.HYBRID and "shard_size=None" in str(err)
    return False


def test_an_hsdp_model_is_refused_on_every_rank_not_saved_wrong(tmp_path):
    assert launch(hybrid_worker, 4, args=(str(tmp_path / "c"),), echo=False) == [True] * 4
