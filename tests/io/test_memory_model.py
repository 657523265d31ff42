"""The memory model (:mod:`mergeqp.io.memory`): its counts, the ``max_memory`` cap, and the
refusal of an oversized site before anything of it is allocated, in both statistics paths
(``collect_first_order`` for ``mergeqp merge``, ``collect_statistics`` for ``mergeqp collect``)."""

from __future__ import annotations

import pytest

from mergeqp.errors import ValidationError
from mergeqp.io.memory import (
    DESIGN_COPIES_FLOAT64,
    GRAM_SQUARE_COPIES,
    SOLVE_SQUARE_COPIES,
    check_site_memory,
    current_limit,
    estimate_site_memory,
    memory_budget,
    memory_limit,
)


def test_the_estimate_counts_the_sums_the_batch_and_the_solve():
    est = estimate_site_memory("l", n=100, n_tasks=3, samples=4, outputs=50, itemsize=4)
    assert est.statistics == 8 * 3 * (100 * 100 + 100 + 1)
    assert est.batch == 4 * 50 * 100 * (4 + 8 * DESIGN_COPIES_FLOAT64) + GRAM_SQUARE_COPIES * 8 * 100 * 100
    assert est.solve == SOLVE_SQUARE_COPIES * 8 * 100 * 100
    assert est.peak == est.statistics + max(est.batch, est.solve)
    assert estimate_site_memory("l", n=100, n_tasks=3).batch == 0  # batch unknown yet


def test_the_cap_nests_and_the_smaller_budget_wins():
    assert current_limit() is None
    with memory_limit(10**9):
        assert current_limit() == 10**9
        assert memory_budget(5 * 10**8)[0] == 5 * 10**8  # the machine has less than the cap
        assert memory_budget(None) == (10**9, "max_memory = 953.7 MiB")
        with memory_limit(None):
            assert current_limit() is None
        assert current_limit() == 10**9
    assert current_limit() is None
    with pytest.raises(ValidationError, match="positive"):
        with memory_limit(0):
            pass


def test_an_oversized_site_is_refused_naming_it_and_what_to_change():
    est = estimate_site_memory("model.layers.3.mlp.down_proj", n=40_000, n_tasks=2)  # H: 2 x 12.8 GB
    with pytest.raises(ValidationError) as info:
        check_site_memory(est, available=16 * 10**9)
    msg = str(info.value)
    assert "model.layers.3.mlp.down_proj" in msg and "14.9 GiB of memory available" in msg
    assert "method.parametrisation" in msg and "output.restrict" in msg and "calibration.batch_size" in msg
    # (stop 48 review) a glob over every block of fine-tunes of three: the remedy the user needed
    assert "select only the layers your fine-tunes changed" in msg and "instead of joint" not in msg
    check_site_memory(est, available=10**12)  # fits a larger machine
    with memory_limit(10**10), pytest.raises(ValidationError, match="max_memory = 9.3 GiB"):
        check_site_memory(est, available=10**12)


class _Sentinel(Exception):
    """Raised by a patched allocator: the refusal must come before it."""


def test_merge_statistics_refuse_an_oversized_site_before_allocating(tiny_hf, tmp_path, monkeypatch):
    """``mergeqp merge`` with ``max_memory`` far below a site's estimate stops with exit code 2
    and a message naming the site, before the statistics' sums are allocated."""
    pytest.importorskip("transformers")
    import mergeqp.merge.firstorder as fo
    from mergeqp.cli import main

    def no_allocation(*args, **kwargs):
        raise _Sentinel("the statistics were allocated before the memory check")

    monkeypatch.setattr(fo, "GaussNewtonSums", no_allocation)
    fam = tiny_hf.make_family(tmp_path / "fam", "llama", K=2, scale=0.3, n_prompts=6)
    cfg = fam.write_config(tmp_path / "cfg.yml", tiny_hf.MLP_LAYER["llama"], {"name": "qp", "mode": "single"},
                           max_memory="10KB")
    assert main(["merge", str(cfg), "--out", str(tmp_path / "out"), "--quiet"]) == 2
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
    # the command-line cap overrides the config's; an unparsable one is a usage error
    assert main(["merge", str(cfg), "--out", str(tmp_path / "out"), "--quiet", "--max-memory", "lots"]) == 2


def test_merge_refusal_message(tiny_hf, tmp_path, capsys):
    pytest.importorskip("transformers")
    from mergeqp.cli import main

    fam = tiny_hf.make_family(tmp_path / "fam", "llama", K=2, scale=0.3, n_prompts=6)
    cfg = fam.write_config(tmp_path / "cfg.yml", tiny_hf.MLP_LAYER["llama"], {"name": "qp", "mode": "single"})
    assert main(["merge", str(cfg), "--out", str(tmp_path / "out"), "--quiet", "--max-memory", "10KB"]) == 2
    err = capsys.readouterr().err
    assert f"merge site {tiny_hf.MLP_LAYER['llama']}" in err and "max_memory = 9.8 KiB" in err
    assert "method.parametrisation" in err


def test_a_bad_max_memory_in_the_config_is_a_config_error(tiny_hf, tmp_path):
    pytest.importorskip("transformers")
    from mergeqp.config import load_config
    from mergeqp.errors import ConfigError

    fam = tiny_hf.make_family(tmp_path / "fam", "llama", K=2, n_prompts=6)
    path = fam.write_config(tmp_path / "cfg.yml", tiny_hf.MLP_LAYER["llama"], {"name": "qp"}, max_memory="much")
    with pytest.raises(ConfigError, match="max_memory"):
        load_config(path)
    ok = load_config(fam.write_config(tmp_path / "ok.yml", tiny_hf.MLP_LAYER["llama"], {"name": "qp"},
                                      max_memory="8GB"))
    assert ok.max_memory_bytes() == 8 * 10**9


def test_collect_statistics_refuses_before_allocating(monkeypatch):
    """``collect_statistics(max_memory=...)`` refuses the layer before its sums are allocated
    when the estimate exceeds the cap by one byte, and collects at exactly the estimate."""
    torch = pytest.importorskip("torch")
    import mergeqp.stats.collect as collect

    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    ft = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    ft.load_state_dict(base.state_dict())
    with torch.no_grad():
        ft[2].weight.add_(0.1)
    cal = [torch.randn(5, 6)]
    params = collect._resolve_params(("rows", "scalar"), 3, 9)
    acc = collect._Accumulator(torch.zeros(1, 3, 9), True, params, False, 1e9, 8192, 1e-6, layer="2",
                               expected_samples=64)
    need = acc.memory(c=3, T=1, B=5).peak
    assert need >= collect.estimate_statistics_bytes(3, 8, 1, 3)["total"]
    with monkeypatch.context() as patch:
        patch.setattr(collect, "GaussNewtonSums", lambda *a, **k: pytest.fail("allocated before the check"))
        with pytest.raises(ValidationError, match=r"merge site 2: .*max_memory"):
            collect.collect_statistics(base, [ft], "2", cal, progress=False, max_memory=need - 1)
    assert collect.collect_statistics(base, [ft], "2", cal, progress=False, max_memory=need).n_samples == 5


def test_cli_collect_max_memory(tmp_path, capsys):
    """``mergeqp collect --max-memory``: refused with exit code 2 naming the layer, no file
    written; an unparsable size is a usage error before anything is loaded."""
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file

    from mergeqp.cli import main

    (tmp_path / "factory.py").write_text(
        "import torch.nn as nn\n\ndef make():\n    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))\n")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    save_file(model.state_dict(), str(tmp_path / "base.safetensors"))
    with torch.no_grad():
        model[2].weight.add_(0.1)
    save_file(model.state_dict(), str(tmp_path / "ft.safetensors"))
    torch.save(torch.randn(5, 6), tmp_path / "cal.pt")
    args = ["collect", "--factory", f"{tmp_path / 'factory.py'}:make", "--base", str(tmp_path / "base.safetensors"),
            "--finetuned", str(tmp_path / "ft.safetensors"), "--layer", "2", "--calibration", str(tmp_path / "cal.pt"),
            "--out", str(tmp_path / "s.npz"), "--quiet"]
    assert main([*args, "--max-memory", "1KB"]) == 2
    assert "merge site 2:" in capsys.readouterr().err and not (tmp_path / "s.npz").exists()
    assert main([*args, "--max-memory", "plenty"]) == 2
    assert "--max-memory" in capsys.readouterr().err
    assert main([*args, "--max-memory", "1GB"]) == 0 and (tmp_path / "s.npz").exists()


def test_reverse_mode_counts_the_sites_jacobian_not_the_atoms_tangents():
    from mergeqp.io.memory import ACTIVATION_COPIES, JACOBIAN_COPIES, TANGENT_COPIES, VJP_ACTIVATION_COPIES

    common = dict(n=600, n_tasks=2, samples=4, outputs=30, itemsize=4, positions=8, site_width=50, chunk=16,
                  widest=70)
    fwd = estimate_site_memory("l", **common)
    rev = estimate_site_memory("l", **common, tangent_atoms=0, jacobian_width=50)
    tokens = 4 * 8
    shared = fwd.batch - TANGENT_COPIES * 600 * tokens * 50 * 4 - ACTIVATION_COPIES * 16 * tokens * 70 * 4
    jacobian, chunk = JACOBIAN_COPIES * 30 * tokens * 50 * 4, VJP_ACTIVATION_COPIES * 16 * tokens * 70 * 4
    assert rev.batch == shared + max(jacobian, chunk)
    assert rev.batch < fwd.batch and rev.statistics == fwd.statistics and rev.solve == fwd.solve


def test_a_site_that_fits_only_in_reverse_mode_is_merged_under_auto(tiny_hf, tmp_path, monkeypatch):
    """With fewer compared outputs than atoms, ``jacobian_mode: auto`` computes the statistics in
    reverse mode (no tangents of the atoms): the memory check counts that, so a cap between the
    two modes' estimates refuses ``forward`` and merges under ``auto`` (a cap checked against the
    forward estimate refused both)."""
    pytest.importorskip("transformers")
    import mergeqp.merge.firstorder as fo
    from mergeqp.cli import main

    seen: dict[str, list] = {}
    real = fo.check_site_memory

    def record(est, *args, **kwargs):
        if est.batch:
            seen.setdefault(mode, []).append(est)
        return real(est, *args, **kwargs)

    monkeypatch.setattr(fo, "check_site_memory", record)
    fam = tiny_hf.make_family(tmp_path / "fam", "llama", K=2, scale=0.3, n_prompts=6)
    layer = tiny_hf.MLP_LAYER["llama"]
    out = {"restrict": "projection", "k": 1}
    cfgs = {m: fam.write_config(tmp_path / f"{m}.yml", layer, {"name": "qp", "mode": "single", "jacobian_mode": m},
                                output=out) for m in ("forward", "auto")}
    for mode in ("forward", "auto"):
        assert main(["merge", str(cfgs[mode]), "--out", str(tmp_path / f"out-{mode}"), "--quiet"]) == 0
    fwd, auto = seen["forward"][0].peak, seen["auto"][0].peak
    assert auto < fwd
    cap = str((fwd + auto) // 2)
    mode = "forward"
    assert main(["merge", str(cfgs["forward"]), "--out", str(tmp_path / "capped-f"), "--quiet", "--max-memory", cap]) == 2
    mode = "auto"
    assert main(["merge", str(cfgs["auto"]), "--out", str(tmp_path / "capped-a"), "--quiet", "--max-memory", cap]) == 0


def test_a_cuda_device_budgets_from_its_own_free_memory(monkeypatch):
    """(stop 51) The optimal basis's JVP chunk on a GPU is sized from the GPU's free memory, not the
    host's: the host may have 100 GiB where the GPU has 1 GiB free (and the reverse)."""
    torch = pytest.importorskip("torch")
    from mergeqp.io import memory
    from mergeqp.merge.outputbasis import basis_pass_bytes, fitting_chunk

    monkeypatch.setattr(memory, "available_memory_bytes", lambda *a: 100 * 2**30)
    seen = []

    def mem_get_info(device):
        seen.append(str(device))
        return 2**30, 80 * 2**30

    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    assert memory.device_free_bytes("cuda:1") == (2**30, "GPU memory free on cuda:1") and seen == ["cuda:1"]
    assert memory.device_free_bytes("cpu") == (100 * 2**30, "memory available")
    one = basis_pass_bytes(512, 64, 4096, 4, 1)  # one tangent of 512 tokens through 4096 features
    assert fitting_chunk("l", 64, 512, 64, 4096, 4, device="cpu") == 64  # the host holds them all
    on_gpu = fitting_chunk("l", 64, 512, 64, 4096, 4, device=torch.device("cuda", 0))
    assert on_gpu == min(64, 2**30 // one) < 64
    with pytest.raises(ValidationError, match="GPU memory free on cuda:0"):
        fitting_chunk("l", 64, 512, 64, 4096, 4, held=2**30, device="cuda:0")
