"""Results a caller that distrusts its ranks reads without unpickling (labs.plain_results), and
``launch(..., result_types=...)`` with real ranks: a rank that writes a pickle on its pipe to
the launcher, or returns a tensor subclass, runs nothing in the caller."""

from __future__ import annotations

import contextlib
import enum
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from labs.launcher import RankError, launch
from labs.plain_results import NotPlain, decode, encode


class Colour(enum.Enum):
    RED = "red"


@dataclass(frozen=True)
class Record:
    name: str
    values: torch.Tensor
    colour: Colour


class Liar(torch.Tensor):
    """A tensor that agrees with anything."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in ("equal", "allclose"):
            return True
        return super().__torch_function__(func, types, args, kwargs or {})


def test_plain_values_come_back_as_they_were_sent() -> None:
    value = {
        "record": Record("a", torch.arange(6, dtype=torch.float32).reshape(2, 3), Colour.RED),
        3: (1, 2.5, None, True, "x", [math.inf, -math.inf]),
        "tensors": [torch.tensor(7, dtype=torch.int64), torch.zeros(0, 4, dtype=torch.bfloat16),
                    torch.tensor([True, False])],
    }
    back = decode(encode(value), (Record, Colour))
    assert back["record"].name == "a" and back["record"].colour is Colour.RED
    assert torch.equal(back["record"].values, value["record"].values)
    assert back[3][:5] == (1, 2.5, None, True, "x") and back[3][5] == [math.inf, -math.inf]
    for got, sent in zip(back["tensors"], value["tensors"], strict=True):
        assert got.dtype == sent.dtype and got.shape == sent.shape and torch.equal(got, sent)
    assert math.isnan(decode(encode(math.nan), ()))


def test_a_tensor_subclass_comes_back_a_plain_tensor_with_its_values() -> None:
    liar = torch.tensor([1.0, 2.0]).as_subclass(Liar)
    assert torch.equal(liar, torch.zeros(2))  # what it would tell a check
    back = decode(encode(liar), ())
    assert type(back) is torch.Tensor and not torch.equal(back, torch.zeros(2))


@pytest.mark.parametrize("data, why", [
    (encode(Record("a", torch.zeros(1), Colour.RED)), "not among the results expected"),
    (b'{"tensor": ["float32", [2], "AAAA"]}', "with 3 bytes"),
    (b'{"tensor": ["complex64", [1], ""]}', "not [dtype, shape, base64 bytes]"),
    (b'{"pickle": "gASV"}', "none of tensor"),
    (b'{"float": "1e999"}', "a float written"),
    (b'\x80\x04K\x01.', "not JSON"),
    (b"[" * 100 + b"]" * 100, "nested more than 64 deep"),
])
def test_anything_else_is_refused_naming_it(data, why) -> None:
    with pytest.raises(NotPlain, match=re.escape(why)):
        decode(data, (Colour,))


def test_a_dataclass_must_have_exactly_its_fields() -> None:
    data = encode(Record("a", torch.zeros(1), Colour.RED)).replace(b'"name"', b'"nom"')
    with pytest.raises(NotPlain, match="with fields"):
        decode(data, (Record, Colour))


def test_a_rank_cannot_send_what_encode_refuses() -> None:
    with pytest.raises(NotPlain, match=r"the result\[0\] is a set"):
        encode([{1}])


# --- with real ranks ----------------------------------------------------------------------------


class _Payload:
    """Unpickled, it creates a file: a stand-in for any code a pickle may run."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (Path.touch, (Path(self.path),))


def forge_a_report(rank, world_size, marker):
    """A rank that finds its pipe to the launcher and sends a pickle of its own first."""
    import pickle

    frame = sys._getframe()
    while "conn" not in frame.f_locals:
        frame = frame.f_back
    frame.f_locals["conn"].send_bytes(pickle.dumps(("ok", _Payload(marker))))
    return "an honest result, too late"


@pytest.mark.parametrize("plain", [False, True], ids=["pickled results", "plain results"])
def test_a_forged_report_runs_nothing_in_the_caller_of_a_plain_launch(tmp_path, plain) -> None:
    marker = tmp_path / "ran-in-the-caller"
    if not plain:  # the default trusts the ranks, as a learner's own notebook does
        with contextlib.suppress(Exception):
            launch(forge_a_report, 1, args=(str(marker),), backend="gloo", echo=False)
        assert marker.exists()
        return
    with pytest.raises(RankError, match="not plain data"):
        launch(forge_a_report, 1, args=(str(marker),), backend="gloo", echo=False,
               result_types=())
    assert not marker.exists()


def return_a_liar(rank, world_size):
    return torch.full((3,), float(rank)).as_subclass(Liar)


def test_a_tensor_subclass_from_a_rank_comes_back_plain() -> None:
    (value,) = launch(return_a_liar, 1, backend="gloo", echo=False, result_types=())
    assert type(value) is torch.Tensor and torch.equal(value, torch.zeros(3))
    assert not torch.equal(value, torch.ones(3))
