"""Bad input fails early with a message naming the layer, tensor, task or setting."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from mergeqp.errors import UnknownNameError, ValidationError
from mergeqp.stats import collect_statistics
from tests.stats.tiny_models import TinyTransformer


@pytest.fixture()
def models(finetuned_copies, linear_net):
    base = linear_net((5, 4, 3, 2), seed=0)
    return base, finetuned_copies(base, 2, scale=0.2, seed=1)


def _cal(n=(4, 4)):
    return [torch.randn(k, 5, dtype=torch.float64) for k in n]


def test_unknown_layer_lists_linear_layers(finetuned_copies, mnist_mlp):
    base = mnist_mlp(dtype=torch.float32)
    fts = finetuned_copies(base, 2, scale=0.01)
    with pytest.raises(ValidationError, match=r"no module named 'layer2'; its nn.Linear layers are: 0, 2, 4"):
        collect_statistics(base, fts, "layer2", [torch.rand(2, 784)] * 2, progress=False)
    with pytest.raises(ValidationError, match=r"'1' .* is a ReLU, not an nn.Linear"):
        collect_statistics(base, fts, "1", [torch.rand(2, 784)] * 2, progress=False)


def test_shape_mismatch_names_the_tensor(linear_net, models):
    base, fts = models
    other = linear_net((5, 4, 6, 2), seed=0)
    with pytest.raises(ValidationError, match=r"tensor '1.weight' has shape \(6, 4\) in model 'model1'"):
        collect_statistics(base, [fts[0], other], "1", _cal(), progress=False)
    with pytest.raises(ValidationError, match=r"model 'model1' lacks tensor '0.bias' of the base model \(3 missing"):
        collect_statistics(base, [fts[0], linear_net((5, 4, 3, 2), bias=False)], "1", _cal(),
                           progress=False)


def test_empty_calibration(models):
    base, fts = models
    with pytest.raises(ValidationError, match=r"calibration set of task 'model1' \(model 'model1'\) is empty"):
        collect_statistics(base, fts, "1", [torch.randn(3, 5, dtype=torch.float64), []], progress=False)
    with pytest.raises(ValidationError, match="is empty"):
        collect_statistics(base, fts, "1", [torch.zeros(0, 5, dtype=torch.float64)] * 2, progress=False)


def test_wrong_number_of_calibration_sets(models):
    base, fts = models
    with pytest.raises(ValidationError, match=r"calibration has 3 set\(s\) but there are 2 fine-tuned models"):
        collect_statistics(base, fts, "1", _cal((2, 2, 2)), progress=False)
    with pytest.raises(ValidationError, match="finetuned_models is empty"):
        collect_statistics(base, [], "1", [], progress=False)


def test_nan_outputs(models):
    base, fts = models
    bad_input = _cal()
    bad_input[1][2, 0] = float("nan")
    with pytest.raises(ValidationError, match=r"task 'model1' batch 0: the base model's compared output contains"):
        collect_statistics(base, fts, "1", bad_input, progress=False)
    broken = copy.deepcopy(fts[0])
    with torch.no_grad():
        broken[2].weight[0, 0] = float("nan")
    with pytest.raises(ValidationError, match=r"the output of fine-tuned model 'model0' contains"):
        collect_statistics(base, [broken, fts[1]], "1", _cal(), progress=False)


def test_label_and_target_errors(models):
    base, fts = models
    with pytest.raises(ValidationError, match="targets='labels' but the batch has no labels"):
        collect_statistics(base, fts, "1", _cal(), targets="labels", progress=False)
    with pytest.raises(ValidationError, match="targets must be one of"):
        collect_statistics(base, fts, "1", _cal(), targets="logits", progress=False)
    cal = [[(torch.randn(3, 5, dtype=torch.float64), torch.tensor([0, 1, 5]))]] * 2
    with pytest.raises(ValidationError, match=r"class labels range over \[0, 5\] but there are 2 outputs"):
        collect_statistics(base, fts, "1", cal, targets="labels", progress=False)


def test_output_length_must_agree_between_tasks(models):
    base, fts = models

    def output_fn(out, task):
        return out if task == 0 else out[:, :1]

    with pytest.raises(ValidationError, match="the compared output has 1 values per sample, but earlier"):
        collect_statistics(base, fts, "1", _cal(), output_fn=output_fn, progress=False)


def test_missing_statistics_and_settings(finetuned_copies, mnist_mlp):
    base = mnist_mlp(dtype=torch.float64)
    fts = finetuned_copies(base, 2, scale=0.01, layer="2")
    stats = collect_statistics(base, fts, "2", [torch.rand(3, 784, dtype=torch.float64)] * 2,
                               parametrisations=["rows"], progress=False)
    with pytest.raises(ValidationError, match=r"no statistics for the columns parametrisation.*keep_samples=True"):
        stats.problem("columns")
    with pytest.raises(ValidationError, match="source 'samples' cannot build"):
        stats.problem("rows", source="samples")
    with pytest.raises(UnknownNameError, match="unknown parametrisation 'diagonal'"):
        stats.problem("diagonal")
    with pytest.raises(ValidationError, match=r"task_weights must have one entry per task \(2\)"):
        stats.problem("rows", task_weights=[1.0])
    with pytest.raises(ValidationError, match="must be finite and >= 0"):
        stats.problem("rows", task_weights=[1.0, -1.0])
    with pytest.raises(ValidationError, match="needs per-sample data"):
        stats.linearised_change(np.zeros((2, 128)))
    with pytest.raises(ValidationError, match="method='shared' needs one Jacobian"):
        stats.energy_report(np.eye(128)[:, :2], method="shared")


def test_sample_memory_cap(finetuned_copies, mnist_mlp):
    base = mnist_mlp(dtype=torch.float64)
    fts = finetuned_copies(base, 2, scale=0.01, layer="2")
    with pytest.raises(ValidationError, match=r"keeping per-sample data needs about .* above max_sample_bytes"):
        collect_statistics(base, fts, "2", [torch.rand(40, 784, dtype=torch.float64)] * 2,
                           keep_samples=True, batch_size=10, max_sample_bytes=100_000, progress=False)


def test_jacobian_size_guard(finetuned_copies):
    base = TinyTransformer(seed=0).double()
    fts = finetuned_copies(base, 2, scale=0.1, layer="fc1")
    with pytest.raises(ValidationError, match=r"the Jacobian of this batch would take .* use smaller batches"):
        collect_statistics(base, fts, "fc1", [torch.randn(2, 3, 5, dtype=torch.float64)] * 2,
                           max_jacobian_bytes=100, progress=False)


def test_layer_called_twice_is_rejected(finetuned_copies):
    class Twice(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(3, 3)

        def forward(self, x):
            return self.lin(self.lin(x))

    base = Twice().double()
    fts = finetuned_copies(base, 2, scale=0.1)
    with pytest.raises(ValidationError, match="the merge layer ran 2 times in one forward pass"):
        collect_statistics(base, fts, "lin", [torch.randn(2, 3, dtype=torch.float64)] * 2, progress=False)


def test_a_model_that_fails_on_the_calibration_inputs_is_named() -> None:
    """Inputs of the wrong width: one ValidationError naming the task, batch and model, not
    torch's raw RuntimeError."""
    import copy

    import torch

    import mergeqp as mq
    from mergeqp.errors import ValidationError

    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    fts = [copy.deepcopy(base) for _ in range(2)]
    good = [torch.randn(6, 8)]
    with pytest.raises(ValidationError, match=r"batch 0: the base model failed on this batch \(RuntimeError"):
        mq.collect_statistics(base, fts, "2", [[torch.randn(4, 9)], good], progress=False)
