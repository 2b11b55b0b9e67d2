import torch
from harness import run_ranks

from fivefold.config import ParallelSection
from fivefold.parallel import comm
from fivefold.parallel.mesh import ParallelDims


def test_group_slices_cover_the_grid():
    dims = ParallelDims(dp=2, tp=2, pp=2, cp=1)
    s = dims._slices()
    assert s["tp"][:2] == [[0, 1], [2, 3]]
    assert s["dp"][:2] == [[0, 2], [1, 3]]
    assert s["pp"][0] == [0, 4]
    # Every kind partitions the world: each rank in exactly one group of each kind.
    for name, rows in s.items():
        flat = sorted(r for row in rows for r in row)
        assert flat == list(range(8)), name


def test_expert_groups_split_dp_cp():
    dims = ParallelDims(dp=4, tp=1, pp=1, cp=1, ep=2)
    s = dims._slices()
    assert s["ep"] == [[0, 1], [2, 3]]
    assert s["edp"] == [[0, 2], [1, 3]]


def _collectives(rank, world):
    par = ParallelSection(dp=2, tp=2)
    dims = ParallelDims.from_config(par)
    dims.ledger.enabled = True
    tp, dp = dims["tp"], dims["dp"]
    x = torch.full((4,), float(rank))
    comm.all_reduce(x, tp)
    out = torch.empty(2)
    comm.reduce_scatter(out, torch.arange(4.0) * (rank + 1), dp)
    gathered = torch.empty(4)
    comm.all_gather(gathered, torch.tensor([rank, rank], dtype=torch.float32), dp)
    recv = torch.empty(3)
    peer = 1 - tp.rank
    ops = [comm.P2P("send", torch.full((3,), float(rank)), peer), comm.P2P("recv", recv, peer)]
    for w in comm.batch_p2p(ops, tp):
        w.wait()
    return dims.coords(), x, out, gathered, recv, dims.ledger.totals()


def test_collectives_and_ledger_on_four_ranks():
    results = run_ranks(_collectives, 4)
    for rank, (coords, x, out, gathered, recv, totals) in enumerate(results):
        assert coords == {"pp": 0, "dp": rank // 2, "cp": 0, "tp": rank % 2}
        tp_peers = [rank - rank % 2, rank - rank % 2 + 1]
        assert torch.equal(x, torch.full((4,), float(sum(tp_peers))))
        dp_peers = [rank % 2, rank % 2 + 2]
        full = sum(torch.arange(4.0) * (r + 1) for r in dp_peers)
        assert torch.equal(out, full[2 * (rank // 2): 2 * (rank // 2) + 2])
        assert torch.equal(gathered, torch.tensor([dp_peers[0]] * 2 + [dp_peers[1]] * 2,
                                                  dtype=torch.float32))
        assert torch.equal(recv, torch.full((3,), float(rank ^ 1)))
        assert totals[("tp", "all_reduce")] == {"calls": 1, "elements": 4, "bytes": 16}
        assert totals[("dp", "reduce_scatter")]["bytes"] == 16
        assert totals[("dp", "all_gather")]["bytes"] == 16
        assert totals[("tp", "send")]["bytes"] == 12 and totals[("tp", "recv")]["bytes"] == 12
