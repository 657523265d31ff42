"""``output: {restrict: projection, matrix: FILE}``: the outputs compared through a given matrix
(e.g. the stacked weights of classifier heads). The statistics equal those of the same network
whose output is multiplied by the matrix, compared in full; the identity matrix changes nothing;
the run layer reads the file relative to the config, says it in the plan, and refuses bad input
with errors that name the key."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from mergeqp.config import load_config  # noqa: E402
from mergeqp.errors import ConfigError, ValidationError  # noqa: E402
from mergeqp.io.arrays import read_matrix  # noqa: E402
from mergeqp.io.calibration import Batch  # noqa: E402
from mergeqp.lm import OutputSpec, teacher_forced_targets  # noqa: E402
from mergeqp.merge.firstorder import SiteAtoms, TaskTargets, collect_first_order  # noqa: E402
from mergeqp.merge.sites import match_sites, model_sites  # noqa: E402
from mergeqp.run.pipeline import run_merge  # noqa: E402
from mergeqp.run.schema import OutputConfig  # noqa: E402
from mergeqp.stats.parametrisation import as_parametrisation  # noqa: E402

RNG = np.random.default_rng(7)
M = RNG.standard_normal((3, 2))  # 3 output features compared through 2 columns


class Net(torch.nn.Module):
    def __init__(self, times=None) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 6)
        self.head = torch.nn.Linear(6, 3)
        self.times = None if times is None else torch.as_tensor(times)

    def forward(self, x):  # noqa: D102
        y = self.head(torch.tanh(self.fc(x)))
        return {"logits": y if self.times is None else y @ self.times.to(y.dtype)}


def _family(times=None):
    torch.manual_seed(0)
    base = Net(times).double().eval()
    fts = []
    for _ in range(2):
        ft = Net(times).double().eval()
        ft.load_state_dict(base.state_dict())
        with torch.no_grad():
            ft.fc.weight.add_(0.3 * torch.randn(ft.fc.weight.shape, dtype=torch.float64))
        fts.append(ft)
    return base, fts


def _statistics(spec, times=None):
    base, fts = _family(times)
    gen = torch.Generator().manual_seed(1)
    batches = [Batch({"x": torch.randn(3, 5, 4, generator=gen, dtype=torch.float64)}) for _ in range(2)]
    site = match_sites(model_sites(base), ["fc"])[0]
    w = torch.cat([base.fc.weight, base.fc.bias[:, None]], 1).detach()
    deltas = torch.stack([torch.cat([f.fc.weight, f.fc.bias[:, None]], 1).detach() - w for f in fts])
    tasks = [TaskTargets(f"t{i}", 1.0, teacher_forced_targets(ft, batches, spec, "cpu")) for i, ft in enumerate(fts)]
    return collect_first_order(base, [SiteAtoms(site, as_parametrisation("rows"), deltas)], tasks, spec,
                               jacobian_mode="auto")


def test_statistics_through_a_matrix_equal_those_of_the_multiplied_output():
    got = _statistics(OutputSpec(restrict="projection", matrix=M))
    reference = _statistics(OutputSpec(), times=M)  # the network's own output is y M, compared in full
    assert np.abs(reference.H).max() > 0
    np.testing.assert_allclose(got.H, reference.H, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(got.g, reference.g, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(got.c, reference.c, rtol=1e-12)
    same = _statistics(OutputSpec(restrict="projection", matrix=np.eye(3)))
    plain = _statistics(OutputSpec())
    np.testing.assert_allclose(same.H, plain.H, rtol=1e-12, atol=1e-14)


def test_output_spec_refuses_a_matrix_it_cannot_use():
    assert OutputSpec(restrict="projection", matrix=M).k == 2
    with pytest.raises(ValidationError, match="restrict projection"):
        OutputSpec(restrict="none", matrix=M)
    with pytest.raises(ValidationError, match="k=5 but the output matrix has 2 columns"):
        OutputSpec(restrict="projection", k=5, matrix=M)
    with pytest.raises(ValidationError, match="euclidean metric"):
        OutputSpec(restrict="projection", metric="kl", matrix=M)
    with pytest.raises(ValidationError, match="finite 2-D"):
        OutputSpec(restrict="projection", matrix=np.array([[1.0, np.nan]]))
    spec = OutputSpec(restrict="projection", matrix=M)
    with pytest.raises(ValidationError, match="has 3 rows but the compared output 'logits' has 4 features"):
        spec.projection(4, torch.float64, "cpu")


def test_output_config_keys():
    cfg = OutputConfig(restrict="projection", matrix="heads.npy")
    assert cfg.model_dump()["matrix"] == "heads.npy" and "matrix" not in OutputConfig().model_dump()
    for bad, message in (({"matrix": "m.npy"}, "needs restrict: projection"),
                         ({"restrict": "projection", "k": 4, "matrix": "m.npy"}, "leave out 'k'"),
                         ({"restrict": "projection", "metric": "kl", "matrix": "m.npy"}, "metric: euclidean")):
        with pytest.raises(Exception, match=message):
            OutputConfig(**bad)


@pytest.mark.parametrize("suffix", [".npy", ".npz", ".pt", ".safetensors", ".csv"])
def test_read_matrix_formats(tmp_path, suffix):
    path = tmp_path / f"m{suffix}"
    if suffix == ".npy":
        np.save(path, M)
    elif suffix == ".npz":
        np.savez(path, heads=M)
    elif suffix == ".pt":
        torch.save(torch.from_numpy(M), path)
    elif suffix == ".safetensors":
        from safetensors.numpy import save_file
        save_file({"heads": M}, str(path))
    else:
        np.savetxt(path, M, delimiter=",")
    np.testing.assert_allclose(read_matrix(path), M, rtol=1e-15)


def test_read_matrix_errors(tmp_path):
    with pytest.raises(ValidationError, match="file not found"):
        read_matrix(tmp_path / "none.npy")
    np.save(tmp_path / "v.npy", np.ones(3))
    with pytest.raises(ValidationError, match=r"shape \(3,\)"):
        read_matrix(tmp_path / "v.npy")
    np.savez(tmp_path / "two.npz", a=M, b=M)
    with pytest.raises(ValidationError, match="must hold one array"):
        read_matrix(tmp_path / "two.npz")
    (tmp_path / "m.json").write_text("[]")
    with pytest.raises(ValidationError, match="is not one of"):
        read_matrix(tmp_path / "m.json")
    # (stop 73, a QA review) a text file named .npy: one plain line, never numpy's advice to unpickle it
    (tmp_path / "heads.npy").write_text("hello\n")
    with pytest.raises(ValidationError, match=r"not an array of numbers in \.npy format") as info:
        read_matrix(tmp_path / "heads.npy", "output.matrix")
    assert "allow_pickle" not in str(info.value) and str(info.value).startswith("output.matrix: cannot read")


def test_merge_through_a_matrix_from_the_config(tiny_hf, tmp_path):
    """A single-layer QP merge on a tiny Llama whose logits are compared through a (V, 3) matrix
    in a file next to the config; the plan says so; a missing file is named before loading."""
    fam = tiny_hf.make_family(tmp_path / "fam", "llama", K=2, n_prompts=10)
    V = len(tiny_hf.vocab())
    np.save(tmp_path / "heads.npy", RNG.standard_normal((V, 3)))
    layer = tiny_hf.MLP_LAYER["llama"]
    method = {"name": "qp", "mode": "single", "parametrisation": "rows"}
    cfg = load_config(fam.write_config(tmp_path / "m.yml", layer, method,
                                       output={"restrict": "projection", "matrix": "heads.npy"}))
    result = run_merge(cfg, tmp_path / "out", progress=False)
    report = result.report
    (record,) = report["layers"]
    assert record["certificate"]["certified"] and record["objective_after"] <= record["objective_before"]
    from mergeqp.run.plan import build_plan

    assert "logits (through the matrix in heads.npy)" in build_plan(cfg).render()  # what --dry-run prints
    missing = load_config(fam.write_config(tmp_path / "bad.yml", layer, method,
                                           output={"restrict": "projection", "matrix": "nothing.npy"}))
    with pytest.raises(ConfigError, match="output.matrix"):
        run_merge(missing, tmp_path / "out2", progress=False)
    # (stop 50) a matrix with another row count than the vocabulary passed --dry-run and stopped the run after
    # the base was loaded, without naming output.matrix
    np.save(tmp_path / "short.npy", RNG.standard_normal((V - 1, 3)))
    short = load_config(fam.write_config(tmp_path / "short.yml", layer, method,
                                         output={"restrict": "projection", "matrix": "short.npy"}))
    with pytest.raises(ConfigError, match=rf"output.matrix short.npy: it has {V - 1} rows, but .* has {V} numbers"):
        build_plan(short)
