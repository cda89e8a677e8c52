"""The image's Dockerfile and build script pass their linters (the build itself: `make image`, docs/image.md)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


@pytest.mark.parametrize(
    ("tool", "target"),
    [
        ("hadolint", "Dockerfile"),
        ("shellcheck", "scripts/build_image.sh"),
        ("shellcheck", "scripts/install_debian_packages.sh"),
    ],
)
def test_linter_passes(tool: str, target: str) -> None:
    binary = BIN / tool
    if not binary.exists():
        pytest.fail(f"{binary} missing: `make venv` installs it (dev dependencies)")
    result = subprocess.run([str(binary), str(ROOT / target)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_image_is_non_root_with_the_tokenmesh_entry_point_and_no_latest_tag() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    final = dockerfile.rsplit("\nFROM ", 1)[1]  # the last stage is the image
    assert re.search(r"^USER 10001:10001$", final, re.MULTILINE)
    assert 'ENTRYPOINT ["tokenmesh"]' in final
    assert not re.search(r"\b(gcc|g\+\+|build-essential|python3[.0-9]*-dev)\b", final)
    assert ":latest" not in dockerfile and "ARG BASE_IMAGE=" in dockerfile
