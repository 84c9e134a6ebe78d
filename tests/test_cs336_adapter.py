"""tools/cs336/adapters.py, CS336 assignment 2's ``tests/adapters.py`` written with the course's
classes: each function gives our class with the options CS336's tests need, and does what they
ask of it, on 2 gloo ranks. No CS336 code here (CONTRIBUTING.md, "CS336's tests", says how their
suite ran on the adapter); the models below only have its shapes: a bias-free ``Linear`` and an
``Embedding`` of a learner's own, an RMS norm that stays replicated, and torch's ``nn.Linear``.
"""

from __future__ import annotations

import importlib.util
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from dpcourse import runtime
from dpcourse.harness.launch import run_ranks

ADAPTER = Path(__file__).resolve().parents[1] / "tools" / "cs336" / "adapters.py"
# The functions CS336's tests/adapters.py declares (release 26.1.1); the first two are not ours.
FLASH_ATTENTION = ("get_flashattention_autograd_function_pytorch",
                   "get_flashattention_autograd_function_triton")
OURS = ("get_ddp", "ddp_on_after_backward", "get_fsdp", "fsdp_on_after_backward",
        "fsdp_gather_full_params", "get_sharded_optimizer")


def load_adapter():
    """tools/cs336/adapters.py as a module (tools/ is not a package)."""
    spec = importlib.util.spec_from_file_location("cs336_adapters", ADAPTER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Linear(nn.Module):
    """A learner's assignment-1 linear layer: a weight of (out, in), no bias."""

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d_out, d_in) / d_in**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.T


class Embedding(nn.Module):
    def __init__(self, vocab: int, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(vocab, d))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.weight[ids]


class RMSNorm(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = RMSNorm(4)
        self.up = Linear(4, 6)
        self.down = nn.Linear(6, 4)  # torch's: its name is Linear too

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(self.norm(x))))


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(OrderedDict(embed=Embedding(10, 4), block=Block(),
                                     head=Linear(4, 10))).to(runtime.device())


def test_the_adapter_declares_cs336s_functions_and_leaves_flash_attention_alone():
    adapters = load_adapter()
    for name in FLASH_ATTENTION + OURS:
        assert callable(getattr(adapters, name, None)), f"the adapter lacks {name}"
    for name in FLASH_ATTENTION:
        with pytest.raises(NotImplementedError):
            getattr(adapters, name)()


def _on_rank() -> dict:
    from dpcourse.ddp.ddp import PerParameterDDP
    from dpcourse.sharding.fsdp import FSDP
    from dpcourse.sharding.zero import ShardedOptimizer

    adapters = load_adapter()
    rank, world, dev = dist.get_rank(), dist.get_world_size(), runtime.device()
    out = {}

    torch.manual_seed(rank)  # each rank its own start: get_ddp takes rank 0's
    net = nn.Linear(3, 2).to(dev)
    ddp = adapters.get_ddp(net)
    weights = [torch.empty_like(net.weight) for _ in range(world)]
    dist.all_gather(weights, net.weight.detach())
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(rank)).to(dev)
    expected = torch.autograd.grad(net(x).sum(), net.weight)[0]
    dist.all_reduce(expected)
    ddp(x).sum().backward()
    adapters.ddp_on_after_backward(ddp, None)
    out["ddp"] = dict(cls=type(ddp) is PerParameterDDP, module=ddp.module is net,
                      broadcast=all(torch.equal(w, weights[0]) for w in weights),
                      mean=torch.allclose(net.weight.grad, expected / world, atol=1e-6))

    model = make_model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    fsdp = adapters.get_fsdp(model, compute_dtype=torch.bfloat16)
    full = adapters.fsdp_gather_full_params(fsdp)
    ids = torch.randint(0, 10, (3, 5), generator=torch.Generator().manual_seed(rank)).to(dev)
    fsdp(ids).float().sum().backward()
    adapters.fsdp_on_after_backward(fsdp, None)
    out["fsdp"] = dict(
        cls=type(fsdp) is FSDP, layers=[layer.name for layer in fsdp.layers],
        compute_dtype=fsdp.compute_dtype, replicated=[p is model.block.norm.weight
                                                      for p in fsdp.replicated],
        full=sorted(full) == sorted(before) and all(torch.equal(full[n], t)
                                                    for n, t in before.items()),
        grads={n: (p.grad is not None and p.grad.shape == p.shape, p.grad.dtype)
               for n, p in fsdp.module.named_parameters()})

    model = make_model()
    opt = adapters.get_sharded_optimizer(model.parameters(), torch.optim.AdamW, lr=0.1,
                                         weight_decay=0.1, betas=(0.9, 0.999), eps=1e-8)
    group = opt.param_groups[0]
    out["zero"] = dict(cls=type(opt) is ShardedOptimizer, stage=opt.stage,
                       inner=type(opt.optimizer) is torch.optim.AdamW,
                       options=(group["lr"], group["weight_decay"], group["betas"], group["eps"]))
    return out


def test_each_function_gives_our_class_with_cs336s_options():
    for out in run_ranks(_on_rank, 2, backend="gloo", timeout=120):
        assert out["ddp"] == dict(cls=True, module=True, broadcast=True, mean=True)
        fsdp = out["fsdp"]
        assert fsdp["cls"] and fsdp["compute_dtype"] == torch.bfloat16
        # every Linear and Embedding, nested or torch's, is sharded; the norm is replicated
        assert fsdp["layers"] == ["embed", "block.up", "block.down", "head"]
        assert fsdp["replicated"] == [True]
        assert fsdp["full"], "fsdp_gather_full_params is not the whole model's parameters"
        # CS336's gradient check: every parameter's gradient has its shape, in fp32 (the masters)
        assert fsdp["grads"] == {n: (True, torch.float32) for n in fsdp["grads"]}
        assert len(fsdp["grads"]) == 6
        assert out["zero"] == dict(cls=True, stage=1, inner=True,
                                   options=(0.1, 0.1, (0.9, 0.999), 1e-8))
