"""The device audit: run on a CPU as if the ranks had GPUs, and fail where the GPUs would.

Learners run the course on several kinds of machine (``shared/DESIGN.md``'s table), and code
written and tested on a CPU can break on each in ways a CPU never shows:

* **a GPU per rank** (a node, NCCL): a tensor made without ``device=`` stays on the host and meets
  a GPU tensor ("Expected all tensors to be on the same device"), a host tensor reaches an NCCL
  collective ("No backend type associated with device type cpu"), ``.numpy()`` of a GPU tensor;
* **ranks sharing GPUs** (one GPU: a laptop, Colab; two GPUs and 3 or more ranks: Kaggle's T4 x2),
  gloo with CUDA tensors: gloo's collectives take them, but its ``send``/``recv`` take host tensors
  only (``writev ... Bad address`` on the sender, "Connection closed by peer" on the receiver), and
  ``fully_shard`` on CUDA over gloo killed both ranks with SIGSEGV (torch 2.11, one H200).

``DPCOURSE_DEVICE_AUDIT`` names the machine to model (:data:`MACHINES`): ``1`` or
``gpu-per-rank``, ``one-gpu``, ``two-gpus``. :func:`dpcourse.runtime.choose_backend` then picks
the backend that machine would get (NCCL where it has a GPU per rank, gloo otherwise), while the
ranks really run gloo on this CPU; :mod:`dpcourse.runtime` hands out :data:`DEVICE` as every
rank's device (and the notebook's outside a process group). :data:`DEVICE` is the CPU, so
everything computes and prints as before, but it is one particular ``torch.device`` object, and a
torch function mode tags each tensor by where it would live on the modelled machine:

* ``"device"``: made with ``device=DEVICE`` (also ``device=t.device`` of a device tensor, whose
  ``.device`` is :data:`DEVICE` under the audit), moved with ``.to(DEVICE)`` or
  ``module.to(DEVICE)``, or loaded with ``torch.load(..., map_location=DEVICE)``;
* ``"host"``: made by a factory (``torch.zeros``, ``torch.tensor``, ``torch.randn``…) with no
  ``device=``, by ``.cpu()`` / ``.to("cpu")``, loaded with ``map_location="cpu"``, and a parameter
  made from a host tensor;
* results of other operations, and ``.data``, ``.T`` or ``.grad``, take the tag of their inputs
  (the mode also runs inside autograd's hooks, which torch calls with no mode active); tensors
  made with some other explicit device carry none and never fail.

What raises (:class:`DeviceAuditError`, with the error the GPU machine gives): an operation mixing
a "device" tensor with a "host" tensor of one or more dimensions (0-dimensional host tensors are
allowed, as on CUDA); ``.numpy()`` of a "device" tensor; where the modelled backend is NCCL, a
collective given a "host" tensor; where it is gloo, ``send``/``recv``/``isend``/``irecv`` (and
``batch_isend_irecv``) given a "device" tensor, unless :mod:`dpcourse.shared_gpu` stages it
through the host (ranks started by :mod:`dpcourse.runtime` get that), and ``fully_shard`` on the
device. ``make audit`` runs every notebook under each machine; ``tests/test_device_audit.py``
tests the rules and shows each failure of the first GPU run failing here before its fix.

Chapter 0: the course-wide runtime (portability to GPUs, checked on a CPU).
"""

from __future__ import annotations

from pathlib import Path

import torch

from dpcourse import stand_in
from dpcourse.harness.device_audit.backends import guard_collectives, guard_fsdp
from dpcourse.harness.device_audit.machines import (
    ENV,
    MACHINES,
    DeviceAuditError,
    acts_as_nccl,
    begin_rank,
    machine,
    modelled_backend,
    modelled_gpus,
    rank_backend,
    requested,
    setting,
)
from dpcourse.harness.device_audit.tags import (
    DEVICE,
    HOST,
    Audit,
    audit_autograd_hooks,
    tag,
    tag_loads,
    tag_parameters,
    where,
)

__all__ = ["ENV", "MACHINES", "DEVICE", "HOST", "DeviceAuditError", "requested", "setting",
           "machine", "modelled_gpus", "modelled_backend", "begin_rank", "rank_backend",
           "acts_as_nccl", "enable", "enabled", "enable_if_requested", "where", "tag",
           "SITE"]

# A folder whose sitecustomize.py starts the audit in every Python process that the environment
# asks it of (DPCOURSE_DEVICE_AUDIT): `make audit` puts it on PYTHONPATH, so that notebook kernels,
# fork servers and torchrun's workers start audited without any lesson code importing this.
SITE = str(Path(__file__).resolve().parent / "site")

_mode: Audit | None = None


def enabled() -> bool:
    """True when the audit's mode is active on this thread."""
    return _mode is not None and _mode in torch.overrides._get_current_function_mode_stack()


def enable() -> None:
    """Start the audit in this process (idempotent): the function mode and the guards.

    Called by :func:`enable_if_requested` (the launcher's ranks, the audit's sitecustomize);
    a test may call it directly.
    """
    global _mode
    machine()  # an unknown machine fails here, with the list of those modelled
    guard_collectives()
    tag_parameters()
    tag_loads()
    guard_fsdp()
    audit_autograd_hooks(lambda: _mode)
    if not enabled():
        _mode = Audit()
        _mode.__enter__()  # stays on for the life of the process (a kernel, a rank)


def enable_if_requested() -> None:
    """Start the audit where the environment asks for it (``DPCOURSE_DEVICE_AUDIT``): the
    launcher's ranks call it once their environment is set, and the audit's sitecustomize at
    start."""
    if requested():
        enable()


class _AuditedMachine:
    """The machine the audit models, as :mod:`dpcourse.stand_in` asks for it: the runtime then
    hands out its backend and :data:`DEVICE`, and the collectives take its code paths."""

    device = DEVICE

    def active(self) -> bool:
        return requested()

    def backend(self, world_size: int) -> str:
        return modelled_backend(world_size)

    def gpus(self) -> int | None:
        return modelled_gpus()

    def begin_rank(self, backend: str) -> None:
        begin_rank(backend)

    def rank_backend(self) -> str | None:
        return rank_backend()

    def on_device(self, tensor: torch.Tensor) -> bool:
        return where(tensor) == "device"


# Registered on import, in force only while the environment asks for the audit (active()).
stand_in.register(_AuditedMachine())
