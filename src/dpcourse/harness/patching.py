"""Replacing torch.distributed's functions for a while, under both of their names.

``torch.distributed`` re-exports the functions of ``torch.distributed.distributed_c10d``, and
code inside that module calls them by its own names: ``P2POp`` checks its op against c10d's
``isend``/``irecv``, ``batch_isend_irecv`` and the object collectives call c10d's functions. A
replacement must go under both names to be seen everywhere. The one replacement lives with the
lesson that needs it first (:func:`dpcourse.shared_gpu.replace`, chapter 5); here are the ones for
a while: the exercise checks (to log a learner's messages or forbid the library's collectives), the
tests and the device audit use them; :func:`library_collectives_forbidden` is how the tests show
that the course's collectives are built from point-to-point messages alone.

Chapter 0: the course-wide plumbing.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator

import torch.distributed as dist

from dpcourse.shared_gpu import replace


@contextlib.contextmanager
def replaced(wrappers: dict[str, Callable[[Callable], Callable]]) -> Iterator[None]:
    """Inside the block each function ``name`` of ``wrappers`` is ``wrappers[name](real)``;
    the real ones are back afterwards, even after an exception. A module first imported inside
    the block that took a replacement by name (``from torch.distributed.distributed_c10d import
    broadcast``: DTensor's, which the first optimizer a process makes imports, through
    torch._dynamo) gets the real function back too; it would keep the replacement otherwise,
    for the rest of the process (a pool's rank serves the next test)."""
    reals: dict[str, Callable] = {}
    replacements: dict[str, Callable] = {}
    before = set(sys.modules)
    try:
        for name, wrap in wrappers.items():
            real = getattr(dist.distributed_c10d, name, None)
            if real is not None:
                reals[name] = real
                replacements[name] = wrap(real)
                replace(name, replacements[name])
        yield
    finally:
        for name, real in reals.items():
            replace(name, real)
        for module_name in set(sys.modules) - before:
            module = sys.modules.get(module_name)
            for name, real in reals.items():
                if getattr(module, name, None) is replacements[name]:
                    setattr(module, name, real)


# torch.distributed's collectives, which the course's own must never call (see
# dpcourse.collectives).
LIBRARY_COLLECTIVES = ("all_reduce", "all_gather", "broadcast", "reduce", "reduce_scatter",
                       "barrier", "all_to_all", "all_gather_into_tensor", "reduce_scatter_tensor",
                       # torch 2.13's names for the two above, and the batched forms
                       "all_gather_single", "reduce_scatter_single", "all_to_all_single",
                       "all_reduce_coalesced", "all_gather_coalesced")


@contextlib.contextmanager
def library_collectives_forbidden() -> Iterator[None]:
    """Inside the ``with`` block every library collective of this rank raises an
    AssertionError ("a library collective was called"): the tests run the course's
    collectives so, to show that they are built from point-to-point messages alone."""

    def forbid(real: Callable) -> Callable:
        def forbidden(*args, **kwargs):
            raise AssertionError("a library collective was called")

        return forbidden

    with replaced(dict.fromkeys(LIBRARY_COLLECTIVES, forbid)):
        yield
