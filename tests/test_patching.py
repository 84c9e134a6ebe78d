"""dpcourse.harness.patching: a replacement is gone after its block, also from a module first
imported inside the block that took it by name (issue 31: DTensor's collective helpers, imported
by the first optimizer a rank makes, kept "a library collective was called" for the next test
that ran on the same pool's ranks)."""

from __future__ import annotations

import importlib
import sys

import pytest
import torch.distributed as dist

from dpcourse.harness.patching import library_collectives_forbidden


def test_a_module_imported_inside_the_block_gets_the_real_functions_back(tmp_path, monkeypatch):
    real = dist.distributed_c10d.broadcast
    (tmp_path / "takes_broadcast_by_name.py").write_text(
        "from torch.distributed.distributed_c10d import all_reduce, broadcast\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with library_collectives_forbidden():
        module = importlib.import_module("takes_broadcast_by_name")
        assert module.broadcast is not real  # inside the block it has the forbidding one
        with pytest.raises(AssertionError, match="a library collective was called"):
            module.broadcast(None)
    try:
        assert module.broadcast is real and dist.broadcast is real
        assert module.all_reduce is dist.distributed_c10d.all_reduce
    finally:
        sys.modules.pop("takes_broadcast_by_name", None)
