"""Every benchmark script answers ``--help`` with its usage, and starts nothing (no server, no run)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
SCRIPTS = sorted(path for path in BENCHMARKS.glob("*.py") if 'if __name__ == "__main__":' in path.read_text())


def test_the_scripts_are_found() -> None:
    named = {"bench.py", "fenced_save.py", "holds.py", "instructions.py", "renew_latency.py"}
    assert named <= {path.name for path in SCRIPTS}


@pytest.mark.parametrize("script", SCRIPTS, ids=[path.name for path in SCRIPTS])
def test_each_script_answers_help(script: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("usage: "), done.stdout[:500]
