"""The README's Python examples run as written (in order, in one namespace, from the repo root)."""

from __future__ import annotations

import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _python_blocks() -> list[str]:
    text = (ROOT / "README.md").read_text()
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def test_readme_has_python_examples() -> None:
    assert len(_python_blocks()) >= 3


def test_readme_python_examples_run(capsys) -> None:
    namespace: dict = {}
    old = os.getcwd()
    os.chdir(ROOT)
    try:
        for block in _python_blocks():
            exec(compile(block, "README.md", "exec"), namespace)  # noqa: S102
    finally:
        os.chdir(old)
    assert namespace["solution"].certificate.certified()
    assert set(namespace["ties"]) == set(namespace["sd"]["base"])
    out = capsys.readouterr().out
    assert "certified" in out.lower() or "True" in out


def test_readme_mentions_the_two_commands() -> None:
    text = (ROOT / "README.md").read_text()
    assert "pip install torch==2.13.0" in text and "bash .ci/run" in text
