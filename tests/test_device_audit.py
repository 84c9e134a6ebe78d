"""The device audit (dpcourse.harness.device_audit): on this CPU, ranks behave as on a machine with
a GPU
per rank and NCCL, and fail where that machine would.

The audit's own rules are tested in ranks started with ``DPCOURSE_DEVICE_AUDIT=1``; then chapter
9's Transformer cell, whose batches once stayed on the CPU while its model went to
``runtime.device()`` (``cuda:0`` on a GPU machine), fails under the audit in its old form and runs
in the form the chapter has now. ``make audit`` runs every notebook this way.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from dpcourse.harness import device_audit
from dpcourse.harness.launch import RankError, RankPool
from dpcourse.harness.launch.job import host_dumps

ROOT = Path(__file__).resolve().parents[1]
CHAPTER_9 = ROOT / "chapters" / "09_sharded_optimizers.ipynb"


@pytest.fixture(scope="module")
def audited():
    """Two ranks under the audit, as ``make audit`` starts them."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(device_audit.ENV, "1")
        with RankPool(2) as pool:
            yield pool


def _raises(fn) -> str:
    try:
        fn()
    except device_audit.DeviceAuditError as exc:
        return str(exc)
    return "no error"


def _mixing_on_rank():
    from dpcourse import runtime

    dev = runtime.device()
    model = torch.nn.Linear(5, 2).to(dev)
    host = torch.randn(3, 5)
    return {
        "audited": device_audit.enabled() and dev is device_audit.DEVICE,
        "model on host batch": _raises(lambda: model(host)),
        "moved batch": _raises(lambda: model(host.to(dev)).sum().backward()),
        "made on the device": _raises(lambda: model(torch.randn(3, 5, device=dev))),
        "0-dim host scalar": _raises(lambda: model.weight * torch.tensor(2.0)),
        "numpy of a device tensor": _raises(lambda: model.weight.numpy()),
        "numpy after .cpu()": _raises(lambda: model.weight.detach().cpu().numpy()),
        "to(p.device)": _raises(lambda: model(host.to(model.weight.device))),
        "host model, device batch": _raises(
            lambda: torch.nn.Linear(5, 2)(torch.randn(3, 5, device=dev))
        ),
    }


def test_mixing_host_and_device_tensors_fails_as_on_cuda(audited):
    got = audited.run(_mixing_on_rank)[0]
    assert got.pop("audited")
    assert "linear() got host tensor(s) of shape [(3, 5)]" in got.pop("model on host batch")
    assert "linear() got host tensor(s)" in got.pop("host model, device batch")
    assert "numpy" in got.pop("numpy of a device tensor")
    assert set(got.values()) == {"no error"}, got  # what a GPU machine also runs


def _collectives_on_rank():
    from dpcourse import runtime

    dev = runtime.device()
    rank, peer = dist.get_rank(), 1 - dist.get_rank()
    from dpcourse.collectives import p2p

    out = {"host all_reduce": _raises(lambda: dist.all_reduce(torch.ones(3)))}
    out["NCCL's code path"] = not p2p.posts_ahead()  # the package's collectives step as on NCCL
    host_ops = [dist.P2POp(dist.isend, torch.ones(2), peer), dist.P2POp(dist.irecv, torch.ones(2),
                                                                       peer)]
    out["host batch_isend_irecv"] = _raises(lambda: dist.batch_isend_irecv(host_ops))
    x = torch.full((3,), float(rank + 1), device=dev)
    dist.all_reduce(x)
    ops = [dist.P2POp(dist.isend, x.clone(), peer), dist.P2POp(dist.irecv, x.clone(), peer)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    objects = [None, None]
    dist.all_gather_object(objects, {"rank": rank})  # torch packs these itself
    side = dist.new_group(backend="gloo")  # a gloo group takes host tensors on any machine
    flag = torch.ones(1)
    dist.all_reduce(flag, group=side)
    out["side group"] = flag.item()
    out["sum"] = x.tolist()
    out["objects"] = objects
    out["returned"] = x
    return out


def test_host_tensors_in_collectives_fail_as_on_nccl(audited):
    got = audited.run(_collectives_on_rank)
    for rank in got:
        assert "all_reduce got a host tensor of shape (3,)" in rank["host all_reduce"]
        assert "No backend type associated with device type cpu" in rank["host all_reduce"]
        assert "isend got a host tensor" in rank["host batch_isend_irecv"]
        assert rank["sum"] == [3.0, 3.0, 3.0]
        assert rank["objects"] == [{"rank": 0}, {"rank": 1}]
        assert rank["side group"] == 2.0
        assert rank["NCCL's code path"]
        # results come back on the host, whatever device the rank used
        assert device_audit.where(rank["returned"]) == "host"


def test_results_travel_back_on_the_cpu():
    t = torch.ones(2)
    device_audit.tag(t, "device")  # what a tensor on the audited device carries
    back = pickle.loads(host_dumps({"x": [t]}))["x"][0]
    assert device_audit.where(back) == "host" and torch.equal(back, t.cpu())


def _cluster_rank():
    from dpcourse import runtime

    x = torch.ones(3)  # gloo on a cluster takes the host tensor
    dist.all_reduce(x)
    model = torch.nn.Linear(3, 1).to(runtime.device())
    return x.tolist(), _raises(lambda: model(torch.ones(2, 3)))


def test_cluster_ranks_run_gloo_and_still_check_devices(monkeypatch):
    monkeypatch.setenv(device_audit.ENV, "1")
    with RankPool(2, backend="gloo") as pool:  # what ranks on an emulated cluster get
        for summed, mixing in pool.run(_cluster_rank):
            assert summed == [2.0, 2.0, 2.0]
            assert "linear() got host tensor(s)" in mixing


def test_the_notebook_kernel_is_audited_outside_a_process_group():
    code = (
        "import torch\n"
        "from dpcourse import runtime\n"
        "from dpcourse.harness import device_audit\n"
        "from dpcourse.one_device import models\n"
        "assert device_audit.enabled() and runtime.device() is device_audit.DEVICE\n"
        "model = models.MLP(5, 8, 2).to(runtime.device())\n"
        "try:\n"
        "    model(torch.randn(4, 5))\n"
        "except device_audit.DeviceAuditError as exc:\n"
        "    print('caught', exc)\n"
    )
    # as `make audit` starts a kernel: the audit's sitecustomize on the path, nothing in the code
    path = os.pathsep.join([device_audit.SITE, *filter(None, [os.environ.get("PYTHONPATH")])])
    env = dict(os.environ, **{device_audit.ENV: "1", "PYTHONPATH": path})
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert "caught Expected all tensors to be on the same device" in out.stdout


# -------------------------------------------------------------- chapter 9's Transformer cell
def _chapter_9_definitions() -> str:
    """The cell of chapter 9 that defines its batches and its model, up to the training runs."""
    nb = json.loads(CHAPTER_9.read_text())
    for cell in nb["cells"]:
        source = "".join(cell["source"])
        if cell["cell_type"] == "code" and "def digits_batch" in source:
            return source.split("\nruns = {}")[0]
    raise AssertionError("chapter 9 no longer defines digits_batch in a cell")


def _define(source: str) -> dict:
    namespace = {"__name__": "chapter_9_cell"}  # not importable: the ranks get it by value
    exec("import torch\nfrom dpcourse import runtime\nfrom dpcourse.one_device import data, "
        "models\n"
         + source, namespace)
    return namespace


def _ddp_step_on_rank(make_transformer, digits_batch):
    from torch.nn.parallel import DistributedDataParallel

    from dpcourse.one_device import models

    model = DistributedDataParallel(make_transformer())
    *inputs, target = digits_batch(0, dist.get_rank())
    loss = models.sequence_cross_entropy(model(*inputs), target)
    loss.backward()
    return loss.item()


def test_chapter_9_batches_are_on_the_models_device(audited):
    source = _chapter_9_definitions()
    fixed = _define(source)
    losses = audited.run(_ddp_step_on_rank, fixed["make_transformer"], fixed["digits_batch"],
                         timeout=120)
    assert all(loss > 0 for loss in losses)

    # The cell as it was before the fix: the batch stays where data.digits_batch made it.
    old = source.replace("return tuple(t.to(runtime.device()) for t in batch)", "return batch")
    assert old != source, "chapter 9's cell changed: update this test's 'before' form"
    before = _define(old)
    with pytest.raises(RankError, match=r"DeviceAuditError: Expected all tensors to be on the "
                                        r"same device, but embedding\(\) got host tensor"):
        audited.run(_ddp_step_on_rank, before["make_transformer"], before["digits_batch"],
                    timeout=120)


# ----------------------------------------- every machine a learner has, and the first GPU run
# Each kind of failure of the first GPU run (one H200, shared/gpu-runs/2026-11-26-h200) fails here,
# under the audit, in the form it had, and passes in the form the course has now.
def _cell(notebook: str, marker: str, end: str) -> str:
    """The source of the first code cell of ``notebook`` holding ``marker``, up to ``end``."""
    nb = json.loads((ROOT / "chapters" / notebook).read_text())
    for cell in nb["cells"]:
        source = "".join(cell["source"])
        if cell["cell_type"] == "code" and marker in source:
            return source.split(end)[0]
    raise AssertionError(f"{notebook} has no cell with {marker!r}")


def test_each_machine_gets_its_backend(monkeypatch):
    from dpcourse import runtime

    want = {"1": ["nccl"] * 4, "gpu-per-rank": ["nccl"] * 4,
            "one-gpu": ["nccl", "gloo", "gloo", "gloo"],  # NCCL refuses two ranks on one GPU
            "two-gpus": ["nccl", "nccl", "gloo", "gloo"]}  # Kaggle's T4 x2
    for machine, backends in want.items():
        monkeypatch.setenv(device_audit.ENV, machine)
        assert [runtime.choose_backend(n) for n in (1, 2, 3, 8)] == backends, machine
    monkeypatch.setenv(device_audit.ENV, "one-gpu")
    with pytest.raises(RuntimeError, match="NCCL needs one GPU per rank"):
        RankPool(2, backend="nccl")  # as NCCL's 'invalid usage' on two ranks of one GPU
    monkeypatch.setenv(device_audit.ENV, "eight-gpus")
    with pytest.raises(ValueError, match="models the machines 1, gpu-per-rank, one-gpu"):
        device_audit.enable()


def _unstaged():
    """torch.distributed's point-to-point functions without the host staging of
    dpcourse.shared_gpu: what a rank had before it (the audit's guards stay)."""
    from dpcourse.harness.patching import replaced

    return replaced(dict.fromkeys(("send", "recv", "isend", "irecv"),
                                  lambda staged: getattr(staged, "__wrapped__", staged)))


def _point_to_point_on_rank(ping_pong):
    from dpcourse import runtime, shared_gpu

    rank, peer = dist.get_rank(), 1 - dist.get_rank()
    dev = runtime.device()
    out = {"staged": shared_gpu.staging_installed(), "backend": device_audit.rank_backend()}
    with _unstaged():  # chapter 5's ping-pong as it ran on the H200: gloo gets a GPU tensor
        out["unstaged"] = _raises(ping_pong)
    out["ping_pong"] = ping_pong()
    x = torch.full((3,), float(rank + 1), device=dev)
    if rank == 0:
        dist.send(x, 1)
    else:
        dist.recv(x, 0)
    out["recv"] = (x.tolist(), device_audit.where(x))
    got = torch.zeros(3, device=dev)
    ops = [dist.P2POp(dist.irecv, got, peer), dist.P2POp(dist.isend, x * 10, peer)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    out["batch"] = (got.tolist(), device_audit.where(got))
    y = torch.ones(2, device=dev)
    version = y._version
    dist.all_reduce(y)  # gloo's collectives take GPU tensors, and write the result back
    out["all_reduce"] = (y.tolist(), y._version - version)
    return out


def test_point_to_point_of_gpu_tensors_over_gloo_fails_unless_staged(monkeypatch):
    """Ranks sharing one GPU (gloo): chapter 5's ping-pong (cell 3 on the H200), ex-5-tree-
    broadcast's and ex-6-ring's solutions called dist.send/isend/batch_isend_irecv with GPU
    tensors: 'writev ... Bad address'. The runtime now stages them through the host."""
    source = _cell("05_collectives.ipynb", "def ping_pong", "\nresults = ")
    namespace = {"__name__": "chapter_5_cell"}
    exec("import torch\nimport torch.distributed as dist\nfrom dpcourse import runtime\n" + source,
         namespace)
    monkeypatch.setenv(device_audit.ENV, "one-gpu")
    with RankPool(2) as pool:
        assert pool.backend == "gloo"
        got = pool.run(_point_to_point_on_rank, namespace["ping_pong"])
    for out in got:
        assert out["staged"] and out["backend"] == "gloo"
        assert "isend" in out["unstaged"] or "irecv" in out["unstaged"], out["unstaged"]
        assert "Bad address" in out["unstaged"]
        assert out["recv"] == ([1.0, 1.0, 1.0], "device")  # received into the GPU tensor
        assert out["batch"] == ([10.0] * 3, "device")  # the peer's x (1 since the recv) x 10
        assert out["all_reduce"] == ([2.0, 2.0], 1)  # gloo's copy back bumps the version
    assert got[1]["ping_pong"].endswith("x = [42.0, 42.0, 42.0, 42.0]")


def _unstaged_group_on_rank() -> dict:
    from dpcourse import runtime
    from dpcourse.collectives import ring_all_reduce
    from dpcourse.sharding.fsdp import FSDP
    from dpcourse.sharding.zero import ShardedOptimizer

    rank, dev = dist.get_rank(), runtime.device()
    torch.manual_seed(0)  # the same model on both ranks; each rank its own batch
    nets = [torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2)).to(dev)
            for _ in range(3)]
    for net in nets[1:]:
        net.load_state_dict(nets[0].state_dict())
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(rank)).to(dev)
    out = {}
    with _unstaged():  # what torch's own init_process_group leaves: no host staging installed
        out["raw isend"] = _raises(lambda: dist.isend(torch.ones(2, device=dev), 1 - rank))
        t = torch.full((5,), float(rank + 1), device=dev)
        ring_all_reduce(t)
        out["ring"] = (t.tolist(), device_audit.where(t))
        zero = ShardedOptimizer(nets[0].parameters(), torch.optim.AdamW, lr=0.1)
        nets[0](x).sum().backward()
        zero.step()
        fsdp = FSDP(nets[1])
        sgd = torch.optim.SGD(fsdp.parameters(), lr=0.1)
        fsdp(x).sum().backward()
        fsdp.finish_gradient_synchronization()
        sgd.step()
        fsdp_weights = fsdp.full_state_dict()
    ref = nets[2]  # one process's training on the averaged gradient (gloo's all-reduce)
    ref(x).sum().backward()
    grads = [p.grad.clone() for p in ref.parameters()]
    for g in grads:
        dist.all_reduce(g)
        g.div_(2)
    for opt_cls, got in ((torch.optim.AdamW, dict(nets[0].named_parameters())),
                         (torch.optim.SGD, fsdp_weights)):
        ref.load_state_dict(nets[2].state_dict())
        start = {n: p.detach().clone() for n, p in ref.named_parameters()}
        for p, g in zip(ref.parameters(), grads, strict=True):
            p.grad = g.clone()
        opt_cls(ref.parameters(), lr=0.1).step()
        out[opt_cls.__name__] = all(torch.allclose(got[n], p, atol=1e-6)
                                    for n, p in ref.named_parameters())
        with torch.no_grad():
            for n, p in ref.named_parameters():
                p.copy_(start[n])
    return out


def test_our_collectives_stage_gpu_tensors_where_torch_started_the_group(monkeypatch):
    """CS336's tests (tools/cs336/adapters.py) start their gloo group with torch's own
    init_process_group and put the model on cuda:<rank>: no dpcourse.runtime, so no host staging,
    and our rings (ShardedOptimizer, FSDP) sent GPU tensors through gloo's send and recv ('writev
    ... Bad address'). dpcourse.collectives.p2p now stages its own messages there."""
    monkeypatch.setenv(device_audit.ENV, "one-gpu")
    with RankPool(2) as pool:
        got = pool.run(_unstaged_group_on_rank)
    for out in got:
        assert "isend" in out["raw isend"] and "Bad address" in out["raw isend"], out
        assert out["ring"] == ([3.0] * 5, "device")
        assert out["AdamW"] and out["SGD"], out  # ZeRO's and FSDP's step, on the mean gradient


def _nccl_versions_on_rank():
    from dpcourse import runtime

    y = torch.ones(2, device=runtime.device())
    version = y._version
    dist.all_reduce(y)
    return y._version - version


def test_nccl_writes_results_in_place_and_keeps_no_staging(audited):
    from dpcourse import shared_gpu

    assert audited.run(_nccl_versions_on_rank) == [0, 0]
    assert not audited.run(shared_gpu.staging_installed)[0]


def _host_all_reduce():
    t = torch.ones(3)  # a test's rank code made it on the host
    dist.all_reduce(t)
    return t


def test_one_rank_on_one_gpu_is_nccl_and_takes_no_host_tensor(monkeypatch):
    """test_results_come_back_in_rank_order[1] and test_collectives_equal_torch_distributed[1]
    on the H200: one rank, one GPU, so NCCL, and the test's host tensor failed."""
    monkeypatch.setenv(device_audit.ENV, "one-gpu")
    with RankPool(1) as pool:
        assert pool.backend == "nccl"
        with pytest.raises(RankError, match="No backend type associated with device type cpu"):
            pool.run(_host_all_reduce)


def _checkpoint_on_rank(directory):
    from dpcourse import runtime
    from dpcourse.practice import checkpoint

    model = torch.nn.Linear(3, 2).to(runtime.device())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    checkpoint.save_checkpoint(directory, 1, model, opt)
    dist.barrier()
    # what chapter 8's resume did on the H200: the RNG state loaded onto the GPU, then .numpy()
    where = Path(directory) / checkpoint.latest_checkpoint(directory)["path"]
    state = torch.load(where / checkpoint.CHECKPOINT_FILE, map_location=model.weight.device,
                       weights_only=True)
    keys = state["rng"][dist.get_rank()]["numpy"][1]
    return {"loaded": device_audit.where(keys), "numpy": _raises(keys.numpy),
            "resumed": checkpoint.load_checkpoint(directory, model, opt)["step"],
            "weight": device_audit.where(model.weight.data)}


def test_a_checkpoint_loaded_onto_the_gpu_resumes(audited, tmp_path):
    """Chapter 8 cells 16 and 19 and test_main_under_run_ranks_resumes_exactly on the H200:
    torch.load(map_location=cuda:0) put the saved RNG state on the GPU, and .numpy() failed."""
    for got in audited.run(_checkpoint_on_rank, str(tmp_path)):
        assert got["loaded"] == "device" and "numpy" in got["numpy"]
        assert got["resumed"] == 1 and got["weight"] == "device"


def _fully_shard_on_rank():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from dpcourse import runtime

    out = {"on the GPU": _raises(lambda: fully_shard(torch.nn.Linear(4, 4).to(runtime.device())))}
    model = torch.nn.Linear(4, 4)
    fully_shard(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    model(torch.ones(2, 4)).sum().backward()
    out["on the host"] = "no error"
    return out


def test_fully_shard_where_ranks_share_a_gpu_runs_on_the_host(monkeypatch):
    """Chapter 9 cell 20 and test_fsdp_benchmark on the H200: fully_shard on the GPU over gloo
    killed both ranks (SIGSEGV). On a CPU mesh with the model on the host it runs."""
    monkeypatch.setenv(device_audit.ENV, "one-gpu")
    with RankPool(2) as pool:
        for got in pool.run(_fully_shard_on_rank):
            assert "SIGSEGV" in got["on the GPU"] and got["on the host"] == "no error"


def _tags_on_rank():
    from dpcourse import runtime

    w = torch.nn.Linear(3, 3).to(runtime.device()).weight
    host = torch.ones(2, 3)
    return {
        ".data of a device parameter": _raises(lambda: w.data @ host.T),
        ".T of a device tensor": _raises(lambda: host @ w.T),
        "device=w.device": device_audit.where(torch.zeros(3, device=w.device)),
        "device=host.device": device_audit.where(torch.zeros(3, device=host.device)),
        ".to(w.device)": device_audit.where(host.to(w.device)),
        ".to(host.device)": device_audit.where(w.detach().to(host.device)),
    }


def test_data_and_other_tensors_devices_are_followed(audited):
    got = audited.run(_tags_on_rank)[0]
    assert "matmul() got host tensor" in got.pop(".data of a device parameter")
    assert "matmul() got host tensor" in got.pop(".T of a device tensor")
    assert got == {"device=w.device": "device", "device=host.device": "host",
                   ".to(w.device)": "device", ".to(host.device)": "host"}


def test_ex_7_hook_judges_by_what_the_backend_writes(monkeypatch):
    """Chapter 7 cell 35 on the H200: ex-7-hook's check said the reference solution changed its
    gradients after launching their all-reduce, because gloo's CUDA all-reduce copies the sum
    back, which bumps the version counter the check read. Where ranks share a GPU the audit
    bumps it too (test above); the check now allows the backend's own bump, measured first."""
    from test_exercises_ch07 import divide_after_launching, launch_reference

    from dpcourse.harness.exercises import run_check

    monkeypatch.setenv(device_audit.ENV, "one-gpu")
    assert run_check("ex-7-hook", launch_reference).passed
    result = run_check("ex-7-hook", divide_after_launching)
    assert not result.passed and "changed in place after their all-reduce" in result.message
