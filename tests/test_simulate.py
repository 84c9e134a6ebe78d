"""The simulated network runs the real collectives and agrees with the alpha-beta formulas."""

from __future__ import annotations

import pytest
import torch

from dpcourse import collectives as C
from dpcourse.collectives import p2p
from dpcourse.cost import costmodel, simulate


@pytest.mark.parametrize("algorithm", costmodel.ALGORITHMS)
@pytest.mark.parametrize("world", [1, 2, 3, 4, 5, 8, 16, 33])
def test_simulated_time_equals_the_formula(algorithm, world):
    t = simulate.all_reduce_time(algorithm, world, 1e8, alpha=5e-6, beta=12.5e9)
    modelled = costmodel.all_reduce_time(algorithm, world, 1e8, 5e-6, 12.5e9)
    assert t == pytest.approx(modelled, rel=1e-9)


def test_the_real_code_runs_and_computes_the_right_values():
    def body():
        rank, world = p2p.rank_and_size()
        x = torch.arange(10, dtype=torch.float64) * (rank + 1)
        C.ring_all_reduce(x, check_shapes=False)
        y = torch.tensor([float(rank)])
        C.tree_broadcast(y, src=2, check_shapes=False)
        return x.tolist(), y.item()

    result = simulate.run(body, 5, alpha=1e-6, beta=1e9)
    for x, y in result.results:
        assert x == [i * 15.0 for i in range(10)] and y == 2.0
    assert result.network.messages == 2 * 4 * 5 + 4  # ring: 2(N-1) per rank; tree: N-1


def test_the_shape_check_is_one_message_per_rank_and_none_without_it():
    def body(check):
        C.ring_all_reduce(torch.ones(12), check_shapes=check)

    without = simulate.run(body, 4, False, alpha=1e-6, beta=1e9).network
    checked = simulate.run(body, 4, True, alpha=1e-6, beta=1e9).network
    assert without.messages == 2 * 3 * 4  # the ring's own messages, nothing else
    assert checked.messages == without.messages + 4  # one to the right neighbour per rank

    def mismatched():  # on 2 ranks each is the other's left neighbour: both raise
        rank, _ = p2p.rank_and_size()
        C.ring_all_reduce(torch.ones(3 + rank))

    with pytest.raises(RuntimeError, match=r"rank 0 has a torch.float32 tensor of shape \(3,\)"):
        simulate.run(mismatched, 2)


def test_traffic_is_counted_in_the_simulation_too():
    def body():
        x = torch.ones(12)
        with C.count_traffic() as t:
            C.ring_all_reduce(x, check_shapes=False)
        return t.bytes_sent

    assert simulate.run(body, 4).results == [2 * 3 * 48 // 4] * 4


def test_a_link_is_shared_so_the_naive_root_is_the_bottleneck():
    one = simulate.all_reduce_time("naive", 8, 1e6, alpha=0.0, beta=1e9)
    assert one == pytest.approx(2 * 7 * 1e-3)  # 14 transfers through rank 0's links, in a row


def test_a_deadlock_is_reported_not_hung():
    def body():
        rank, world = p2p.rank_and_size()
        net = p2p._simulated.network
        net.wait(rank, net.post_recv(rank, (rank + 1) % world, torch.ones(1)), timeout=1)

    with pytest.raises(RuntimeError, match=r"(?s)virtual rank 0 of 3 failed.*a deadlock"):
        simulate.run(body, 3)


def test_mismatched_messages_and_bad_peers_are_errors():
    def mismatched():
        rank, _ = p2p.rank_and_size()
        if rank == 0:
            p2p.send(torch.ones(3), 1)
        else:
            p2p.recv(torch.ones(2), 0)

    with pytest.raises(RuntimeError, match="sends 3 elements but rank 1 expects 2"):
        simulate.run(mismatched, 2, timeout=10)
    with pytest.raises(ValueError, match="world_size"):
        simulate.SimulatedNetwork(0, 1e-6, 1e9)


def test_outside_a_simulation_the_real_process_group_is_needed():
    with pytest.raises(RuntimeError, match="no process group"):
        p2p.rank_and_size()


def test_a_ring_is_as_slow_as_its_slowest_link():
    """Every chunk crosses every link of the ring, so one link at a quarter of the bandwidth
    makes the bandwidth term of the whole all-reduce four times as long (not 1/N of that)."""
    n, nbytes, beta = 8, 1e9, 12.5e9
    fast = simulate.all_reduce_time("ring", n, nbytes, alpha=0.0, beta=beta)
    slow = simulate.all_reduce_time("ring", n, nbytes, alpha=0.0, beta=beta,
                                    link_beta={(3, 4): beta / 4})
    assert fast == pytest.approx(costmodel.all_reduce_time("ring", n, nbytes, 0.0, beta), rel=1e-9)
    assert slow == pytest.approx(4 * fast, rel=1e-9)
    # a slow link the ring does not use changes nothing
    unused = simulate.all_reduce_time("ring", n, nbytes, alpha=0.0, beta=beta,
                                      link_beta={(4, 3): beta / 4})
    assert unused == pytest.approx(fast, rel=1e-9)


def test_link_beta_is_checked():
    with pytest.raises(ValueError, match="cannot message"):
        simulate.SimulatedNetwork(4, 1e-6, 1e9, link_beta={(0, 4): 1e9})
    with pytest.raises(ValueError, match="bandwidth > 0"):
        simulate.SimulatedNetwork(4, 1e-6, 1e9, link_beta={(0, 1): 0.0})
