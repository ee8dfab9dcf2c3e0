"""docs/torchrl.md runs as written: its Python blocks, top to bottom, in one process."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[2] / "docs" / "torchrl.md"


def python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text, re.M | re.S)


@pytest.mark.slow
def test_the_torchrl_tutorial_runs_as_written(tmp_path: Path) -> None:
    pytest.importorskip("torchrl")
    blocks = python_blocks(DOC.read_text())
    assert len(blocks) >= 5
    script = tmp_path / "tutorial.py"
    script.write_text("\n\n".join(blocks))
    result = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout
    assert "PPO loss" in out and "DQN loss" in out and "SAC loss" in out
    assert re.search(r"^512 torch.Size\(\[64, 4\]\)$", out, re.M), out
    assert re.search(r"^buffer 1024 1024$", out, re.M), out  # millpond.torchrl's buffer
    assert re.search(r"^prioritized 512 \['index', 'priority_weight'\]$", out, re.M), out
    # Two Ray actors' collectors, one table: every step each stored, the learner samples it.
    assert re.search(r"^ray collectors 1024 1024 torch.Size\(\[128\]\)$", out, re.M), out
