"""Data between the grader and the process that runs a learner's code, as JSON that builds data
and nothing else.

The grader calls a learner's function in another process (:mod:`~dpcourse.harness.exercises.judge`)
and reads back what it returned. Unpickling that would let the learner's process run code in the
grader's; :func:`decode` builds only ``None``, booleans, numbers, strings, bytes, lists, tuples,
dicts, sets, torch tensors, torch dtypes and NumPy arrays of numbers, from JSON. Anything else a
function returns (a module, a generator, an object of its own class) cannot be sent:
:func:`encode` raises :class:`NotData`, naming the type.

Chapter 0: the exercise checks of the whole course (grading).
"""

from __future__ import annotations

import base64
import json
import math
from typing import Any

import numpy as np
import torch

__all__ = ["NotData", "encode", "decode", "is_data"]

MAX_DEPTH = 50  # nesting deeper than this is not an answer to any exercise


class NotData(TypeError):
    """A value that is not data: it cannot cross between the learner's process and the grader's."""


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _to_json(value: Any, depth: int) -> Any:
    if depth > MAX_DEPTH:
        raise NotData(f"values nested more than {MAX_DEPTH} deep")
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {"float": repr(value)}
    if isinstance(value, np.generic) and value.dtype.kind in "biuf":
        return _to_json(value.item(), depth)
    if isinstance(value, (bytes, bytearray)):
        return {"bytes": base64.b64encode(bytes(value)).decode()}
    if isinstance(value, torch.dtype):
        return {"dtype": _dtype_name(value)}
    if isinstance(value, torch.Tensor):
        if value.layout != torch.strided or value.is_quantized or value.is_nested:
            raise NotData(f"a {value.layout} tensor (send a dense one)")
        t = value.detach().to("cpu").contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        return {"tensor": base64.b64encode(raw).decode(), "dtype": _dtype_name(t.dtype),
                "shape": list(t.shape)}
    if isinstance(value, np.ndarray):
        if value.dtype.kind not in "biuf":
            raise NotData(f"a NumPy array of {value.dtype}")
        return {"ndarray": base64.b64encode(np.ascontiguousarray(value).tobytes()).decode(),
                "dtype": value.dtype.str, "shape": list(value.shape)}
    if isinstance(value, (list, tuple, set, frozenset)):
        items = [_to_json(v, depth + 1) for v in value]
        if type(value) is list:
            return items
        kind = {tuple: "tuple", set: "set", frozenset: "set"}.get(type(value))
        if kind is None and isinstance(value, tuple):  # a named tuple, torch.Size: its values
            kind = "tuple"
        if kind is None:
            raise NotData(f"a {type(value).__name__}")
        return {kind: items}
    if isinstance(value, dict):
        return {"dict": [[_to_json(k, depth + 1), _to_json(v, depth + 1)]
                         for k, v in value.items()]}
    raise NotData(f"a {type(value).__module__}.{type(value).__qualname__}")


def encode(value: Any) -> str:
    """``value`` as JSON text, or :class:`NotData` naming what in it is not data."""
    return json.dumps(_to_json(value, 0))


def is_data(value: Any) -> bool:
    """Whether ``value`` can be sent (:func:`encode` would not raise)."""
    try:
        _to_json(value, 0)
    except NotData:
        return False
    return True


def _from_json(obj: Any) -> Any:
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, list):
        return [_from_json(v) for v in obj]
    if not isinstance(obj, dict) or len(obj) not in (1, 3):
        raise ValueError("not data the grader knows")
    if "tensor" in obj:
        dtype = getattr(torch, str(obj["dtype"]), None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"no torch dtype {obj['dtype']!r}")
        shape = [int(n) for n in obj["shape"]]
        raw = bytearray(base64.b64decode(obj["tensor"]))
        if not raw:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(raw, dtype=torch.uint8).view(dtype).reshape(shape).clone()
    if "ndarray" in obj:
        dtype = np.dtype(str(obj["dtype"]))
        if dtype.kind not in "biuf":
            raise ValueError(f"no numeric dtype {obj['dtype']!r}")
        shape = [int(n) for n in obj["shape"]]
        return np.frombuffer(base64.b64decode(obj["ndarray"]), dtype=dtype).reshape(shape).copy()
    ((kind, body),) = obj.items()
    if kind == "float":
        return float(body)  # "inf", "-inf", "nan" only: float() parses nothing else here
    if kind == "bytes":
        return base64.b64decode(body)
    if kind == "dtype":
        dtype = getattr(torch, str(body), None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"no torch dtype {body!r}")
        return dtype
    if kind == "tuple":
        return tuple(_from_json(v) for v in body)
    if kind == "set":
        return {_from_json(v) for v in body}
    if kind == "dict":
        return {_from_json(k): _from_json(v) for k, v in body}
    raise ValueError(f"not data the grader knows: {kind!r}")


def decode(text: str) -> Any:
    """The value :func:`encode` wrote (a ``ValueError`` for anything else)."""
    return _from_json(json.loads(text))
