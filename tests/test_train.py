"""Chapter 5's training lab on real ranks: the loss falls, the three wrappers agree, gradient
accumulation equals a larger batch, a resumed run equals an uninterrupted one, and the CLI
(local launch and torchrun) prints the same curve and refuses bad settings up front."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from labs import RankError, launch
from labs.__main__ import main
from labs.train import (
    CHARS,
    TEXT,
    TinyTransformer,
    TrainConfig,
    TrainResult,
    char_windows,
    check_resume,
    train_worker,
)
from labs.wrappers import DDP_WRAPPERS, Wrapper


def train(world_size: int = 2, **settings: object) -> list[TrainResult]:
    # A generous timeout: many test workers at once can oversubscribe a machine's cores.
    return launch(train_worker, world_size, args=(TrainConfig(**settings),), echo=False,
                  timeout=300)


def assert_ranks_agree(results: list[TrainResult]) -> None:
    for r in results[1:]:
        assert r.losses == results[0].losses  # all-reduced: one curve for every rank
        assert r.checksum == results[0].checksum  # averaged gradients keep replicas equal


def test_windows_are_next_character_pairs():
    x, y = char_windows(seq_len=5)[len(TEXT) - 2]  # wraps around the end of the text
    text = "".join(CHARS[i] for i in x)
    assert text == (TEXT + TEXT)[len(TEXT) - 2 : len(TEXT) + 3]
    assert torch.equal(x[1:], y[:-1])
    assert len(char_windows(seq_len=5)) == len(TEXT)


def test_model_is_tied_and_built_from_the_seed_alone():
    model = TrainConfig(seed=3).model()
    assert isinstance(model, TinyTransformer)
    assert model.head.weight is model.tok_emb.weight
    torch.manual_seed(123)  # the global RNG plays no part
    again = TrainConfig(seed=3).model()
    for a, b in zip(model.parameters(), again.parameters(), strict=True):
        assert torch.equal(a, b)
    assert not torch.equal(model.tok_emb.weight, TrainConfig(seed=4).model().tok_emb.weight)


def test_loss_goes_down_on_two_ranks():
    results = train(steps=60)
    assert_ranks_agree(results)
    losses = results[0].losses
    assert len(losses) == 60 and results[0].start_step == 0
    assert losses[0] > 3.0  # about ln(vocab) at initialisation
    assert losses[-1] < 0.5 * losses[0]
    assert sum(losses[-10:]) < sum(losses[:10])
    assert results[0].tokens == 60 * 8 * 16  # steps * batch * seq_len, per rank


def test_three_wrappers_give_the_same_curve():
    curves = {w: train(steps=5, wrapper=w) for w in DDP_WRAPPERS}
    for wrapper, results in curves.items():
        assert_ranks_agree(results)
        torch.testing.assert_close(results[0].losses, curves[Wrapper.TORCH_DDP][0].losses,
                                   msg=f"{wrapper} differs from torch DDP")
        assert results[0].checksum == pytest.approx(curves[Wrapper.TORCH_DDP][0].checksum, rel=1e-6)


@pytest.mark.parametrize("wrapper", [Wrapper.DDP, Wrapper.TORCH_DDP])
def test_accumulating_two_micro_batches_equals_one_batch_twice_as_large(wrapper):
    """The same windows per optimizer step (8 steps: past the end of the first epoch), split in
    two halves whose losses are halved: the same gradient, up to float rounding. With DDP a
    second backward without no_sync() would raise, so this also shows no_sync() is used."""
    big = train(steps=8, batch_size=8, accumulation=1, wrapper=wrapper)
    split = train(steps=8, batch_size=4, accumulation=2, wrapper=wrapper)
    assert_ranks_agree(split)
    # The losses are float32 results handed back as Python floats: compare them at float32's
    # tolerance, not float64's (the two summation orders differed by 1.5e-7 relative on an
    # AMD EPYC, beyond float64's 1e-7).
    torch.testing.assert_close(split[0].losses, big[0].losses, rtol=1.3e-6, atol=1e-5)
    # Adam scales each gradient element by its own running size, so where an element is
    # near zero, a rounding difference of the two summation orders can move that parameter
    # by up to lr in a step; how often depends on the CPU's kernels (a 16-core machine
    # moved the sum of the parameters by 4e-4, with lr = 1e-2). The curves above are the
    # claim; the checksum only has to stay within one lr.
    assert split[0].checksum == pytest.approx(big[0].checksum, abs=TrainConfig().lr)
    assert split[0].tokens == big[0].tokens


def test_resumed_run_equals_an_uninterrupted_one(tmp_path):
    """10 + 10 steps (resumed in the middle of the second epoch: 6 steps per epoch) against 20."""
    path = tmp_path / "ckpt" / "run.pt"
    whole = train(steps=20)
    first = train(steps=10, checkpoint=str(path), checkpoint_every=5)
    assert [r.saved_steps for r in first] == [(5, 10), ()]  # rank 0 alone writes
    second = train(steps=20, checkpoint=str(path), resume=True)
    assert_ranks_agree(second)
    assert second[0].start_step == 10 and second[0].steps == 10
    assert [r.saved_steps for r in second] == [(20,), ()]
    assert first[0].losses == whole[0].losses[:10]
    torch.testing.assert_close(second[0].losses, whole[0].losses[10:], rtol=0, atol=0)
    assert second[0].checksum == whole[0].checksum
    assert [p.name for p in path.parent.iterdir()] == ["run.pt"]  # no partial file left
    state = torch.load(path, weights_only=True)
    assert state["step"] == 20 and not any(k.startswith("module.") for k in state["model"])


def test_resume_beyond_the_checkpoint_is_refused(tmp_path):
    path = tmp_path / "run.pt"
    train(steps=3, checkpoint=str(path))
    with pytest.raises(RankError, match="past steps=2") as error:
        train(steps=2, checkpoint=str(path), resume=True)
    assert error.value.exc_type == "ValueError"


def test_resume_with_other_settings_is_refused(tmp_path, refuse_processes, capsys):
    """Another world size or seed would read other samples than the uninterrupted run."""
    path = str(tmp_path / "run.pt")
    train(steps=2, checkpoint=path)
    with refuse_processes():
        with pytest.raises(ValueError, match=r"seed=0 \(now 1\)"):
            check_resume(TrainConfig(steps=4, seed=1, checkpoint=path, resume=True),
                         world_size=2)
        with pytest.raises(SystemExit) as exit_:  # the CLI refuses it before any rank starts
            main(["ddp", "--world-size", "1", "--steps", "4", "--checkpoint", path,
                  "--resume"])
    assert exit_.value.code == 2
    assert "world_size=2 (now 1)" in capsys.readouterr().err
    with pytest.raises(RankError, match=r"world_size=2 \(now 1\)"):  # so does every rank
        train(1, steps=4, checkpoint=path, resume=True)
    check_resume(TrainConfig(steps=4, lr=0.5, checkpoint=path, resume=True), world_size=2)


@pytest.mark.parametrize(("settings", "message"), [
    ({"steps": 0}, "steps must be a positive"),
    ({"accumulation": 0}, "accumulation must be a positive"),
    ({"lr": -1.0}, "lr must be a positive"),
    ({"d_model": 30, "n_heads": 4}, "multiple of n_heads"),
    ({"resume": True}, "need a checkpoint file"),
    ({"checkpoint": "x.pt", "checkpoint_every": 0}, "at least 1 step"),
])
def test_config_refuses_bad_settings(settings, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig(**settings)


def test_batch_larger_than_a_rank_share_is_refused():
    with pytest.raises(ValueError, match="fewer than one step"):
        TrainConfig(batch_size=32, accumulation=2).steps_per_epoch(world_size=2)
    assert TrainConfig(batch_size=8).steps_per_epoch(world_size=2) == len(TEXT) // 2 // 8


def _table(stdout: str) -> list[tuple[int, float]]:
    rows = [line.split() for line in stdout.splitlines() if line.strip()[:1].isdigit()]
    return [(int(step), float(loss)) for step, loss in rows]


def _cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "labs", *args], capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.slow  # chapter 5's nbval runs torchrun and compares its final loss with the notebook's
def test_cli_and_torchrun_print_the_same_curve():
    local = _cli("ddp", "--world-size", "2", "--steps", "5")
    assert local.returncode == 0, local.stderr
    assert "final loss" in local.stdout and "tokens/s on 2 ranks" in local.stdout
    rows = _table(local.stdout)
    assert [step for step, _ in rows] == [1, 2, 3, 4, 5]
    torchrun = Path(sys.executable).with_name("torchrun")
    under = subprocess.run(
        [str(torchrun), "--standalone", "--nproc_per_node=2", "-m", "labs", "ddp", "--steps", "5"],
        capture_output=True, text=True, timeout=180
    )
    assert under.returncode == 0, under.stderr
    assert under.stdout.count("final loss") == 1  # printed by rank 0 only
    assert [s for s, _ in _table(under.stdout)] == [s for s, _ in rows]
    torch.testing.assert_close([loss for _, loss in _table(under.stdout)],
                               [loss for _, loss in rows])


def test_cli_refuses_bad_settings_before_any_rank_starts():
    out = _cli("ddp", "--world-size", "2", "--steps", "0")
    assert out.returncode == 2
    assert "steps must be a positive" in out.stderr
    assert "Traceback" not in out.stderr and "[rank" not in out.stdout


@pytest.mark.parametrize(("argv", "message"), [
    (["--accumulation", "0"], "accumulation must be a positive"),
    (["--batch-size", "64"], "fewer than one step"),
    (["--resume"], "need a checkpoint file"),
    (["--resume", "--checkpoint", "no/such/file.pt"], "no checkpoint at"),
])
def test_cli_messages(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["ddp", "--world-size", "2", *argv])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err

