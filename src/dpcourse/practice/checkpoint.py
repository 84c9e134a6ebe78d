"""Checkpoints that survive crashes and resume training exactly (chapter 8).

Three rules make a checkpoint safe in data-parallel training:

1. **One writer per file.** The replicas are identical, so rank 0 alone writes the model, the
   optimizer, the gradient scaler and the data position. Only state that differs between ranks is
   gathered from them: each rank's random-number generators (dropout, augmentation) and, for a
   sharded optimizer (ZeRO, chapter 9), each rank's shard, which that rank writes itself; for
   sharded parameters (FSDP, ZeRO-3) each rank writes its shard of the model too.
2. **Atomic writes.** :func:`atomic_save` writes to a temporary file in the same directory,
   flushes and fsyncs it, then renames it over the target with ``os.replace`` (atomic on POSIX):
   a reader sees the old file or the new one, never half of one.
3. **A manifest written last.** A checkpoint is a directory ``step-00000010/``; ``latest.json``
   names the newest *complete* one and is replaced, atomically, only after every file of the new
   checkpoint is on disk. A crash at any moment leaves ``latest.json`` pointing at a checkpoint
   that can be loaded.

Layout::
    checkpoint_dir/
        latest.json                     {"step": 10, "path": "step-00000010", "world_size": 2, ...}
        step-00000010/
            checkpoint.pt               model, optimizer, scaler, progress, RNG state of every rank
            optimizer-rank00-of02.pt    only for a sharded optimizer: one file per rank
            model-rank00-of02.pt        only for a sharded model (FSDP): one file per rank

Resuming restores every generator, so a run that stops and resumes follows the same trajectory,
bit for bit, as one that never stopped (``tests/test_checkpoint.py`` checks it with
``torch.equal``). :mod:`dpcourse.practice.train` uses these functions.

Chapter 8: checkpoints that resume training exactly.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

__all__ = [
    "MANIFEST",
    "atomic_write",
    "atomic_save",
    "capture_rng_state",
    "restore_rng_state",
    "save_checkpoint",
    "load_checkpoint",
    "latest_checkpoint",
]

MANIFEST = "latest.json"
CHECKPOINT_FILE = "checkpoint.pt"


# ------------------------------------------------------------------------------ atomic files
def _fsync_directory(directory: Path) -> None:
    # The rename is an entry in the directory: fsync the directory so the entry survives a power
    # cut too. (Not possible on every platform; a best effort is what databases do as well.)
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write(path: str | os.PathLike, write: Callable[[Any], None]) -> Path:
    """Create or replace ``path`` atomically: ``write(f)`` fills a binary temporary file in the
    same directory, which is flushed, fsynced and renamed over ``path`` with ``os.replace``.

    If ``write`` raises (or the process dies) the temporary file is removed (or left behind under
    a ``.tmp`` name) and ``path`` is untouched. The temporary file must be in the same directory:
    ``os.replace`` is atomic only within one file system.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())  # the bytes are on disk before the name points at them
        os.replace(tmp_name, path)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
    _fsync_directory(path.parent)
    return path


def atomic_save(obj: Any, path: str | os.PathLike) -> Path:
    """``torch.save(obj, path)``, atomically (see :func:`atomic_write`). Returns the path."""
    return atomic_write(path, lambda f: torch.save(obj, f))


def _atomic_json(obj: Any, path: Path) -> Path:
    return atomic_write(path, lambda f: f.write(json.dumps(obj, indent=1).encode()))


# ----------------------------------------------------------------------------------- RNG
def capture_rng_state() -> dict[str, Any]:
    """This process's random-number generators: torch's CPU generator, every CUDA device's
    (where there are any), Python's ``random`` and NumPy's global generator. Everything is a
    tensor, a list or a number, so ``torch.load(weights_only=True)`` can read it back."""

    np_state = np.random.get_state()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": [np_state[0], torch.from_numpy(np_state[1].astype("int64")), *np_state[2:]],
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Put back generators saved by :func:`capture_rng_state`.

    The states may come from ``torch.load(..., map_location="cuda:0")`` with the rest of a
    checkpoint: every generator's state, CUDA's included, is a host tensor, so each is moved back
    to the CPU first (``.numpy()`` of a GPU tensor raises, and so does ``set_rng_state``).
    """

    torch.set_rng_state(state["torch"].cpu())
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.cpu().numpy().astype("uint32"), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])


# ------------------------------------------------------------------------------ checkpoints
def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    # DDP wrappers (torch's and ours) keep the real model in .module; saving the inner one gives
    # keys without the "module." prefix, loadable with or without a wrapper.
    return getattr(model, "module", model)


def _shard_name(rank: int, world: int, what: str = "optimizer") -> str:
    return f"{what}-rank{rank:02d}-of{world:02d}.pt"


def latest_checkpoint(directory: str | os.PathLike) -> dict | None:
    """The manifest of the newest complete checkpoint in ``directory``, or None if there is none
    (no directory, or no ``latest.json`` yet). Its ``"path"`` is relative to ``directory``."""
    manifest = Path(directory) / MANIFEST
    if not manifest.exists():
        return None
    return json.loads(manifest.read_text())


def save_checkpoint(
    directory: str | os.PathLike,
    step: int,
    model: torch.nn.Module,
    optimizer: Any,
    *,
    scaler: torch.amp.GradScaler | None = None,
    scheduler: Any = None,
    progress: dict | None = None,
    sharded_optimizer: bool = False,
    sharded_model: bool = False,
    keep: int = 2,
) -> Path:
    """Save a checkpoint of training after ``step`` steps; call it on **every** rank.

    Rank 0 writes ``checkpoint.pt`` (model, optimizer unless sharded, scaler, LR scheduler,
    ``progress`` — for instance the epoch and the batch within it —, and the RNG state of every
    rank, gathered to it). With ``sharded_optimizer=True`` each rank writes its own optimizer state
    (``optimizer.state_dict()`` of a ZeRO optimizer) to its own file, and with
    ``sharded_model=True`` its ``model.state_dict()`` (an FSDP model holds this rank's shards)
    to another. Then, after a barrier, rank
    0 replaces ``latest.json`` and deletes all but the ``keep`` newest checkpoints. Every file is
    written atomically. Returns the checkpoint's directory. Used by :mod:`dpcourse.practice.train`.
    """
    if keep < 1:
        raise ValueError(f"keep must be at least 1 (the checkpoint just written), got {keep}")
    directory = Path(directory)
    rank, world = _rank_world()
    name = f"step-{step:08d}"
    where = directory / name
    distributed = world > 1 or (dist.is_available() and dist.is_initialized())

    rng = capture_rng_state()
    if distributed:
        rngs: list[Any] = [None] * world
        dist.all_gather_object(rngs, rng)
    else:
        rngs = [rng]

    files = [CHECKPOINT_FILE]
    if sharded_optimizer:
        files += [_shard_name(r, world) for r in range(world)]
        atomic_save(optimizer.state_dict(), where / _shard_name(rank, world))
    if sharded_model:
        files += [_shard_name(r, world, "model") for r in range(world)]
        atomic_save(_unwrap(model).state_dict(), where / _shard_name(rank, world, "model"))
    if rank == 0:
        state = {
            "step": step,
            "world_size": world,
            "model": None if sharded_model else _unwrap(model).state_dict(),
            "optimizer": None if sharded_optimizer else optimizer.state_dict(),
            "scaler": scaler.state_dict() if scaler is not None else None,
            "scheduler": scheduler.state_dict() if scheduler is not None else None,
            "progress": progress or {},
            "rng": rngs,
        }
        atomic_save(state, where / CHECKPOINT_FILE)
    if distributed:
        dist.barrier()  # every shard is on disk before the manifest names the checkpoint
    if rank == 0:
        manifest = {
            "step": step,
            "path": name,
            "world_size": world,
            "sharded_optimizer": sharded_optimizer,
            "sharded_model": sharded_model,
            "files": files,
        }
        _atomic_json(manifest, directory / MANIFEST)
        old = sorted(p for p in directory.glob("step-*") if p.is_dir() and p.name != name)
        for stale in old[: max(len(old) - (keep - 1), 0)]:
            shutil.rmtree(stale, ignore_errors=True)
    if distributed:
        dist.barrier()  # nobody goes on (or loads) before the manifest is in place
    return where


def load_checkpoint(
    directory: str | os.PathLike,
    model: torch.nn.Module,
    optimizer: Any,
    *,
    scaler: torch.amp.GradScaler | None = None,
    scheduler: Any = None,
    map_location: torch.device | str | None = None,
    restore_rng: bool = True,
) -> dict | None:
    """Load the newest complete checkpoint of ``directory`` into ``model``, ``optimizer``,
    ``scaler`` and ``scheduler`` (an LR scheduler), restore this rank's generators, and return
    ``{"step": ..., "progress": ...}``; None if there is no checkpoint yet (a fresh start).
    Call it on every rank.

    The generators of rank r are rank r's from the saved run, so the world size must be the same
    as when it was saved; a different one raises ``ValueError`` (pass ``restore_rng=False`` to
    resume anyway, without an identical trajectory). A sharded optimizer's files then all go to
    ``optimizer.load_state_dict`` as one list, which chapter 9's ``ShardedOptimizer`` cuts to
    its new shards; a sharded model (FSDP) needs the same world size. A checkpoint of a plain
    optimizer loads into a ``ShardedOptimizer`` too. ``map_location`` defaults to where the
    model's parameters are.
    """
    manifest = latest_checkpoint(directory)
    if manifest is None:
        return None
    rank, world = _rank_world()
    where = Path(directory) / manifest["path"]
    if map_location is None:
        map_location = next(_unwrap(model).parameters()).device
    state = torch.load(where / CHECKPOINT_FILE, map_location=map_location, weights_only=True)
    saved_world = state["world_size"]
    sharded_model = manifest.get("sharded_model", False)
    if saved_world != world and (restore_rng or sharded_model):
        if sharded_model:
            why, fix = "its model is sharded by rank", ""
        else:
            why, fix = "it holds each rank's random generators", ", or pass restore_rng=False"
        raise ValueError(
            f"the checkpoint {where} was written by {saved_world} ranks and this job has {world}: "
            f"{why}. Resume with {saved_world} ranks{fix}"
        )
    if saved_world != world and manifest["sharded_optimizer"] and not getattr(
        optimizer, "reshards_state", False
    ):
        raise ValueError(
            f"the checkpoint {where} holds an optimizer state sharded over {saved_world} ranks, "
            f"which {type(optimizer).__name__} cannot cut for {world} (chapter 9's "
            f"ShardedOptimizer can): resume with {saved_world} ranks"
        )
    if sharded_model:
        _unwrap(model).load_state_dict(torch.load(
            where / _shard_name(rank, world, "model"), map_location=map_location, weights_only=True
        ))
    else:
        _unwrap(model).load_state_dict(state["model"])
    if manifest["sharded_optimizer"]:
        ranks = [rank] if saved_world == world else range(saved_world)  # all: to reshard
        shards = [torch.load(where / _shard_name(r, saved_world), map_location=map_location,
                             weights_only=True) for r in ranks]
        optimizer.load_state_dict(shards[0] if saved_world == world else shards)
    else:
        optimizer.load_state_dict(state["optimizer"])
    if scaler is not None and state["scaler"] is not None:
        scaler.load_state_dict(state["scaler"])
    if scheduler is not None and state.get("scheduler") is not None:
        scheduler.load_state_dict(state["scheduler"])
    if restore_rng:
        restore_rng_state(state["rng"][rank])
    return {"step": state["step"], "progress": state["progress"], "path": str(where)}
