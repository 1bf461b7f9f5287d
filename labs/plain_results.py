"""Rank results as plain data, for a caller that must not trust its ranks.

:func:`labs.launcher.launch` brings a rank's return value back by unpickling it, which runs
whatever the pickle says: fine for a learner's own notebook, wrong for an exercise check,
whose ranks run the learner's code and whose verdict must not be theirs to write. A rank can
reach its pipe to the launcher and send any bytes; a tensor's class, or an object's
``__reduce__``, would run in the checking process. So :func:`launch` with ``result_types``
sends each rank's report as JSON written by :func:`encode` and read by :func:`decode`, which
rebuilds only:

* ``None``, bools, ints, floats, strings, lists, tuples and dicts of these;
* tensors, always a plain ``torch.Tensor`` of a numeric dtype, rebuilt from their bytes;
* instances of the dataclasses and enums the caller names, built field by field without
  calling any of their code (the caller's own classes: what its workers return).

Anything else is refused with a message naming it, on the rank (it cannot be sent) or on
the launcher (it was not what :func:`encode` writes).
"""

from __future__ import annotations

import base64
import dataclasses
import enum
import json
import math
from collections.abc import Iterable
from typing import Any

import torch

#: The dtypes a tensor may come back as, by name.
DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool)}
#: The longest report a rank may send (bytes of JSON).
MAX_BYTES = 64 << 20
_TAGS = ("tensor", "tuple", "dict", "dataclass", "enum", "float")


class NotPlain(ValueError):
    """A value that :func:`encode` cannot send, or bytes that :func:`decode` will not read."""


def _name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def encode(value: Any) -> bytes:
    """``value`` as JSON bytes (on the rank). Raises :class:`NotPlain` naming what it cannot
    send."""
    return json.dumps(_to_json(value, "the result"), allow_nan=False).encode()


def _to_json(value: Any, where: str) -> Any:
    if isinstance(value, enum.Enum):  # before int and str: an IntEnum is both
        return {"enum": [_name(type(value)), _to_json(value.value, where)]}
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, (int, str)):
        return int(value) if isinstance(value, int) else str(value)
    if isinstance(value, float):
        value = float(value)
        return value if math.isfinite(value) else {"float": repr(value)}
    if isinstance(value, torch.Tensor):
        tensor = torch.Tensor.as_subclass(value.detach().cpu(), torch.Tensor).contiguous()
        dtype = str(tensor.dtype).removeprefix("torch.")
        if dtype not in DTYPES:
            raise NotPlain(f"{where} is a tensor of dtype {tensor.dtype}, which cannot be sent")
        raw = tensor.reshape(-1).view(torch.uint8).numpy().tobytes()
        return {"tensor": [dtype, list(tensor.shape), base64.b64encode(raw).decode()]}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {"dataclass": [_name(type(value)), {
            f.name: _to_json(getattr(value, f.name), f"{where}.{f.name}")
            for f in dataclasses.fields(value)}]}
    if isinstance(value, list):
        return [_to_json(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, tuple):
        return {"tuple": [_to_json(v, f"{where}[{i}]") for i, v in enumerate(value)]}
    if isinstance(value, dict):
        return {"dict": [[_to_json(k, f"a key of {where}"), _to_json(v, f"{where}[{k!r}]")]
                         for k, v in value.items()]}
    raise NotPlain(f"{where} is a {type(value).__name__}; a check's rank returns tensors, "
                   "numbers, strings, lists, tuples, dicts and the check's own dataclasses")


def decode(data: bytes, types: Iterable[type]) -> Any:
    """The value :func:`encode` wrote (on the launcher), its dataclasses and enums only those
    of ``types``. Raises :class:`NotPlain` for anything else."""
    if len(data) > MAX_BYTES:
        raise NotPlain(f"a report of {len(data)} bytes (at most {MAX_BYTES})")
    try:
        tree = json.loads(data)
    except (ValueError, UnicodeDecodeError) as err:
        raise NotPlain(f"not JSON ({err})") from err
    allowed = {_name(t): t for t in types}
    return _from_json(tree, allowed, depth=0)


def _from_json(tree: Any, allowed: dict[str, type], depth: int) -> Any:
    if depth > 64:
        raise NotPlain("nested more than 64 deep")
    if tree is None or isinstance(tree, (bool, int, str)):
        return tree
    if isinstance(tree, float):
        return tree
    if isinstance(tree, list):
        return [_from_json(v, allowed, depth + 1) for v in tree]
    if not isinstance(tree, dict) or len(tree) != 1 or next(iter(tree)) not in _TAGS:
        raise NotPlain(f"an object that is none of {', '.join(_TAGS)}")
    ((tag, body),) = tree.items()
    if tag == "float":
        if body not in ("nan", "inf", "-inf"):
            raise NotPlain(f"a float written {body!r}")
        return float(body)
    if tag == "tuple":
        return tuple(_from_json(v, allowed, depth + 1) for v in _list(body, tag))
    if tag == "dict":
        pairs = [_list(p, tag) for p in _list(body, tag)]
        if any(len(p) != 2 for p in pairs):
            raise NotPlain("a dict entry that is not a [key, value] pair")
        return {_key(_from_json(k, allowed, depth + 1)): _from_json(v, allowed, depth + 1)
                for k, v in pairs}
    if tag == "tensor":
        return _tensor(body)
    name, content = _list(body, tag)
    cls = allowed.get(name) if isinstance(name, str) else None
    if cls is None:
        raise NotPlain(f"a {tag} of class {name!r}, which is not among the results expected")
    if tag == "enum":
        if not issubclass(cls, enum.Enum):
            raise NotPlain(f"{name} is not an enum")
        try:
            return cls(_from_json(content, allowed, depth + 1))
        except ValueError as err:
            raise NotPlain(str(err)) from err
    if not (dataclasses.is_dataclass(cls) and isinstance(content, dict)):
        raise NotPlain(f"{name} is not a dataclass, or its fields are not an object")
    fields = [f.name for f in dataclasses.fields(cls)]
    if sorted(content) != sorted(fields):
        raise NotPlain(f"{name} with fields {sorted(content)}, not {sorted(fields)}")
    instance = object.__new__(cls)  # no __init__, __post_init__ or __setattr__ of theirs
    for field in fields:
        object.__setattr__(instance, field, _from_json(content[field], allowed, depth + 1))
    return instance


def _list(body: Any, tag: str) -> list[Any]:
    if not isinstance(body, list):
        raise NotPlain(f"a {tag} that is not a list")
    if tag in ("dataclass", "enum") and len(body) != 2:
        raise NotPlain(f"a {tag} that is not [class, content]")
    return body


def _key(key: Any) -> Any:
    try:
        hash(key)
    except TypeError as err:
        raise NotPlain("a dict key that cannot be hashed") from err
    return key


def _tensor(body: Any) -> torch.Tensor:
    if not (isinstance(body, list) and len(body) == 3 and body[0] in DTYPES
            and isinstance(body[1], list) and isinstance(body[2], str)
            and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                    for d in body[1])):
        raise NotPlain("a tensor that is not [dtype, shape, base64 bytes]")
    dtype, shape = DTYPES[body[0]], body[1]
    try:
        raw = base64.b64decode(body[2], validate=True)
    except ValueError as err:
        raise NotPlain(f"a tensor whose bytes are not base64 ({err})") from err
    size = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if len(raw) != size:
        raise NotPlain(f"a tensor of shape {shape} and dtype {body[0]} with {len(raw)} bytes")
    flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(
        0, dtype=torch.uint8)
    return flat.view(dtype).reshape(shape).clone()
