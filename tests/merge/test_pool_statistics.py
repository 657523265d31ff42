"""Pooling calibration statistics over batches (:func:`mergeqp.merge.calibrated.pool_statistics`).

RegMean's Gram matrices and Fisher's diagonal are means over units (real tokens, examples) that
carry their counts, so statistics collected per batch pool into those of any set of batches:
checked against a closed form (weighted means, hypothesis) and against collecting the union at
once on a small model with padded text batches.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from mergeqp.errors import ValidationError
from mergeqp.io.calibration import Batch
from mergeqp.merge.calibrated import StatisticsCollector, pool_statistics
from mergeqp.merge.calibration_statistics import FISHER_COUNT, GRAM_ROWS


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 50), st.integers(0, 2**31 - 1)), min_size=1, max_size=5))
def test_pooled_statistics_are_the_count_weighted_means(parts_spec):
    parts = []
    for count, seed in parts_spec:
        g = torch.Generator().manual_seed(seed)
        parts.append({"w": torch.randn(3, 2, generator=g, dtype=torch.float64),
                      "b": torch.randn(2, generator=g, dtype=torch.float64),
                      FISHER_COUNT: torch.tensor(float(count), dtype=torch.float64)})
    pooled = pool_statistics(parts, lambda k: FISHER_COUNT)
    counts = torch.tensor([float(c) for c, _ in parts_spec], dtype=torch.float64)
    for k in ("w", "b"):
        expected = sum(c * p[k] for c, p in zip(counts, parts)) / counts.sum()
        torch.testing.assert_close(pooled[k], expected, rtol=1e-12, atol=1e-14)
    assert float(pooled[FISHER_COUNT]) == float(counts.sum())
    torch.testing.assert_close(pool_statistics(parts[:1], lambda k: FISHER_COUNT)["w"], parts[0]["w"],
                               rtol=1e-15, atol=0)


def test_a_statistic_without_its_count_is_an_error():
    with pytest.raises(ValidationError, match="no count entry"):
        pool_statistics([{"w": torch.ones(2)}], lambda k: FISHER_COUNT)
    with pytest.raises(ValidationError, match="no statistics"):
        pool_statistics([], lambda k: FISHER_COUNT)


class _TinyLM(torch.nn.Module):
    """Embedding -> Linear -> tanh -> Linear (logits): two linear layers for RegMean, a classifier
    output for Fisher's argmax labels; positions are independent, so padding changes nothing."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.embed = torch.nn.Embedding(11, 6)
        self.up = torch.nn.Linear(6, 5)
        self.out = torch.nn.Linear(5, 11, bias=False)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype))

    def forward(self, input_ids, attention_mask=None):  # noqa: ARG002 - the mask is part of the inputs
        return self.out(torch.tanh(self.up(self.embed(input_ids))))


def _batches() -> list[Batch]:
    g = torch.Generator().manual_seed(1)
    out = []
    for lengths in ((4, 2, 3), (5, 5), (1, 3, 2, 4)):
        T = max(lengths)
        ids = torch.randint(1, 11, (len(lengths), T), generator=g)
        mask = torch.zeros(len(lengths), T, dtype=torch.long)
        for i, n in enumerate(lengths):
            mask[i, :n] = 1
        ids = ids * mask  # right padding with id 0
        out.append(Batch({"input_ids": ids, "attention_mask": mask}, mask))
    return out


@pytest.mark.parametrize("method", ["regmean", "fisher"])
def test_pooled_batches_equal_collecting_them_at_once(method):
    model = _TinyLM().double()
    keys = ["up.weight", "up.bias", "out.weight"]
    batches = _batches()
    whole = StatisticsCollector(method, {}, model, keys, 1, 2)
    whole(0, "m", model, batches)
    per = StatisticsCollector(method, {}, model, keys, 1, 2)
    assert per.poolable
    parts = per.batch_parts("m", model, batches)
    assert len(parts) == len(batches) and sum(p.examples for p in parts) == 9
    per.pool(0, "m", parts)
    a, b = whole.statistics[0], per.statistics[0]
    assert set(a) == set(b)
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-12, atol=1e-14)
    count = FISHER_COUNT if method == "fisher" else "up" + GRAM_ROWS
    # real tokens (RegMean rows) or prompts (Fisher examples) of the three batches
    assert float(a[count]) == (9.0 if method == "fisher" else 29.0)
    # a subset pools to what collecting that subset gives
    sub = StatisticsCollector(method, {}, model, keys, 1, 2)
    sub(0, "m", model, [batches[0], batches[2]])
    per.pool(0, "m", [parts[0], parts[2]])
    for k in sub.statistics[0]:
        torch.testing.assert_close(per.statistics[0][k], sub.statistics[0][k], rtol=1e-12, atol=1e-14)


def test_the_batch_estimator_does_not_pool():
    """Fisher's ``estimator: batch`` squares each batch's summed gradient, so its value depends on
    how prompts are grouped: such a collector is not poolable and refuses to make parts."""
    model = _TinyLM().double()
    col = StatisticsCollector("fisher", {"estimator": "batch"}, model, ["up.weight"], 1, 2)
    assert not col.poolable
    with pytest.raises(ValidationError, match="do not pool"):
        col.batch_parts("m", model, _batches())
