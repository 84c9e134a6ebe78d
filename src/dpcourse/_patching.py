"""Replacing torch.distributed's functions for a while, under both of their names.

``torch.distributed`` re-exports the functions of ``torch.distributed.distributed_c10d``, and
code inside that module calls them by its own names: ``P2POp`` checks its op against c10d's
``isend``/``irecv``, ``batch_isend_irecv`` and the object collectives call c10d's functions. A
replacement must go under both names to be seen everywhere. The exercise checks (to log a
learner's messages or forbid the library's collectives) and the device audit use this.

Chapter 0: the course-wide plumbing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch.distributed as dist


def replace(name: str, new: Callable) -> Callable | None:
    """Put ``new`` in place of torch.distributed's ``name`` under both names; return what was
    there (None, and nothing replaced, where this torch has no such function)."""
    c10d = dist.distributed_c10d
    real = getattr(c10d, name, None)
    if real is not None:
        setattr(c10d, name, new)
        setattr(dist, name, new)
    return real


@contextlib.contextmanager
def replaced(wrappers: dict[str, Callable[[Callable], Callable]]) -> Iterator[None]:
    """Inside the block each function ``name`` of ``wrappers`` is ``wrappers[name](real)``;
    the real ones are back afterwards, even after an exception."""
    reals: dict[str, Callable] = {}
    try:
        for name, wrap in wrappers.items():
            real = getattr(dist.distributed_c10d, name, None)
            if real is not None:
                reals[name] = real
                replace(name, wrap(real))
        yield
    finally:
        for name, real in reals.items():
            replace(name, real)
