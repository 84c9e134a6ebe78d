"""Loops that rely on how torch's optimizers behave (issue 35), ours against torch's on the same
inputs: ShardedOptimizer against torch's DDP with an unsharded optimizer and against
ZeroRedundancyOptimizer, FSDP and chapter 7's DDP against torch's DDP; SGD with momentum and
AdamW, 2 and 3 ranks. The scenarios: ``zero_grad`` after backward (with ``set_to_none`` and
without), parameters without a gradient (in some steps, on some ranks, never; frozen), a step
with a closure or keyword arguments, uneven inputs under ``Join``, and loading a full
(unsharded) optimizer state or a sharded one saved on another number of ranks.

torch's reference is ``DistributedDataParallel(find_unused_parameters=True)``: a parameter that
no rank used keeps ``.grad`` as it was (``None`` after ``zero_grad()``), and the optimizer skips
it; one that some ranks used gets the average, the others counting as zeros.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from dpcourse import runtime
from dpcourse.harness.launch import run_ranks

RTOL, ATOL = 1e-5, 1e-6  # float32 sums in another order, through Adam (as tests/test_zero.py)
OPTIMIZERS = {
    "SGD": (torch.optim.SGD, dict(lr=0.05, momentum=0.9, weight_decay=0.01)),
    "AdamW": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
}
# Per step: whether `late` runs (on every rank), the ranks on which `side` runs, and what the
# loop does between backward and step: nothing, zero_grad() (the step must not move anything),
# or zero_grad(set_to_none=False) (the step moves what had a gradient by momentum and decay).
# `late` runs in step 0 only, `never` in none, `side` on one rank or two (none in step 1, where
# nothing is stepped). No parameter comes back after a step that stepped others without it: for
# that, ShardedOptimizer's Adam counts steps per shard, not per parameter (see
# test_a_parameter_that_comes_back_..., below).
WORLDS, WORLD_IDS = [(2, 1), (3, 2)], ["2 ranks stage 1", "3 ranks stage 2"]
PLAN = [
    (True, {0}, None),
    (False, set(), "zero_grad"),
    (False, {1}, None),
    (False, {0}, "zero_grad(set_to_none=False)"),
    (False, {0, 2}, None),
    (False, {1}, None),
]


class Net(nn.Module):
    """A trunk and a head used in every step; ``late`` only where the plan says (every rank
    alike), ``side`` on some ranks in some steps, ``never`` in no step; ``frozen`` is frozen."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(5, 6)
        self.frozen = nn.Linear(6, 6).requires_grad_(False)
        self.late = nn.Linear(6, 6)
        self.side = nn.Linear(6, 6)
        self.never = nn.Linear(6, 6)
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor, late: bool, side: bool) -> torch.Tensor:
        h = self.frozen(torch.tanh(self.trunk(x)))
        if late:
            h = h + torch.tanh(self.late(h))
        if side:
            h = h + torch.tanh(self.side(h))
        return self.head(h)


def make_net(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net().to(runtime.device())


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    device = runtime.device()
    return torch.randn(4, 5, generator=g).to(device), torch.randn(4, 3, generator=g).to(device)


def weights(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).cpu() for p in model.parameters()])


def run_plan(model, forward, opt, finish=lambda: None, whole=None) -> list[torch.Tensor]:
    """The plan's steps in a torch-style loop; the weights after each step (``whole()``: the
    full weights, for FSDP)."""
    rank = dist.get_rank()
    after = []
    for s, (late, side, action) in enumerate(PLAN):
        x, y = batch(s, rank)
        opt.zero_grad()
        nn.functional.mse_loss(forward(x, late, rank in side), y).backward()
        finish()
        if action == "zero_grad":
            opt.zero_grad()
        elif action is not None:
            opt.zero_grad(set_to_none=False)
        opt.step()
        after.append(whole() if whole else weights(model))
    return after


def torch_ddp(model: nn.Module) -> nn.Module:
    return nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)


def compare(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    for s, (a, b) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL, msg=lambda m, s=s: f"step {s}: {m}")
    return max((a - b).abs().max().item() for a, b in zip(got, want, strict=True))


# ------------------------------------------------------------------ zero_grad, unused parameters
def _plan_on_rank(stage: int) -> dict:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    from dpcourse.ddp.ddp import DDP
    from dpcourse.sharding.fsdp import FSDP
    from dpcourse.sharding.zero import ShardedOptimizer

    out = {}
    for name, (cls, kwargs) in OPTIMIZERS.items():
        ref = make_net()
        ddp = torch_ddp(ref)
        want = run_plan(ref, ddp, cls(ref.parameters(), **kwargs))
        out[name, "never moved (torch)"] = torch.equal(ref.never.weight, make_net().never.weight)

        zref = make_net()
        zddp = torch_ddp(zref)
        zero = ZeroRedundancyOptimizer(zref.parameters(), cls, **kwargs)
        out[name, "ZeroRedundancyOptimizer"] = compare(run_plan(zref, zddp, zero), want)

        model = make_net()
        opt = ShardedOptimizer(model.parameters(), cls, stage=stage, **kwargs)
        out[name, "ShardedOptimizer"] = compare(run_plan(model, model, opt), want)

        model = make_net()
        ours = DDP(model, find_unused_parameters=True)
        out[name, "DDP"] = compare(run_plan(model, ours, cls(model.parameters(), **kwargs)), want)

        model = make_net()
        fsdp = FSDP(model, layers=["trunk", "late", "never"])
        fopt = cls([p for p in fsdp.parameters() if p.requires_grad], **kwargs)
        full = run_plan(fsdp, fsdp, fopt, fsdp.finish_gradient_synchronization,
                        whole=lambda fsdp=fsdp: torch.cat([t.reshape(-1).cpu() for t in
                                                           fsdp.full_state_dict().values()]))
        fsdp.close()
        out[name, "FSDP"] = compare(full, want)
    return out


@pytest.mark.parametrize("world,stage", WORLDS, ids=WORLD_IDS)
def test_zero_grad_and_parameters_without_gradients_as_torch(world, stage):
    """zero_grad after backward discards the averaged gradients; a parameter that no rank used
    since zero_grad is not stepped (Adam's momentum and weight decay do not move it); one used
    on some ranks is stepped with the average: ShardedOptimizer, FSDP (its shards' .grad) and
    DDP(find_unused_parameters=True) as torch's DDP with a torch optimizer, and as
    ZeroRedundancyOptimizer, after every step."""
    per_rank = run_ranks(_plan_on_rank, world, stage, timeout=240)
    for r in per_rank:
        for name in OPTIMIZERS:
            assert r[name, "never moved (torch)"]  # the reference skipped what no rank used
            for kind in ("ZeroRedundancyOptimizer", "ShardedOptimizer", "DDP", "FSDP"):
                assert r[name, kind] <= ATOL + RTOL, (name, kind)


def _issue_examples_on_rank() -> dict:
    """The two loops of the issue, each with one scalar parameter per role."""
    from dpcourse.sharding.zero import ShardedOptimizer

    device = runtime.device()
    out = {}
    for sharded in (False, True):
        x = nn.Parameter(torch.ones(1, device=device))
        opt = (ShardedOptimizer([x], torch.optim.SGD, lr=0.01) if sharded
               else torch.optim.SGD([x], lr=0.01))
        x.sum().backward()
        if not sharded:
            dist.all_reduce(x.grad)
        opt.zero_grad()
        opt.step()
        out["zero_grad", sharded] = x.item()

        a = nn.Parameter(torch.ones(1, device=device))
        b = nn.Parameter(torch.ones(1, device=device))
        opt = (ShardedOptimizer([a, b], torch.optim.Adam, lr=0.1) if sharded
               else torch.optim.Adam([a, b], lr=0.1))
        for step in range(3):
            opt.zero_grad()
            loss = a.sum() + (b.sum() if step == 0 else 0)
            loss.backward()
            opt.step()
        out["adam", sharded] = (a.item(), b.item())
    return out


def test_the_issues_examples():
    for r in run_ranks(_issue_examples_on_rank, 2, timeout=60):
        assert r["zero_grad", True] == r["zero_grad", False] == 1.0  # was 0.99
        assert r["adam", True] == pytest.approx(r["adam", False], abs=1e-7)
        assert r["adam", True][1] == pytest.approx(0.9, abs=1e-6)  # was 0.781


def _no_zero_grad_on_rank(stage: int) -> dict:
    """A loop that never calls zero_grad: torch's gradients add up from step to step (DDP
    averages the sum), and so must ours; in two parameter groups, `late` (step 0 only) in the
    first and `never` in the second."""
    from dpcourse.sharding.zero import ShardedOptimizer

    rank = dist.get_rank()
    out = {}
    for name, (cls, kwargs) in OPTIMIZERS.items():
        runs = []
        for sharded in (False, True):
            model = make_net()
            forward = model if sharded else torch_ddp(model)
            params = list(model.parameters())
            groups = [{"params": params[:6]}, {"params": params[6:], "lr": kwargs["lr"] / 2}]
            opt = (ShardedOptimizer(groups, cls, stage=stage, **kwargs) if sharded
                   else cls(groups, **kwargs))
            for s in range(4):
                x, y = batch(s, rank)
                nn.functional.mse_loss(forward(x, s == 0, rank == 0), y).backward()
                opt.step()
            runs.append(weights(model))
        out[name] = compare([runs[1]], [runs[0]])
    return out


@pytest.mark.parametrize("world,stage", WORLDS, ids=WORLD_IDS)
def test_without_zero_grad_gradients_add_up_across_steps(world, stage):
    for r in run_ranks(_no_zero_grad_on_rank, world, stage, timeout=120):
        assert all(gap <= ATOL + RTOL for gap in r.values()), r


def _comes_back_on_rank(own_group: bool, name: str) -> dict:
    """`late` used in steps 0 and 3 only: skipped in steps 1 and 2, which step the others. In a
    group of its own, ours skips the group's step (its Adam step counter too) while `late` has
    no gradient, and equals torch's. In a group with other parameters its weights and state are
    kept, but the group's one step counter runs on, where torch counts per parameter: Adam's
    bias correction then differs when `late` comes back (SGD's momentum has no counter)."""
    from dpcourse.sharding.zero import ShardedOptimizer

    rank = dist.get_rank()
    cls, kwargs = OPTIMIZERS[name]

    def groups(model):
        late = list(model.late.parameters())
        rest = [p for n, p in model.named_parameters() if not n.startswith("late")]
        return [{"params": rest}, {"params": late}] if own_group else [{"params": rest + late}]

    runs = []
    for sharded in (False, True):
        model = make_net()
        forward = model if sharded else torch_ddp(model)
        opt = (ShardedOptimizer(groups(model), cls, **kwargs) if sharded
               else cls(groups(model), **kwargs))
        for s in range(5):
            x, y = batch(s, rank)
            opt.zero_grad()
            nn.functional.mse_loss(forward(x, s in (0, 3), True), y).backward()
            opt.step()
        runs.append(weights(model))
    return {"gap": (runs[0] - runs[1]).abs().max().item()}


def test_a_parameter_that_comes_back_after_skipped_steps():
    for own_group, name in [(True, "AdamW"), (True, "SGD"), (False, "SGD")]:
        for r in run_ranks(_comes_back_on_rank, 2, own_group, name, timeout=60):
            assert r["gap"] <= ATOL + RTOL, (own_group, name)
    # the design difference chapter 9 states: one Adam step counter per group's shard
    gaps = [r["gap"] for r in run_ranks(_comes_back_on_rank, 2, False, "AdamW", timeout=60)]
    assert max(gaps) > 1e-4


# ----------------------------------------------------------------------------- step(closure)
class SGDWithScale(torch.optim.SGD):
    """SGD whose step takes a keyword argument, as some optimizers' do."""

    @torch.no_grad()
    def step(self, closure=None, *, grad_scale: float = 1.0):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.mul_(grad_scale)
        super().step()
        return loss


def _closure_on_rank(stage: int) -> dict:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    from dpcourse.sharding.zero import ShardedOptimizer

    rank = dist.get_rank()
    out = {}

    def train(model, forward, opt, **step_kwargs):
        losses = []
        for s in range(4):
            x, y = batch(s, rank)

            def closure(x=x, y=y):
                opt.zero_grad()
                loss = nn.functional.mse_loss(forward(x, True, True), y)
                loss.backward()
                return loss

            losses.append(opt.step(closure, **step_kwargs).item())
        return weights(model), losses

    for name, (cls, kwargs) in {**OPTIMIZERS, "kwargs": (SGDWithScale, dict(lr=0.1))}.items():
        step_kwargs = {"grad_scale": 0.5} if name == "kwargs" else {}
        ref = make_net()
        want = train(ref, torch_ddp(ref), cls(ref.parameters(), **kwargs), **step_kwargs)
        zref = make_net()
        zero = ZeroRedundancyOptimizer(zref.parameters(), cls, **kwargs)
        zero_run = train(zref, torch_ddp(zref), zero, **step_kwargs)
        model = make_net()
        got = train(model, model, ShardedOptimizer(model.parameters(), cls, stage=stage, **kwargs),
                    **step_kwargs)
        out[name] = (compare([got[0]], [want[0]]), compare([zero_run[0]], [want[0]]),
                     got[1], want[1])
    try:
        ShardedOptimizer(make_net().parameters(), torch.optim.LBFGS)
        out["lbfgs"] = None
    except ValueError as exc:
        out["lbfgs"] = str(exc)
    return out


@pytest.mark.parametrize("world,stage", WORLDS, ids=WORLD_IDS)
def test_step_takes_a_closure_and_keyword_arguments(world, stage):
    for r in run_ranks(_closure_on_rank, world, stage, timeout=120):
        for name in (*OPTIMIZERS, "kwargs"):
            ours, zero, got_losses, want_losses = r[name]
            assert ours <= ATOL + RTOL and zero <= ATOL + RTOL
            assert got_losses == pytest.approx(want_losses, rel=1e-5)  # step returns the loss
        assert "LBFGS cannot be sharded" in r["lbfgs"]


# -------------------------------------------------------------------------- uneven inputs, Join
def _join_on_rank(stage: int, clip: float | None) -> dict:
    """Rank r has 2 + r batches, under Join: ours against torch's DDP with the unsharded
    optimizer (whose join hook gives the last ranks' average, the joined ranks counting as zeros
    over all N, and whose last joiner's weights are every rank's at the end)."""
    from torch.distributed.algorithms.join import Join

    from dpcourse.sharding.zero import ShardedOptimizer

    rank = dist.get_rank()
    out = {}

    def train(model, forward, opt, joinables, sharded):
        with Join(joinables):
            for s in range(2 + rank):
                x, y = batch(s, rank)
                opt.zero_grad()
                nn.functional.mse_loss(forward(x, True, True), y).backward()
                if clip is not None:
                    if sharded:
                        opt.clip_grad_norm_(clip)
                    else:
                        nn.utils.clip_grad_norm_(forward.parameters(), clip)
                opt.step()
        return weights(model)

    for name, (cls, kwargs) in OPTIMIZERS.items():
        ref = make_net()
        ddp = torch_ddp(ref)
        want = train(ref, ddp, cls(ref.parameters(), **kwargs), [ddp], False)
        model = make_net()
        opt = ShardedOptimizer(model.parameters(), cls, stage=stage, **kwargs)
        out[name] = compare([train(model, model, opt, [opt], True)], [want])
        out[name, "moved"] = (want - weights(make_net())).abs().max().item()
    return out


@pytest.mark.parametrize("world,stage,clip", [(2, 1, None), (3, 2, None), (3, 1, 0.05)],
                         ids=["2 ranks stage 1", "3 ranks stage 2", "3 ranks, clipped"])
def test_uneven_inputs_under_join(world, stage, clip):
    for r in run_ranks(_join_on_rank, world, stage, clip, timeout=120):
        for name in OPTIMIZERS:
            assert r[name] <= ATOL + RTOL and r[name, "moved"] > 1e-3


def _join_throws_on_rank() -> str:
    from torch.distributed.algorithms.join import Join

    from dpcourse.sharding.zero import ShardedOptimizer

    rank = dist.get_rank()
    model = make_net()
    opt = ShardedOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    try:
        with Join([opt], throw_on_early_termination=True):
            for s in range(2 + rank):
                x, y = batch(s, rank)
                opt.zero_grad()
                nn.functional.mse_loss(model(x, True, True), y).backward()
                opt.step()
    except RuntimeError as exc:
        return str(exc)
    return "no error"


def test_join_can_stop_every_rank_at_the_first_to_run_out():
    messages = run_ranks(_join_throws_on_rank, 2, timeout=60)
    assert "exhausted all inputs" in messages[0]
    assert "Detected at least one rank that exhausted inputs" in messages[1]


# --------------------------------------------------------------------- loading a full state
def _full_state_on_rank(directory: str) -> dict:
    """3 AdamW steps with a plain optimizer (torch's DDP), a checkpoint of chapter 8
    (checkpoint.save_checkpoint), 3 more; ShardedOptimizer loads that checkpoint (and the plain
    state_dict itself) and takes the same 3 steps."""
    from dpcourse.practice import checkpoint
    from dpcourse.sharding.zero import ShardedOptimizer

    rank = dist.get_rank()
    cls, kwargs = OPTIMIZERS["AdamW"]

    def steps(model, forward, opt, first):
        for s in range(first, first + 3):
            x, y = batch(s, rank)
            opt.zero_grad()
            nn.functional.mse_loss(forward(x, s == 0, rank == 0), y).backward()
            opt.step()

    ref = make_net()
    ddp = torch_ddp(ref)
    opt = cls(ref.parameters(), **kwargs)
    steps(ref, ddp, opt, 0)
    checkpoint.save_checkpoint(directory, 3, ref, opt)
    full = copy.deepcopy(opt.state_dict())  # state_dict() holds the live tensors
    steps(ref, ddp, opt, 3)
    out = {}
    for how in ("load_checkpoint", "load_state_dict"):
        model = make_net(seed=1)
        sharded = ShardedOptimizer(model.parameters(), cls, lr=1.0)
        if how == "load_checkpoint":
            checkpoint.load_checkpoint(directory, model, sharded)
        else:
            model.load_state_dict(torch.load(f"{directory}/step-00000003/checkpoint.pt",
                                             weights_only=True)["model"])
            sharded.load_state_dict(full)
        steps(model, model, sharded, 3)
        out[how] = compare([weights(model)], [weights(ref)])
        out[how, "lr"] = sharded.param_groups[0]["lr"]
    try:
        ShardedOptimizer(list(make_net().trunk.parameters()), cls).load_state_dict(full)
    except ValueError as exc:
        out["other_params"] = str(exc)
    return out


def test_a_plain_optimizers_state_loads_sharded(tmp_path):
    for world in (2, 3):
        for r in run_ranks(_full_state_on_rank, world, str(tmp_path / str(world)), timeout=120):
            assert r["load_checkpoint"] <= ATOL + RTOL and r["load_state_dict"] <= ATOL + RTOL
            assert r["load_checkpoint", "lr"] == r["load_state_dict", "lr"] == 1e-2
            assert "parameter group(s) of [12] parameters" in r["other_params"]


def _save_sharded_on_rank(directory: str) -> None:
    """3 AdamW steps of ShardedOptimizer, saved as chapter 9 and chapter 8 save it: each rank's
    state_dict() in a file, a checkpoint with sharded_optimizer=True, and the consolidated state."""
    from dpcourse.practice import checkpoint
    from dpcourse.sharding.zero import ShardedOptimizer

    rank = dist.get_rank()
    cls, kwargs = OPTIMIZERS["AdamW"]
    model = make_net()
    opt = ShardedOptimizer(model.parameters(), cls, **kwargs)
    for s in range(3):
        x, y = batch(s, rank)
        opt.zero_grad()
        nn.functional.mse_loss(model(x, s == 0, rank == 0), y).backward()
        opt.step()
    torch.save(opt.state_dict(), f"{directory}/optimizer.rank{rank}.pt")
    full = opt.consolidate_state_dict(to=0)
    if rank == 0:
        torch.save({"model": model.state_dict(), "full": full}, f"{directory}/full.pt")
    checkpoint.save_checkpoint(f"{directory}/ckpt", 3, model, opt, sharded_optimizer=True)


def _reshard_on_rank(directory: str, saved_world: int) -> dict:
    """On another number of ranks: a plain AdamW (torch's DDP) from the consolidated state,
    and ShardedOptimizer from every rank's files, from the consolidated state and through
    load_checkpoint (restore_rng=False); 3 more steps each."""
    from dpcourse.practice import checkpoint
    from dpcourse.sharding.zero import ShardedOptimizer

    rank = dist.get_rank()
    cls, _ = OPTIMIZERS["AdamW"]
    saved = torch.load(f"{directory}/full.pt", weights_only=True)
    files = [torch.load(f"{directory}/optimizer.rank{r}.pt", weights_only=True)
             for r in range(saved_world)]

    def steps(forward, opt):
        for s in range(3, 6):
            x, y = batch(s, rank)
            opt.zero_grad()
            nn.functional.mse_loss(forward(x, False, True), y).backward()
            opt.step()

    ref = make_net(seed=1)
    ref.load_state_dict(saved["model"])
    ref_opt = cls(ref.parameters(), lr=1.0)
    ref_opt.load_state_dict(copy.deepcopy(saved["full"]))  # torch's load keeps the tensors
    steps(torch_ddp(ref), ref_opt)
    out = {}
    for how in ("files", "consolidated", "load_checkpoint"):
        model = make_net(seed=1)
        opt = ShardedOptimizer(model.parameters(), cls, lr=1.0)
        if how == "load_checkpoint":
            checkpoint.load_checkpoint(f"{directory}/ckpt", model, opt, restore_rng=False)
        else:
            model.load_state_dict(saved["model"])
            opt.load_state_dict(files if how == "files" else saved["full"])
        steps(model, opt)
        out[how] = compare([weights(model)], [weights(ref)])
    try:
        checkpoint.load_checkpoint(f"{directory}/ckpt", make_net(), opt)
    except ValueError as exc:
        out["with_rng"] = str(exc)
    try:
        opt.load_state_dict(files[:1])
    except ValueError as exc:
        out["one_file"] = str(exc)
    return out


def test_a_sharded_state_loads_on_another_number_of_ranks(tmp_path):
    run_ranks(_save_sharded_on_rank, 3, str(tmp_path), timeout=120)
    for r in run_ranks(_reshard_on_rank, 2, str(tmp_path), 3, timeout=120):
        assert r["files"] <= ATOL + RTOL and r["consolidated"] <= ATOL + RTOL
        assert r["load_checkpoint"] <= ATOL + RTOL
        assert "restore_rng=False" in r["with_rng"]
        assert "ranks 0 to 2 of one run" in r["one_file"]


def _zeros_on_rank() -> dict:
    """Without find_unused_parameters, chapter 7's DDP (and its steps 2 and 3) average a missing
    gradient as zeros: AdamW's weight decay then moves `never`, which torch's optimizer skips."""
    from dpcourse.ddp import ddp

    rank = dist.get_rank()
    moved = {}
    for variant in ("step 2", "step 3", "DDP"):
        model = make_net()
        wrapped, finish = ddp.wrap(variant, model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        x, y = batch(0, rank)
        nn.functional.mse_loss(wrapped(x, True, True), y).backward()
        finish()
        opt.step()
        moved[variant] = not torch.equal(model.never.weight, make_net().never.weight)
    return moved


def test_without_find_unused_parameters_a_missing_gradient_is_zeros():
    for r in run_ranks(_zeros_on_rank, 2, timeout=60):
        assert all(r.values()), r
