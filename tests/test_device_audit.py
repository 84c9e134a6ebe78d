"""The device audit (dpcourse.device_audit): on this CPU, ranks behave as on a machine with a GPU
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

from dpcourse import device_audit
from dpcourse._launch.job import host_dumps
from dpcourse.launch import RankError, RankPool

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
    assert device_audit.where(back) == "host" and torch.equal(back, t)


def _cluster_rank():
    from dpcourse import runtime

    x = torch.ones(3)  # gloo on a cluster takes the host tensor
    dist.all_reduce(x)
    model = torch.nn.Linear(3, 1).to(runtime.device())
    return x.tolist(), _raises(lambda: model(torch.ones(2, 3)))


def test_cluster_ranks_run_gloo_and_still_check_devices(monkeypatch):
    monkeypatch.setenv(device_audit.ENV, "gloo")  # what ranks on an emulated cluster get
    with RankPool(2) as pool:
        for summed, mixing in pool.run(_cluster_rank):
            assert summed == [2.0, 2.0, 2.0]
            assert "linear() got host tensor(s)" in mixing


def test_the_notebook_kernel_is_audited_outside_a_process_group():
    code = (
        "import torch\n"
        "from dpcourse import device_audit, models, runtime\n"
        "assert device_audit.enabled() and runtime.device() is device_audit.DEVICE\n"
        "model = models.MLP(5, 8, 2).to(runtime.device())\n"
        "try:\n"
        "    model(torch.randn(4, 5))\n"
        "except device_audit.DeviceAuditError as exc:\n"
        "    print('caught', exc)\n"
    )
    env = dict(os.environ, **{device_audit.ENV: "1"})
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
    exec("import torch\nfrom dpcourse import data, models, runtime\n" + source, namespace)
    return namespace


def _ddp_step_on_rank(make_transformer, digits_batch):
    from torch.nn.parallel import DistributedDataParallel

    from dpcourse import models

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
