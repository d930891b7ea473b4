"""The suite cannot hang: every test runs under pytest-timeout's deadline (pyproject.toml),
whose "thread" method ends even a test blocked inside native code, with every stack."""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

HANGS = '''
import os


def test_blocks_in_a_read_that_never_returns():
    r, w = os.pipe()
    os.read(r, 1)  # nobody writes: blocks in the kernel
'''


def test_a_hung_test_fails_with_its_stack_within_the_deadline(tmp_path):
    (tmp_path / "test_hangs.py").write_text(HANGS)
    t0 = time.monotonic()
    # the project's own pytest configuration, with the deadline cut to 3 s for the demonstration
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-c", str(ROOT / "pyproject.toml"),
                          "--rootdir", str(tmp_path), "--timeout", "3", str(tmp_path / "test_hangs.py")],
                         capture_output=True, text=True, timeout=120)
    took = time.monotonic() - t0
    out = run.stdout + run.stderr
    assert run.returncode != 0 and took < 60
    assert "Timeout" in out and "test_blocks_in_a_read_that_never_returns" in out  # the stack names the test


def test_the_deadline_is_configured(pytestconfig):
    assert pytestconfig.pluginmanager.hasplugin("timeout")
    assert float(pytestconfig.getini("timeout")) > 0 and pytestconfig.getini("timeout_method") == "thread"
