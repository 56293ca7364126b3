"""examples/engine_generate.py serves a random checkpoint through hal_core.engine without torch."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "engine_generate.py"


def test_engine_generate_example_serves_every_request(cpu) -> None:
    """Four requests get their 16 new tokens each, and torch is never imported."""
    code = (f"import runpy, sys; sys.argv = [{str(EXAMPLE)!r}, '--new-tokens', '16']\n"
            "try:\n    runpy.run_path(sys.argv[0], run_name='__main__')\n"
            "except SystemExit as exc:\n    assert not exc.code, exc.code\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    requests = re.findall(r"request \d: prompt \d+ tokens -> \[([^\]]*)\]", proc.stdout)
    assert len(requests) == 4 and all(len(r.split(",")) == 16 for r in requests), proc.stdout
    assert "64 new tokens for 4 requests" in proc.stdout
