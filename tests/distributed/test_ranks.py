"""The rank bookkeeping of :mod:`mergeqp.io.distributed` without a launch: shards cover every
item exactly once, a single process is rank 0 of 1 and writes, the launch environment is read
and checked, and :func:`alone` hides a group."""

from __future__ import annotations

import pytest

from mergeqp.errors import ConfigError
from mergeqp.io.distributed import Ranks, agree_exit_code, alone, backend_for, current_group, launch_requested


@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_shards_cover_every_item_once(world):
    items = list(range(17))
    shards = [Ranks(rank, world).shard(items) for rank in range(world)]
    assert sorted(x for s in shards for x in s) == items
    for rank, shard in enumerate(shards):
        assert all(Ranks(rank, world).owns(i) for i in shard)
        assert len(shard) in (len(items) // world, len(items) // world + 1)
    assert [r for r in range(world) if Ranks(r, world).is_writer()] == [0]


def test_a_single_process_reduces_nothing_and_spreads_in_order():
    group = current_group()
    assert group == Ranks(0, 1, None) and not group.distributed and group.is_writer()
    assert group.reduce_floats([1.5, 2.0]) == [1.5, 2.0]
    assert group.gather("x") == ["x"]
    assert group.spread(["a", "b", "c"], lambda i, s: f"{i}{s}") == ["0a", "1b", "2c"]
    assert agree_exit_code(group, 3) == 3
    with alone():
        assert current_group() == Ranks()


def test_the_launch_environment_is_read_and_checked():
    assert launch_requested({}) == 1
    assert launch_requested({"RANK": "1", "WORLD_SIZE": "4"}) == 4
    with pytest.raises(ConfigError, match="not integers"):
        launch_requested({"RANK": "one", "WORLD_SIZE": "2"})
    with pytest.raises(ConfigError, match="RANK=2 is not in 0 .. WORLD_SIZE-1 = 1"):
        launch_requested({"RANK": "2", "WORLD_SIZE": "2"})
    assert backend_for("cpu") == "gloo" and backend_for("cuda:1") == "nccl"


class _FakeRanks:
    """Two ranks seen from one of them: ``reduce_floats`` returns the maximum of this rank's value
    and the value the other rank contributes."""

    distributed = True

    def __init__(self, rank: int, other: float):
        self.rank, self.other = rank, other

    def is_writer(self) -> bool:
        return self.rank == 0

    def reduce_floats(self, values, op="sum"):
        assert op == "max"
        return [max(float(values[0]), self.other)]


def test_agree_on_shares_the_writer_check_with_its_exit_code():
    from mergeqp.errors import ConfigError, OtherRankFailed, exit_code
    from mergeqp.io.distributed import Ranks, agree_on, other_rank

    def refuse():
        raise ConfigError("output folder x is not empty")

    with pytest.raises(ConfigError, match="not empty"):  # the writer raises its own error
        agree_on(_FakeRanks(0, 0.0), refuse)
    calls = []
    with pytest.raises(OtherRankFailed) as info:  # the other rank: the writer's code, no check of its own
        agree_on(_FakeRanks(1, 2.0), lambda: calls.append(1))
    assert calls == [] and exit_code(info.value) == 2
    agree_on(_FakeRanks(1, 0.0), refuse)  # a check the writer passed: nothing on the others
    with pytest.raises(ConfigError):  # one process: the check itself
        agree_on(Ranks(), refuse)
    assert other_rank({"WORLD_SIZE": "2", "RANK": "1"}) and not other_rank({"WORLD_SIZE": "2", "RANK": "0"})
    assert not other_rank({}) and not other_rank({"WORLD_SIZE": "x", "RANK": "1"})


def test_mergeqps_own_group_is_used_only_beside_the_default_group_it_was_made_with(monkeypatch):
    """A caller that destroys the default group and initialises another one after a launch (in the
    same process) gets the new default group for mergeqp's collectives, not the destroyed own group."""
    torch = pytest.importorskip("torch")
    dist = torch.distributed
    if not dist.is_available() or dist.is_initialized():
        pytest.skip("needs torch.distributed and no group initialised by the caller")
    from mergeqp.io import distributed as D

    try:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        monkeypatch.setattr(D, "_OWN_GROUP", dist.new_group(backend="gloo"))
        monkeypatch.setattr(D, "_OWN_WORLD", dist.group.WORLD)
        assert D._own_group() is D._OWN_GROUP
        dist.destroy_process_group()
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        assert D._own_group() is None  # stale: the new default group instead
        t = torch.ones(2, dtype=torch.float64)
        dist.all_reduce(t, group=D._own_group())  # the new default group works
        assert t.tolist() == [1.0, 1.0]
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
