"""The machines the device audit models, and the backend each gives a rank.

``DPCOURSE_DEVICE_AUDIT`` names the machine (:data:`MACHINES`); :func:`modelled_backend` is what
:func:`dpcourse.runtime.choose_backend` picks there, and :func:`begin_rank` records, in each
rank, the backend it stands for while it really runs gloo on this CPU.

Chapter 0: the course-wide runtime (portability to GPUs, checked on a CPU).
"""

from __future__ import annotations

import os

ENV = "DPCOURSE_DEVICE_AUDIT"
# The machines the audit models: the value of DPCOURSE_DEVICE_AUDIT -> GPUs on the node
# (None: as many as ranks). Two GPUs give NCCL to 2 ranks and gloo to 3 or more, as on Kaggle.
MACHINES: dict[str, int | None] = {"1": None, "gpu-per-rank": None, "one-gpu": 1, "two-gpus": 2}
class DeviceAuditError(RuntimeError):
    """What a GPU machine would have raised, found on a CPU by the device audit."""


def requested() -> bool:
    """True when the environment asks for the audit (``DPCOURSE_DEVICE_AUDIT`` set, not 0)."""
    return os.environ.get(ENV, "") not in ("", "0")


def setting() -> str:
    """The audit's setting in this process's environment ("" when off): a pool of ranks started
    under one setting must not serve a run under another."""
    return os.environ.get(ENV, "") if requested() else ""


def machine() -> str:
    """The modelled machine's name (a key of :data:`MACHINES`); a clear error for another."""
    value = os.environ.get(ENV, "")
    if value not in MACHINES:
        raise ValueError(f"{ENV}={value!r}: the device audit models the machines "
                         f"{', '.join(MACHINES)} (1 is gpu-per-rank)")
    return "gpu-per-rank" if value == "1" else value


def modelled_gpus() -> int | None:
    """GPUs on the modelled node; None where every rank has one of its own."""
    return MACHINES[machine()]


def modelled_backend(world_size: int) -> str:
    """The backend the modelled machine gives ``world_size`` ranks on one node: NCCL where each
    has a GPU of its own (NCCL refuses two ranks on one GPU), gloo otherwise."""
    gpus = modelled_gpus()
    return "nccl" if gpus is None or gpus >= world_size else "gloo"


_rank_backend: str | None = None  # the backend this rank stands for (begin_rank)


def begin_rank(backend: str) -> None:
    """Called by :func:`dpcourse.runtime.init_process_group`: this rank stands for a rank of
    ``backend`` ("nccl" or "gloo") on the modelled machine, while it really runs gloo."""
    global _rank_backend
    _rank_backend = backend


def rank_backend() -> str | None:
    """The backend this rank stands for (None outside a rank)."""
    return _rank_backend


def acts_as_nccl() -> bool:
    """True in a rank that stands for an NCCL rank: the collectives of :mod:`dpcourse.collectives`
    then take their NCCL code path (on gloo)."""
    return requested() and _rank_backend == "nccl"
