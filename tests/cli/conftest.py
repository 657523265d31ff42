"""Fixtures of the command-line and reliability tests (the battery of bad inputs, fault
injection, a NaN checkpoint): tiny problem files, points, checkpoints and calibration files,
good and bad, written into one folder whose bytes every case checks before and after."""

from __future__ import annotations

import hashlib
import os
import signal
import textwrap
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

FACTORY = """
import torch.nn as nn

def make(hidden=6):
    return nn.Sequential(nn.Linear(5, hidden), nn.ReLU(), nn.Linear(hidden, 3))
"""

TMP_MARKS = (".tmp-mergeqp-", ".old-mergeqp-")


@pytest.fixture(scope="session")
def digests() -> Callable[[Path], dict[str, str]]:
    """``digests(folder)``: ``{relative path: sha256}`` of every file under ``folder`` (links:
    their target's bytes)."""

    def _digests(folder: Path) -> dict[str, str]:
        out = {}
        for root, _, files in os.walk(folder):
            for name in files:
                path = Path(root) / name
                if path.is_symlink() and not path.exists():
                    out[str(path.relative_to(folder))] = "dangling"
                    continue
                out[str(path.relative_to(folder))] = hashlib.sha256(path.read_bytes()).hexdigest()
        return out

    return _digests


@pytest.fixture(scope="session")
def leftovers() -> Callable[[Path], list[str]]:
    """``leftovers(folder)``: temporary files or folders of the atomic writers anywhere under
    ``folder``."""

    def _leftovers(folder: Path) -> list[str]:
        found = []
        for root, dirs, files in os.walk(folder):
            found += [os.path.join(root, n) for n in dirs + files if any(m in n for m in TMP_MARKS)]
        return found

    return _leftovers


@pytest.fixture(scope="session")
def small_problem() -> Callable[..., dict[str, np.ndarray]]:
    """``small_problem(K=3, m=4, seed=0)``: arrays (``H``, ``g``, ``c``, ``shape``) of a strictly
    convex problem with ``c = 0`` (so ``d = 0`` has ``J = 0 > J*``)."""

    def _small_problem(K: int = 3, m: int = 4, seed: int = 0) -> dict[str, np.ndarray]:
        rng = np.random.default_rng(seed)
        n = K * m
        A = rng.standard_normal((2 * n, n))
        H = A.T @ A + 0.1 * np.eye(n)
        return {"H": H, "g": rng.standard_normal(n), "c": np.float64(0.0), "shape": np.array([K, m])}

    return _small_problem


@pytest.fixture(scope="session")
def build_world(small_problem) -> Callable[[Path], Path]:
    """``build_world(root)``: write every good and bad input of the battery under ``root``;
    returns ``root``."""

    def _build_world(root: Path) -> Path:
        root.mkdir(parents=True, exist_ok=True)
        ok = small_problem()
        np.savez(root / "ok.npz", **ok)
        n = ok["g"].size

        def variant(name: str, **changes: object) -> None:
            arrays = {k: v for k, v in ok.items() if k not in changes or changes[k] is not None}
            arrays.update({k: v for k, v in changes.items() if v is not None})
            for k in [k for k, v in changes.items() if v is None]:
                arrays.pop(k, None)
            np.savez(root / name, **arrays)

        H_nan = ok["H"].copy()
        H_nan[1, 2] = np.nan
        variant("nan_H.npz", H=H_nan)
        g_inf = ok["g"].copy()
        g_inf[0] = np.inf
        variant("inf_g.npz", g=g_inf)
        variant("nan_c.npz", c=np.float64(np.nan))
        variant("no_H.npz", H=None)
        variant("no_g.npz", g=None)
        variant("nonsquare_H.npz", H=ok["H"][:, :-1])
        variant("short_g.npz", g=ok["g"][:-1])
        asym = ok["H"].copy()
        asym[0, 1] += 1.0
        variant("asym_H.npz", H=asym)
        variant("nonconvex_H.npz", H=-ok["H"])
        variant("bad_shape.npz", shape=np.array([3, 4, 1]))
        variant("wrong_shape.npz", shape=np.array([5, 4]))
        variant("array_c.npz", c=np.ones(3))
        variant("text_H.npz", H=np.array([["a"] * n] * n))
        np.savez(root / "pickled.npz", H=np.array([{"H": 1}], dtype=object), g=ok["g"])
        (root / "garbage.npz").write_bytes(b"\x00\x01 definitely not an archive")
        (root / "empty.npz").write_bytes(b"")
        (root / "text.npz").write_text("H = [[1, 0], [0, 1]]\n")
        np.save(root / "single.npy", ok["H"])
        (root / "folder.npz").mkdir()
        os.symlink(root / "ok.npz", root / "link_to_ok.npz")

        K, m = ok["shape"]
        np.save(root / "d_ok.npy", np.full((K, m), 0.5))
        np.save(root / "d_zero.npy", np.zeros((K, m)))
        np.save(root / "d_far.npy", np.full((K, m), 5.0))
        np.save(root / "d_T.npy", np.zeros((m, K)))
        np.save(root / "d_short.npy", np.zeros(n - 1))
        d_nan = np.zeros((K, m))
        d_nan[0, 0] = np.nan
        np.save(root / "d_nan.npy", d_nan)
        (root / "d_garbage.npy").write_bytes(b"not numpy at all")
        (root / "d_nokey.json").write_text('{"x": [1, 2]}')
        (root / "d_bad.json").write_text("{not json")
        (root / "d_words.txt").write_text("a b c\n")
        np.savez(root / "d_two.npz", a=np.zeros((K, m)), b=np.zeros((K, m)))

        (root / "factory.py").write_text(textwrap.dedent(FACTORY))
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(5, 6), torch.nn.ReLU(), torch.nn.Linear(6, 3))
        base = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
        save_file(base, str(root / "base.safetensors"))
        for i in range(2):
            ft = {k: (v + 0.05 * (i + 1) * torch.randn_like(v)).contiguous() for k, v in base.items()}
            save_file(ft, str(root / f"ft{i}.safetensors"))
            torch.save(torch.randn(8, 5, generator=torch.Generator().manual_seed(i)), root / f"cal{i}.pt")
        nan_ft = {k: v.clone() for k, v in base.items()}
        nan_ft["2.weight"][1, 1] = float("nan")
        save_file(nan_ft, str(root / "ft_nan.safetensors"))
        cal_nan = torch.randn(8, 5)
        cal_nan[3, 2] = float("inf")
        torch.save(cal_nan, root / "cal_nan.pt")
        torch.save({"w": torch.zeros(2, 2)}, root / "wrong_model.pt")
        (root / "garbage.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{bad header")
        (root / "garbage_cal.npz").write_bytes(b"nope")
        os.symlink(root / "base.safetensors", root / "link_to_base.safetensors")
        (root / "ckpt_folder").mkdir()
        (root / "config.yml").write_text("base: ./nowhere\nmodels: []\n")
        # links and damaged files of the review cases: a hard link to an input, a folder reached
        # through a symbolic link, an empty and a truncated checkpoint, a point with inf
        os.link(root / "ok.npz", root / "hard_ok.npz")
        os.link(root / "base.safetensors", root / "hard_base.safetensors")
        (root / "sub").mkdir()
        os.symlink(root, root / "sub" / "up")
        (root / "empty.safetensors").write_bytes(b"")
        data = (root / "base.safetensors").read_bytes()
        (root / "trunc.safetensors").write_bytes(data[:-20])  # header intact, data cut short
        (root / "d_inf.json").write_text('{"d": [[Infinity, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]]}')
        return root

    return _build_world


@pytest.fixture(scope="session")
def interrupt_child() -> Callable[..., tuple[int, str]]:
    """``interrupt_child(script, args, announce, signum, settle=0.0) -> (returncode, stderr)``: run
    ``python -c script *args`` with this checkout first on ``PYTHONPATH``, wait until the child
    prints the line ``announce`` (the script says when it is where the signal should land, never a
    fixed sleep), wait ``settle`` seconds more, send ``signum`` and collect the child."""
    import subprocess
    import sys
    import time

    root = Path(__file__).resolve().parents[2]

    def _interrupt(script: str, args: list[str], announce: str, signum: int, settle: float = 0.0) -> tuple[int, str]:
        env = dict(os.environ, PYTHONPATH=str(root) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        # SIGINT as in a terminal even where this run inherited it ignored (a job started in the
        # background by a non-interactive shell): a child that ignores it would never be interrupted
        proc = subprocess.Popen([sys.executable, "-c", script, *args], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=env,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        try:
            assert proc.stdout.readline().strip() == announce, proc.stderr.read()
            time.sleep(settle)
            assert proc.poll() is None, proc.stderr.read()
            proc.send_signal(signum)
            _, err = proc.communicate(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        return proc.returncode, err

    return _interrupt
