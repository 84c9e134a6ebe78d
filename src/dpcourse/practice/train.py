"""python -m dpcourse.practice.train: the course's data-parallel trainer, from one CPU to many GPU
nodes.

Read it top to bottom: it is one function that does what chapters 1-9 built, in order. Run it

    python -m dpcourse.practice.train --strategy single                        # one process
    torchrun --standalone --nproc-per-node=2 -m dpcourse.practice.train --strategy ddp-scratch
    torchrun --nnodes=2 --nproc-per-node=4 --rdzv-backend=c10d \\
             --rdzv-endpoint=$MASTER_ADDR:29500 -m dpcourse.practice.train ...   #
             slurm/train.sbatch

Strategies (``--strategy``), all training the same model on the same global batches:

* ``single``: one process, no communication (chapter 1);
* ``manual``: all-reduce every gradient after backward, then step (chapter 7's step 2);
* ``ddp-scratch``: the course's :class:`dpcourse.ddp.ddp.DDP`, bucketed and overlapped (chapter 7);
* ``ddp-torch``: ``torch.nn.parallel.DistributedDataParallel``;
* ``zero``: :class:`dpcourse.sharding.zero.ShardedOptimizer`, ZeRO stage 1 (chapter 9).

``--batch-size`` is per rank: the effective batch is world size x batch size, and
``--lr-scaling``/``--warmup`` adapt the learning rate to it (chapter 8). With
``--checkpoint-dir`` it saves every ``--checkpoint-every`` steps and resumes from the newest
checkpoint there, exactly where it stopped (same batches, same random numbers); with
``--allow-resize`` it also resumes one written by another number of ranks, as an elastic job
that lost a node must (chapter 8), saying what changes. Only rank 0 logs.
``--crash-at-step`` makes one rank die, to show what a failure looks like (chapter 8).

``main(argv)`` also runs inside :func:`dpcourse.harness.launch.run_ranks` (the process group exists
then) and returns a summary dict; tests use it.

Chapter 8: the data-parallel trainer.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler

from dpcourse import runtime
from dpcourse.ddp import ddp
from dpcourse.one_device import data, models
from dpcourse.practice import checkpoint, mixed_precision
from dpcourse.practice.lr_schedule import RULES, lr_at

STRATEGIES = ("single", "manual", "ddp-scratch", "ddp-torch", "zero")
# the variant of dpcourse.ddp.ddp.wrap each strategy trains with ("none" for the others)
_VARIANT_OF_STRATEGY = {"manual": "step 2", "ddp-scratch": "DDP", "ddp-torch": "torch DDP"}
MODELS = ("mlp", "transformer")

__all__ = ["STRATEGIES", "MODELS", "parse_args", "main"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (``python -m dpcourse.practice.train --help``)."""
    p = argparse.ArgumentParser(
        prog="python -m dpcourse.practice.train",
        description="Data-parallel training of the course's models; run it under torchrun.",
    )
    p.add_argument("--strategy", choices=STRATEGIES, default="ddp-scratch")
    p.add_argument("--model", choices=MODELS, default="mlp")
    p.add_argument("--steps", type=int, default=100, help="optimizer steps in all")
    p.add_argument("--batch-size", type=int, default=16, help="samples per rank per step")
    p.add_argument("--lr", type=float, default=3e-3, help="learning rate for one rank")
    p.add_argument("--lr-scaling", choices=RULES, default="none", help="rule for N ranks")
    p.add_argument("--warmup", type=int, default=0, help="steps of linear warm-up")
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--grad-clip", type=float, default=None,
                   help="max gradient norm (0: off; default 1)")
    p.add_argument("--amp", choices=("off", "auto", "bf16", "fp16"), default="off",
                   help="auto: bf16, or fp16 with loss scaling below compute capability 8.0")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-samples", type=int, default=1024, help="size of the data set")
    p.add_argument("--checkpoint-dir", type=Path, default=None)
    p.add_argument("--checkpoint-every", type=int, default=0, help="steps between saves (0: end)")
    p.add_argument("--log-every", type=int, default=10)
    # torch's NCCL default: NCCL's set-up takes longer the more ranks there are, and the ranks
    # wait at a barrier while rank 0 writes a checkpoint (81 GB at 2 GB/s: 40 s, problem 8.3).
    p.add_argument("--timeout", type=float, default=600.0,
                   help="seconds a collective may wait (default 600, torch's NCCL default)")
    p.add_argument("--allow-resize", action="store_true",
                   help="resume a checkpoint written by another number of ranks (an elastic "
                        "job that lost a node): weights, optimizer and step carry over, the "
                        "random numbers and the data order do not")
    p.add_argument("--crash-at-step", type=int, default=None, help="a rank dies at this step")
    p.add_argument("--crash-rank", type=int, default=1)
    p.add_argument("--crash-marker", type=Path, default=None, help="crash only if this is absent")
    args = p.parse_args(argv)
    # Each bad value gets its own message: what was given and what to give instead.
    at_least_one = ("steps", "batch_size", "num_samples", "log_every")
    for name in at_least_one:
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.grad_clip is None:
        args.grad_clip = 1.0
    for name in ("grad_clip", "warmup", "checkpoint_every", "weight_decay"):
        if getattr(args, name) < 0:
            p.error(f"--{name.replace('_', '-')} must be 0 (off) or more, got "
                    f"{getattr(args, name)}")
    for name in ("lr", "timeout"):
        if not getattr(args, name) > 0:
            p.error(f"--{name} must be above 0, got {getattr(args, name)}")
    if args.crash_at_step is not None and not 0 <= args.crash_at_step < args.steps:
        p.error(f"--crash-at-step must be a step from 0 to --steps - 1 ({args.steps - 1}), got "
                f"{args.crash_at_step}")
    if args.crash_rank < 0:
        p.error(f"--crash-rank must be a rank (0 or more), got {args.crash_rank}")
    return args


def _data_and_model(args: argparse.Namespace):
    if args.model == "mlp":
        dataset = data.random_regression(args.num_samples, seed=args.seed)
        model = models.MLP()
        return dataset, None, model, torch.nn.functional.mse_loss
    dataset = data.DigitsToWords(args.num_samples, seed=args.seed)
    model = models.TinyTransformer(d_model=32, nhead=2, num_layers=1, dim_feedforward=64)
    return dataset, data.collate_seq2seq, model, models.sequence_cross_entropy


def _store_for_this_attempt(timeout: datetime.timedelta) -> dist.Store | None:
    """Under torchrun on one node, a client of torchrun's store with a prefix per restart attempt.

    torchrun shares its rendezvous store with the workers (``TORCHELASTIC_USE_AGENT_STORE``).
    After a restart (``--max-restarts``) the new workers meet in that same store, where the old
    workers' addresses are still written: with plain ``env://`` they can read those and connect
    to dead processes (we saw hangs and "connection refused"; pytorch/pytorch#135712). A prefix
    per attempt keeps each attempt's keys apart. ``TORCHELASTIC_RESTART_COUNT`` is counted by
    each node's agent, so it is the same on every worker only on one node; on several nodes this
    returns None and warns unless ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` was given to
    torchrun (as ``slurm/train.sbatch`` does), which makes torchrun use a fresh store per attempt.
    None (plain ``env://``) when torchrun does not share its store.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    if os.environ.get("LOCAL_WORLD_SIZE") != os.environ.get("WORLD_SIZE"):
        if (
            int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0
            and os.environ.get("RANK") == "0"
        ):
            print(
                "warning: restarts on several nodes can hang with torchrun's shared store; "
                "export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 before torchrun "
                "(pytorch/pytorch#135712)",
                flush=True,
            )
        return None
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        int(os.environ["WORLD_SIZE"]),
        is_master=False,
        timeout=timeout,
    )
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"/dpcourse/attempt_{attempt}", store)


def _fingerprint(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def main(argv: list[str] | None = None) -> dict:
    """Train as the command line says; returns a summary (on every rank)."""
    args = parse_args(argv)

    # ---- the process group: torchrun's environment, or the one run_ranks made, or none
    started_group = False
    if not dist.is_initialized() and "WORLD_SIZE" in os.environ:
        timeout = datetime.timedelta(seconds=args.timeout)
        runtime.init_process_group(store=_store_for_this_attempt(timeout), timeout=timeout)
        started_group = True
    info = runtime.current()
    rank, world, device = info.rank, info.world_size, info.device
    if args.strategy == "single" and world > 1:
        raise SystemExit("--strategy single runs on one process; start it without torchrun")
    if args.strategy != "single" and not dist.is_initialized():
        raise SystemExit(
            f"--strategy {args.strategy} needs a process group: start it with torchrun, e.g. "
            f"torchrun --standalone --nproc-per-node=2 -m dpcourse.practice.train --strategy "
            f"{args.strategy}"
        )
    log = runtime.print0
    if args.crash_at_step is not None and args.crash_rank >= world:
        raise SystemExit(f"--crash-rank {args.crash_rank} is not a rank of this job's {world}: "
                         f"give one from 0 to {world - 1}")

    # ---- data: every rank builds the same data set; the sampler gives each its share
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    dataset, collate, model, loss_fn = _data_and_model(args)
    sampler = DistributedSampler(
        dataset, num_replicas=world, rank=rank, shuffle=True, seed=args.seed, drop_last=True
    )
    # A private generator: a DataLoader draws a seed from its generator for every epoch, and
    # the global one is part of what a checkpoint restores.
    loader = DataLoader(
        dataset,
        batch_size=args.batch_size,
        sampler=sampler,
        collate_fn=collate,
        drop_last=True,
        generator=torch.Generator(),
    )
    if len(loader) == 0:
        raise SystemExit(
            f"{args.num_samples} samples make no batch of {args.batch_size} on each of {world} "
            "ranks: lower --batch-size or raise --num-samples"
        )
    torch.manual_seed(args.seed + 1000 * (rank + 1))  # each rank its own dropout masks

    # ---- model and optimizer for the strategy
    model.to(device)
    raw_model = model
    variant = _VARIANT_OF_STRATEGY.get(args.strategy, "none")  # chapter 7's variants, by name
    options = {}
    if variant == "torch DDP":
        options["device_ids"] = [device.index] if device.type == "cuda" else None
    model, synchronise = ddp.wrap(variant, model, **options)
    if args.strategy == "zero":
        # import here: chapter 9, for this strategy only
        from dpcourse.sharding import zero  # noqa: PLC0415

        optimizer = zero.ShardedOptimizer(
            raw_model.parameters(), torch.optim.AdamW, lr=args.lr, weight_decay=args.weight_decay
        )
    else:
        optimizer = torch.optim.AdamW(
            raw_model.parameters(), lr=args.lr, weight_decay=args.weight_decay
        )
    # The learning rate of each step (warm-up, scaling with the world size: chapter 8), set by a
    # torch scheduler, which works on every strategy's optimizer (ShardedOptimizer included).
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_at(s, args.lr, world, args.warmup, args.lr_scaling) / args.lr
    )
    amp = mixed_precision.choose_amp(device) if args.amp == "auto" else None  # chapter 8
    amp_dtype = amp.dtype if amp else {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.amp)
    scaler = torch.amp.GradScaler(device.type, enabled=amp_dtype == torch.float16)

    # ---- resume from the newest checkpoint, if there is one
    step = 0
    if args.checkpoint_dir is not None:
        manifest = checkpoint.latest_checkpoint(args.checkpoint_dir)
        saved_world = manifest["world_size"] if manifest else world
        if saved_world != world and not args.allow_resize:
            raise SystemExit(
                f"the checkpoint in {args.checkpoint_dir} was written by {saved_world} ranks and "
                f"this job has {world}: resume with {saved_world} ranks to continue exactly, or "
                "pass --allow-resize to go on with these (an elastic job that lost a node)"
            )
        resumed = checkpoint.load_checkpoint(
            args.checkpoint_dir, raw_model, optimizer, scaler=scaler, scheduler=scheduler,
            restore_rng=saved_world == world,
        )
        if resumed is not None:
            step = resumed["step"]
            log(f"resumed from {resumed['path']} at step {step}")
        if saved_world != world:
            # What changes when the world does (chapter 8): the global batch, the learning rate
            # the scaling rule gives it, the batches per epoch, and the trajectory.
            old_lr = lr_at(step, args.lr, saved_world, args.warmup, args.lr_scaling)
            new_lr = lr_at(step, args.lr, world, args.warmup, args.lr_scaling)
            for group in optimizer.param_groups:
                group["lr"] = new_lr  # the optimizer's saved rate was the old world's
            log(f"resized from {saved_world} to {world} rank(s) at step {step}: the batch per "
                f"rank stays {args.batch_size}, the global batch goes from "
                f"{saved_world * args.batch_size} to {world * args.batch_size}, the learning "
                f"rate from {old_lr:.2e} to {new_lr:.2e} (--lr-scaling {args.lr_scaling}), an "
                f"epoch has {len(loader)} steps; the random numbers and the order of the data "
                "are not those of a run without the fault")
    log(
        f"training {args.model} with {args.strategy} on {world} rank(s) ({info.backend}, "
        f"{device}): {args.steps} steps of {world} x {args.batch_size} samples"
        + (f"; --amp auto: {amp.reason}" if amp else "")
    )

    # ---- the training loop
    losses: list[float] = []
    t_log, step_log = time.perf_counter(), step
    while step < args.steps:
        epoch, done_in_epoch = divmod(step, len(loader))
        sampler.set_epoch(epoch)  # a new shuffle each epoch, the same on every rank
        for i, batch in enumerate(loader):
            if i < done_in_epoch:
                continue  # batches this epoch had seen before the checkpoint we resumed from
            if step == args.crash_at_step and rank == args.crash_rank:
                marker = args.crash_marker
                if marker is None or not marker.exists():
                    if marker is not None:
                        marker.touch()
                    print(f"rank {rank}: crashing at step {step} (--crash-at-step)", flush=True)
                    os._exit(1)  # no exception, no cleanup: as if the machine had died
            lr = optimizer.param_groups[0]["lr"]  # this step's, from the scheduler
            *inputs, target = (t.to(device) for t in batch)

            # forward and backward (16-bit compute under autocast; the weights stay float32)
            with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
                loss = loss_fn(model(*inputs), target)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()  # scale(loss) is loss itself unless --amp fp16

            # average the (scaled) gradients over the ranks (manual: all-reduce them now;
            # ddp-scratch and ddp-torch finished by the end of backward; zero too, keeping only
            # this rank's shard of the average)
            synchronise()

            # unscale once, clip the synchronised gradients, step (skipped if any inf)
            if args.grad_clip > 0:
                scaler.unscale_(optimizer)
                if args.strategy == "zero":  # the global norm, over every rank's shard
                    optimizer.clip_grad_norm_(args.grad_clip)
                else:
                    torch.nn.utils.clip_grad_norm_(raw_model.parameters(), args.grad_clip)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            step += 1

            # log the loss of the global batch (an all-reduce, so only every few steps)
            if step % args.log_every == 0 or step == args.steps:
                mean_loss = loss.detach().float().clone()
                if world > 1:
                    dist.all_reduce(mean_loss)
                    mean_loss /= world
                losses.append(mean_loss.item())
                ms = (time.perf_counter() - t_log) * 1e3 / (step - step_log)
                t_log, step_log = time.perf_counter(), step
                log(f"step {step:5d} | loss {losses[-1]:.4f} | lr {lr:.2e} | {ms:.1f} ms/step")
            if args.checkpoint_dir is not None and (
                (args.checkpoint_every and step % args.checkpoint_every == 0) or step == args.steps
            ):
                checkpoint.save_checkpoint(
                    args.checkpoint_dir,
                    step,
                    raw_model,
                    optimizer,
                    scaler=scaler if scaler.is_enabled() else None,
                    scheduler=scheduler,
                    progress={"epoch": epoch},
                    sharded_optimizer=args.strategy == "zero",
                )
            if step == args.steps:
                break

    # ---- the replicas must be identical: compare a hash of the weights across ranks
    fingerprint = _fingerprint(raw_model)
    fingerprints = [fingerprint]
    if world > 1:
        fingerprints = [None] * world
        dist.all_gather_object(fingerprints, fingerprint)
    if len(set(fingerprints)) != 1:
        raise RuntimeError(f"the replicas differ after training: weight hashes {fingerprints}")
    log(f"done: {args.steps} steps; replicas identical on {world} rank(s) (weights {fingerprint})")
    summary = {
        "rank": rank,
        "world_size": world,
        "steps": args.steps,
        "losses": losses,
        "fingerprint": fingerprint,
        "params": [p.detach().cpu().clone() for p in raw_model.parameters()],
    }
    if started_group:
        runtime.teardown()
    return summary


if __name__ == "__main__":
    main()
    runtime.end_process(0)  # no interpreter shutdown: gloo's threads can abort it (see there)
