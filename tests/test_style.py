"""The code base stays lint-clean: ruff over Python, the committed .clang-format over C++
(and -Wall -Wextra at build time)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_clean():
    ruff = shutil.which("ruff") or str(Path(sys.executable).parent / "ruff")
    if not Path(ruff).exists():
        pytest.skip("ruff is not installed (pip install -e '.[test]' installs it)")
    out = subprocess.run([ruff, "check", str(ROOT)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


def test_cpp_follows_clang_format():
    tool = shutil.which("clang-format") or str(Path(sys.executable).parent / "clang-format")
    if not Path(tool).exists():
        pytest.skip("clang-format is not installed (pip install -e '.[test]' installs it)")
    files = sorted(str(p) for p in (ROOT / "csrc").rglob("*") if p.suffix in (".cc", ".h", ".cu"))
    out = subprocess.run([tool, "--dry-run", "--Werror", *files], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, "run clang-format -i on these:\n" + out.stderr[-4000:]
