"""The process-wide gRPC settings the ``tokenmesh`` command makes (tokenmesh/__main__.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tokenmesh.__main__ import GRPC_EXPERIMENTS

UNKNOWN = "Unknown experiment"


def _grpc_stderr(experiments: str) -> str:
    """What importing grpc and opening a channel writes to stderr under these experiments."""
    code = "import grpc; grpc.insecure_channel('127.0.0.1:1').close()"
    env = {**os.environ, "GRPC_EXPERIMENTS": experiments}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return result.stderr


def test_the_installed_grpc_knows_every_experiment_the_command_sets() -> None:
    assert UNKNOWN in _grpc_stderr("-no_such_experiment")  # the check below can fail
    assert UNKNOWN not in _grpc_stderr(GRPC_EXPERIMENTS), "grpcio dropped an experiment tokenmesh/__main__.py sets"


ENTRY = """
import os, sys
import tokenmesh.__main__ as entry
imported_early = "grpc" in sys.modules
sys.argv = ["tokenmesh", "--help"]
try:
    entry.main()
except SystemExit:
    pass
print(repr((imported_early, os.environ.get("GRPC_EXPERIMENTS"))), file=sys.stderr)
"""


@pytest.mark.parametrize(
    ("given", "expected"), [(None, GRPC_EXPERIMENTS), ("", ""), ("-event_engine_listener", "-event_engine_listener")]
)
def test_the_command_sets_the_default_before_grpc_is_imported_and_a_given_value_wins(
    given: str | None, expected: str
) -> None:
    env = {k: v for k, v in os.environ.items() if k != "GRPC_EXPERIMENTS"}
    if given is not None:
        env["GRPC_EXPERIMENTS"] = given
    result = subprocess.run([sys.executable, "-c", ENTRY], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "usage: tokenmesh" in result.stdout
    assert result.stderr.strip().splitlines()[-1] == repr((False, expected))
