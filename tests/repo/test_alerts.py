"""The shipped alerting rules: valid for Prometheus, and each fires on what must fire it and on nothing else."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "helm/tokenmesh/files/tokenmesh-alerts.yaml"


def promtool() -> str:
    found = shutil.which("promtool")
    if not found:
        pytest.fail("promtool not found: `make test-deps` installs Debian's prometheus")
    return found


def test_the_rules_file_is_valid() -> None:
    result = subprocess.run([promtool(), "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 6 rules found" in result.stdout


def test_each_alert_fires_when_it_must_and_only_then() -> None:
    result = subprocess.run(
        [promtool(), "test", "rules", "alerts_test.yaml"],
        cwd=ROOT / "tests/prometheus",
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout
