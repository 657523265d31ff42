"""The rank bookkeeping of :mod:`mergeqp.io.distributed` without a launch: shards cover every
item exactly once, a single process is rank 0 of 1 and writes, the launch environment is read
and checked, and :func:`alone` hides a group."""

from __future__ import annotations

import pytest

from mergeqp.errors import BadDataError, ConfigError, MergeQPError, ValidationError
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
    assert group.held(lambda: 3) == (3, None)
    with pytest.raises(ZeroDivisionError):  # a single process holds nothing back
        group.held(lambda: 1 / 0)
    error = ValueError("x")
    assert Ranks(1, 2, "gloo").held(lambda: (_ for _ in ()).throw(error)) == (None, error)
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


class _Unpicklable(MergeQPError):
    def __init__(self, where, why):  # two arguments: pickling keeps one (the message)
        super().__init__(f"{where}: {why}")


def test_raise_first_raises_the_first_ranks_error_on_every_rank(monkeypatch):
    """Each rank sends its error (or None); every rank raises the first one in rank order: its own
    rank the original, the others the copy it sent. An error that does not survive pickling is sent
    as a mergeqp error with its type and message (RuntimeError for one that is not mergeqp's)."""
    import pickle

    from mergeqp.io.distributed import _Failed, _portable

    def gathering(others):
        def gather(self, obj):
            both = list(others)
            both.insert(self.rank, obj)
            # what travels is pickled
            return [pickle.loads(pickle.dumps(x)) for x in both]
        return gather

    own = BadDataError("task 'a' batch 1: NaN")
    monkeypatch.setattr(Ranks, "gather", gathering([None]))
    Ranks(0, 2, "gloo").raise_first(None)  # nobody failed: nothing raised
    with pytest.raises(BadDataError) as e:
        Ranks(1, 2, "gloo").raise_first(own)
    assert e.value is own  # the failing rank raises its own error, traceback and all
    monkeypatch.setattr(Ranks, "gather", gathering([_Failed(own)]))
    with pytest.raises(BadDataError, match="batch 1: NaN") as e:
        Ranks(0, 2, "gloo").raise_first(None)
    assert e.value is not own
    # both failed: the first rank's error on both
    first = ValidationError("rank 0's")
    monkeypatch.setattr(Ranks, "gather", gathering([_Failed(own)]))
    with pytest.raises(ValidationError, match="rank 0's") as e:
        Ranks(0, 2, "gloo").raise_first(first)
    assert e.value is first
    monkeypatch.setattr(Ranks, "gather", gathering([_Failed(first)]))
    with pytest.raises(ValidationError, match="rank 0's"):
        Ranks(1, 2, "gloo").raise_first(own)
    # what cannot travel as itself
    odd = _portable(_Unpicklable("task 'a' batch 1", "the model raised"))
    assert type(odd) is MergeQPError and str(odd) == "_Unpicklable: task 'a' batch 1: the model raised"

    class Local(RuntimeError):  # a local class cannot be pickled at all
        pass

    foreign = _portable(Local("deep inside a library"))
    assert type(foreign) is RuntimeError and str(foreign) == "Local: deep inside a library"
    assert _portable(own) is own
    # a single process raises its own error at once
    with pytest.raises(BadDataError):
        Ranks().raise_first(own)


def test_spread_raises_the_first_items_error_as_sent(monkeypatch):
    """An item whose work raises an error that cannot be pickled still reaches the other ranks."""
    import pickle

    def gather(self, obj):  # rank 0 of two; the other rank's items all succeeded
        return [pickle.loads(pickle.dumps(obj)), {1: "b"}]

    monkeypatch.setattr(Ranks, "gather", gather)

    def work(i, item):
        raise _Unpicklable(f"item {i}", "failed")

    with pytest.raises(_Unpicklable) as e:  # this rank's own item: the original
        Ranks(0, 2, "gloo").spread(["a", "b"], work)
    assert str(e.value) == "item 0: failed"

    def gather1(self, obj):  # rank 1 of two; rank 0's item 0 failed with an unpicklable error
        from mergeqp.io.distributed import _Failed, _portable
        return [{0: _Failed(_portable(_Unpicklable("item 0", "failed")))}, pickle.loads(pickle.dumps(obj))]

    monkeypatch.setattr(Ranks, "gather", gather1)
    with pytest.raises(MergeQPError, match="_Unpicklable: item 0: failed"):
        Ranks(1, 2, "gloo").spread(["a", "b"], lambda i, item: item.upper())


def test_a_lost_peer_is_one_line_with_its_own_exit_code_and_other_errors_pass():
    """(stop 48) gloo's error when a collective loses its peer became a 30-line traceback (collect:
    exit 1) or a config error (merge: exit 2); it is now OtherProcessLost, exit 5, without gloo's
    source location. Any other RuntimeError of a collective passes unchanged."""
    from mergeqp.errors import EXIT_OTHER_PROCESS, OtherProcessLost, exit_code
    from mergeqp.io.distributed import _collective

    def lost():
        raise RuntimeError("[/__w/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by "
                           "peer [127.0.0.1]:9089\nmore lines")

    with pytest.raises(OtherProcessLost) as info:
        _collective(lost)
    assert exit_code(info.value) == EXIT_OTHER_PROCESS == 5
    assert str(info.value).endswith("(Connection closed by peer [127.0.0.1]:9089)") and "pair.cc" not in str(info.value)

    def mismatch():
        raise RuntimeError("Tensors must be of the same shape")

    with pytest.raises(RuntimeError, match="same shape"):
        _collective(mismatch)


def test_a_processs_own_error_goes_to_torchruns_error_file(tmp_path):
    """torchrun shows each process's error file in its report (the first one as the root cause):
    a rank's own error is written there; without the variable nothing is written."""
    import json

    from mergeqp.io.distributed import record_for_launcher

    path = tmp_path / "error.json"
    record_for_launcher("mergeqp collect: error: x", {})
    assert not path.exists()
    record_for_launcher("mergeqp collect: error: x", {"TORCHELASTIC_ERROR_FILE": str(path)})
    data = json.loads(path.read_text())["message"]
    assert data["message"] == data["extraInfo"]["py_callstack"] == "mergeqp collect: error: x"
    assert int(data["extraInfo"]["timestamp"]) > 0
