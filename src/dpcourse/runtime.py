"""What this machine has, and the process group a rank runs in.

The same code serves every setting of the course (chapter 0 explains them):

* a CPU-only laptop: every rank is a process, the backend is gloo, tensors live on the CPU;
* one GPU, or fewer GPUs than ranks: gloo, with the ranks' tensors on the GPUs they share;
* one GPU per rank (a multi-GPU node, or a cluster): NCCL, rank ``r`` on ``cuda:<local rank>``.

A rank learns who it is from the same environment variables that ``torchrun`` sets
(``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT``). :mod:`dpcourse.harness.launch` sets them too, so a function that calls
:func:`device` or :func:`current` runs unchanged under either launcher.

Chapter 0: the course-wide runtime and launcher.
"""

from __future__ import annotations

import datetime
import os
import platform
import sys
from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from dpcourse import shared_gpu
from dpcourse.stand_in import stand_in

__all__ = [
    "Machine",
    "RankInfo",
    "describe_machine",
    "gpu_count",
    "choose_backend",
    "device_for_rank",
    "init_process_group",
    "teardown",
    "current",
    "device",
    "is_rank_zero",
    "print0",
    "synchronize",
    "end_process",
]

DEFAULT_PG_TIMEOUT = datetime.timedelta(minutes=5)

@dataclass(frozen=True)
class Machine:
    """A summary of this machine: chapter 0 prints it whole (:meth:`summary`), the other chapters
    in one line (:meth:`line`)."""

    cpus: int
    gpus: tuple[str, ...]
    gpu_memory_gib: tuple[float, ...]
    torch_version: str
    cuda_version: str | None
    backends: dict[str, bool] = field(default_factory=dict)
    # torch's intra-op threads in this process: what a CPU measurement here had to work with
    # (OMP_NUM_THREADS, torch.set_num_threads); `make test` runs each notebook with 1.
    threads: int = 1
    python: str = platform.python_version()
    system: str = platform.platform()

    def summary(self) -> str:
        """One line per fact, for printing in a notebook."""
        if self.gpus:
            gpu_lines = [
                f"  cuda:{i}: {name}, {mem:.1f} GiB"
                for i, (name, mem) in enumerate(zip(self.gpus, self.gpu_memory_gib, strict=True))
            ]
        else:
            gpu_lines = ["  none: every rank will be a CPU process talking over gloo"]
        backends = ", ".join(f"{b}={'yes' if ok else 'no'}" for b, ok in self.backends.items())
        return "\n".join(
            [
                f"system:       {self.system}",
                f"python:       {self.python}",
                f"torch:        {self.torch_version}"
                + (f" (CUDA {self.cuda_version})" if self.cuda_version else " (CPU build)"),
                f"CPU cores:    {self.cpus} (torch uses {self.threads} thread"
                + ("s)" if self.threads != 1 else ")"),
                f"GPUs:         {len(self.gpus)}",
                *gpu_lines,
                f"backends:     {backends}",
                f"auto backend for 2 ranks: {choose_backend(2, len(self.gpus))}",
            ]
        )

    def line(self, ranks: int = 2) -> str:
        """This machine in one line, for a chapter's first cell (the introduction prints the whole
        :meth:`summary`): the GPUs, the CPU cores and torch's threads, torch's build, and the
        backend the course gives ``ranks`` ranks (:func:`choose_backend`). For example ``2 CPU
        cores (torch uses 1 thread), no GPU; torch 2.13.0+cpu (CPU build); 2 ranks use gloo``."""
        if ranks < 1:
            raise ValueError(f"ranks must be at least 1, got {ranks}")
        cores = f"{self.cpus} CPU core{'s' if self.cpus != 1 else ''} (torch uses {self.threads} "
        cores += "thread)" if self.threads == 1 else "threads)"
        if self.gpus:
            # GPUs alike are counted together: "8 GPUs (NVIDIA H100 80GB HBM3, 79 GiB)"
            kinds = Counter(
                f"{name}, {mem:.0f} GiB"
                for name, mem in zip(self.gpus, self.gpu_memory_gib, strict=True)
            )
            n = len(self.gpus)
            gpus = "; ".join(kind if k == 1 or len(kinds) == 1 else f"{k} x {kind}"
                             for kind, k in kinds.items())
            where = f"{n} GPU{'s' if n > 1 else ''} ({gpus}), {cores}"
        else:
            where = f"{cores}, no GPU"
        build = f"CUDA {self.cuda_version}" if self.cuda_version else "CPU build"
        backend = choose_backend(ranks, len(self.gpus))
        ranks_use = "1 rank uses" if ranks == 1 else f"{ranks} ranks use"
        return f"{where}; torch {self.torch_version} ({build}); {ranks_use} {backend}"

    def __str__(self) -> str:
        return self.summary()


def gpu_count() -> int:
    """Number of CUDA devices this process can see (0 on a CPU-only build)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def describe_machine() -> Machine:
    """What this machine has: CPU cores, GPUs, torch and the distributed backends.

    Used by chapter 0 (``intro.ipynb``) and by the benchmarks, which record it beside their results.
    """
    n = gpu_count()
    names = tuple(torch.cuda.get_device_name(i) for i in range(n))
    mems = tuple(torch.cuda.get_device_properties(i).total_memory / 2**30 for i in range(n))
    backends = {
        "gloo": dist.is_available() and dist.is_gloo_available(),
        "nccl": dist.is_available() and dist.is_nccl_available() and n > 0,
        "mpi": dist.is_available() and dist.is_mpi_available(),
    }
    return Machine(
        cpus=os.cpu_count() or 1,
        gpus=names,
        gpu_memory_gib=mems,
        torch_version=torch.__version__,
        cuda_version=torch.version.cuda if n else None,
        backends=backends,
        threads=torch.get_num_threads(),
    )


def choose_backend(world_size: int, gpus: int | None = None) -> str:
    """The backend the course uses for ``world_size`` ranks on one node.

    NCCL needs a GPU of its own for every rank, so it is chosen only when there are at least as
    many GPUs as ranks; everything else uses gloo (with CUDA tensors where GPUs exist). Under the
    device audit (:mod:`dpcourse.stand_in`): the backend of the machine it stands in for.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    if gpus is None and (machine := stand_in()) is not None:
        return machine.backend(world_size)
    gpus = gpu_count() if gpus is None else gpus
    if gpus >= world_size and dist.is_nccl_available():
        return "nccl"
    return "gloo"


def device_for_rank(
    local_rank: int, local_world_size: int, backend: str, gpus: int | None = None
) -> torch.device:
    """The device a rank's tensors live on.

    * NCCL: ``cuda:<local_rank>``, one GPU per rank (an error if there are too few);
    * gloo with GPUs present: the GPUs are shared round-robin, ``cuda:<local_rank % gpus>``;
    * gloo without GPUs: the CPU;
    * standing in for a GPU machine (the device audit, :mod:`dpcourse.stand_in`): the object
      that stands for the GPU, which is the CPU.
    """
    machine = stand_in() if gpus is None else None
    if machine is not None:
        gpus = machine.gpus()
        gpus = local_world_size if gpus is None else gpus
    gpus = gpu_count() if gpus is None else gpus
    if backend == "nccl":
        if gpus < local_world_size:
            raise RuntimeError(
                f"NCCL needs one GPU per rank, but this node runs {local_world_size} ranks and has "
                f"{gpus} GPU(s). Use backend='gloo' (or 'auto'), or start fewer ranks per node."
            )
        return machine.device if machine is not None else torch.device("cuda", local_rank)
    if machine is not None:
        return machine.device  # the CPU, standing in for cuda:<local_rank % gpus>
    if gpus > 0:
        return torch.device("cuda", local_rank % gpus)
    return torch.device("cpu")


@dataclass(frozen=True)
class RankInfo:
    """Who this process is in the job: what :func:`current` returns inside a rank."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    backend: str  # standing in for a GPU machine: that machine's (it runs gloo)
    device: torch.device


_info: RankInfo | None = None


def _env_int(name: str, default: int | None = None) -> int:
    value = os.environ.get(name)
    if value is None:
        if default is None:
            raise RuntimeError(
                f"environment variable {name} is not set: start this script with torchrun "
                f"(`torchrun --nproc-per-node=N script.py`) or run the function with "
                f"dpcourse.harness.launch.run_ranks"
            )
        return default
    return int(value)


def init_process_group(
    backend: str = "auto",
    store: dist.Store | None = None,
    timeout: datetime.timedelta = DEFAULT_PG_TIMEOUT,
) -> RankInfo:
    """Initialise the default process group from torchrun's environment variables.

    Under ``torchrun`` call it with no arguments (rendezvous through ``env://``). The course's own
    launcher passes ``store``, a client of the store its parent process hosts. It also sets the
    current CUDA device where there is one, and where ranks share GPUs over gloo it has their
    point-to-point messages go through host memory (:mod:`dpcourse.shared_gpu`). Standing in for a
    GPU machine (the device audit, :mod:`dpcourse.stand_in`) the rank stands for that machine's
    backend and really runs gloo. Returns the
    :class:`RankInfo` that :func:`current` then gives back.
    """
    global _info
    if dist.is_initialized():
        raise RuntimeError(
            "the default process group is already initialised in this process; "
            "call dpcourse.runtime.teardown() first"
        )
    rank = _env_int("RANK")
    world_size = _env_int("WORLD_SIZE")
    local_rank = _env_int("LOCAL_RANK", rank)
    local_world_size = _env_int("LOCAL_WORLD_SIZE", world_size)
    if backend == "auto":
        backend = choose_backend(local_world_size)
    dev = device_for_rank(local_rank, local_world_size, backend)
    # ranks that share GPUs run gloo with CUDA tensors: their sends go through host memory
    machine = stand_in()
    if backend == "gloo" and (dev.type == "cuda" or machine is not None):
        shared_gpu.stage_point_to_point()
    real = backend
    if machine is not None:
        machine.begin_rank(backend)  # what this rank stands for; it really runs gloo on the CPU
        real = "gloo"
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    kwargs: dict = dict(backend=real, rank=rank, world_size=world_size, timeout=timeout)
    if store is not None:
        kwargs["store"] = store
    else:
        kwargs["init_method"] = "env://"
    if real == "nccl":
        kwargs["device_id"] = dev  # binds the communicator eagerly: clearer errors, no guessing
    dist.init_process_group(**kwargs)
    _info = RankInfo(rank, world_size, local_rank, local_world_size, backend, dev)
    return _info


def teardown() -> None:
    """Destroy the default process group if there is one (safe to call twice)."""
    global _info
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    _info = None


def end_process(code: int = 0) -> None:
    """Flush stdout and stderr and end this process at once, skipping interpreter shutdown.

    Run after :func:`teardown` at the end of a rank: C++ static destructors running after gloo's
    threads aborted a rank whose work was done ("terminate called without an active exception",
    SIGABRT) about once in 30 runs, and torchrun then fails the whole job. The course's launcher
    and its trainer (:mod:`dpcourse.practice.train`) end their ranks this way.
    """

    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def current() -> RankInfo:
    """This rank's :class:`RankInfo`. Outside any process group: a single rank on this machine."""
    if _info is not None and dist.is_initialized():
        return _info
    if dist.is_available() and dist.is_initialized():  # someone else initialised it
        rank, world = dist.get_rank(), dist.get_world_size()
        local_rank = _env_int("LOCAL_RANK", rank)
        local_world = _env_int("LOCAL_WORLD_SIZE", world)
        backend = str(dist.get_backend())
        return RankInfo(
            rank,
            world,
            local_rank,
            local_world,
            backend,
            device_for_rank(local_rank, local_world, backend),
        )
    backend = choose_backend(1)
    return RankInfo(0, 1, 0, 1, backend, device_for_rank(0, 1, backend))


def device() -> torch.device:
    """The device this rank should put its model and data on."""
    return current().device


def is_rank_zero() -> bool:
    """True on rank 0 (and outside any process group)."""
    return current().rank == 0


def print0(*args, **kwargs) -> None:
    """``print`` on rank 0 only: the usual way to log once per job."""
    if is_rank_zero():
        print(*args, **kwargs)


def synchronize(device: torch.device | str | None = None) -> None:
    """Wait for the work queued on ``device`` (this rank's :func:`device` by default).

    CUDA kernels and NCCL collectives return as soon as they are queued, so a timer read right
    after them measures the launch, not the work; every measurement in the course calls this
    before reading the clock. On the CPU it does nothing.
    """
    device = torch.device(device) if device is not None else current().device
    if device.type == "cuda":
        torch.cuda.synchronize(device)
