"""Chapter 11: DeviceMesh/DTensor layouts (dpcourse.sharding.mesh) against real DTensors, and a
model built on the meta device, sharded, then materialised row by row (dpcourse.sharding
.meta_init) with our FSDP and with ``fully_shard`` (1-D and 2-D meshes), equal to the same
initialisation made whole in one process. One launch of 4 ranks runs every rank-side check."""

from __future__ import annotations

import warnings
from collections import OrderedDict

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import Replicate, Shard

from dpcourse.harness.launch import run_ranks
from dpcourse.sharding import mesh, meta_init, zero_memory

LAYERS = ["embed", "block", "head"]
PLACEMENTS = [(Shard(0), Shard(0)), (Shard(0), Shard(1)), (Replicate(), Shard(0)),
              (Shard(1), Replicate()), (Replicate(), Replicate()), (Shard(1), Shard(0))]
SHAPES = [(7, 5), (9, 3), (2, 6), (1, 1), (13,)]


def make_net() -> nn.Module:
    return nn.Sequential(OrderedDict(embed=nn.Linear(5, 7), block=nn.Linear(7, 9),
                                     act=nn.Tanh(), head=nn.Linear(9, 3)))


def whole() -> dict:
    return meta_init.init_whole(make_net(), meta_init.row_seeded_init()).state_dict()


def gap(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def _on_rank() -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import distribute_tensor

    from dpcourse.sharding.fsdp import FSDP

    out = {}
    init = meta_init.row_seeded_init()
    # local shapes: ours against DTensor's own, on a 2 x 2 mesh
    mesh2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    coordinate = mesh2.get_coordinate()
    wrong = []
    for shape in SHAPES:
        for placements in PLACEMENTS:
            if any(isinstance(p, Shard) and p.dim >= len(shape) for p in placements):
                continue
            t = distribute_tensor(torch.zeros(shape), mesh2, list(placements))
            want = tuple(t.to_local().shape)
            got = mesh.local_shape(shape, (2, 2), placements, coordinate)
            if got != want:
                wrong.append((shape, placements, got, want))
    out["local_shapes_wrong"] = wrong
    # ours: built on meta, sharded, each rank's rows made
    with torch.device("meta"):
        net = make_net()
    fsdp = FSDP(net, layers=LAYERS)
    out["meta_before"] = all(p.is_meta for p in fsdp.parameters())
    fsdp.materialize("cpu", init)
    out["ours_vs_whole"] = gap(fsdp.full_state_dict(), whole())
    # and it trains as the model initialised whole does
    reference = FSDP(meta_init.init_whole(make_net(), init), layers=LAYERS)
    x = torch.randn(4, 5, generator=torch.Generator().manual_seed(dist.get_rank()))
    for model in (fsdp, reference):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(2):
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            model.finish_gradient_synchronization()
            opt.step()
    out["trained_vs_whole"] = gap(fsdp.full_state_dict(), reference.full_state_dict())
    fsdp.close()
    reference.close()
    # fully_shard: meta, to_empty, each rank's piece filled; on a 1-D mesh and on HSDP's 2-D one
    for name, m in (("1d", init_device_mesh("cpu", (4,))), ("2d", mesh2)):
        with torch.device("meta"):
            net = make_net()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for layer in LAYERS:
                fully_shard(net.get_submodule(layer), mesh=m)
            fully_shard(net, mesh=m)
        net.to_empty(device="cpu")
        meta_init.materialize_dtensors(net, init)
        state = {k: v.full_tensor() for k, v in net.state_dict().items()}
        out[f"torch_{name}_vs_whole"] = gap(state, whole())
    return out


@pytest.fixture(scope="module")
def runs():
    return run_ranks(_on_rank, 4, backend="gloo", timeout=240)  # the host, on every machine


def test_local_shapes_are_dtensors(runs):
    for r in runs:
        assert r["local_shapes_wrong"] == []


def test_meta_model_materialised_by_rows_equals_the_whole_initialisation(runs):
    for r in runs:
        assert r["meta_before"]
        assert r["ours_vs_whole"] == 0 and r["trained_vs_whole"] == 0
        assert r["torch_1d_vs_whole"] == 0 and r["torch_2d_vs_whole"] == 0


def test_chunk_rows_is_torch_chunk():
    for size in range(0, 12):
        for parts in range(1, 6):
            pieces = torch.arange(size).chunk(parts)
            got = [mesh.chunk_rows(size, parts, i) for i in range(parts)]
            want = [(int(p[0]), int(p[-1]) + 1) for p in pieces if p.numel()]
            assert [g for g in got if g[1] > g[0]] == want
    assert mesh.chunk_rows(7, 3, 2) == (6, 7)  # 3, 3, 1: not the ring's 3, 2, 2
    with pytest.raises(ValueError, match="need 0 <= index < parts"):
        mesh.chunk_rows(7, 3, 3)


def test_row_seeded_init_does_not_depend_on_how_rows_are_cut():
    init = meta_init.row_seeded_init()
    full = init("w", (9, 4), 0, 9)
    assert torch.equal(torch.cat([init("w", (9, 4), 0, 4), init("w", (9, 4), 4, 9)]), full)
    assert not torch.equal(init("v", (9, 4), 0, 9), full)
    assert full.std().item() == pytest.approx(0.02, rel=0.3)
    assert init("b", (9,), 2, 5).abs().sum() == 0


def test_largest_model():
    gib = 2**30
    whole = meta_init.largest_model(80 * gib)  # mixed-precision Adam: 16 bytes a parameter
    assert whole == 80 * gib // 16
    sharded = meta_init.largest_model(80 * gib, 64, stage=3)
    assert 63 * whole < sharded <= 64 * whole
    used = zero_memory.memory_per_rank(sharded, 64, 3).total
    assert used <= 80 * gib < zero_memory.memory_per_rank(sharded + 64, 64, 3).total
    assert meta_init.largest_model(10 * gib, activation_bytes=20 * gib) == 0
