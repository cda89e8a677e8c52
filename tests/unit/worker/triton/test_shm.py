"""Triton's shared-memory regions: a live worker's are kept, a dead one's are removed by the next start.

The owners here are real processes holding real flocks on a folder standing in for /dev/shm; one is SIGKILLed,
as a worker whose Triton could not clean up would be.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

from tokenmesh.worker.triton._shm import PREFIX, ShmRegions

OWNER = """
import sys, time
from pathlib import Path
from tokenmesh.worker.triton._shm import ShmRegions
regions = ShmRegions(Path(sys.argv[1]))
regions.claim()
for i in range(3):  # what the Python backend makes: prefix + a UUID
    (regions.folder / f"{regions.prefix}{i}").write_bytes(b"x")
print(regions.prefix, flush=True)
time.sleep(60)
"""


def regions(folder: Path, prefix: str) -> list[str]:
    return sorted(p.name for p in folder.glob(f"{prefix}*") if not p.name.endswith(".lock"))


def test_a_dead_owners_regions_go_at_the_next_claim_and_a_live_ones_stay(tmp_path: Path) -> None:
    owner = [
        subprocess.Popen([sys.executable, "-c", OWNER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    try:
        dead = owner[0]  # the other stays alive
        prefixes = [p.stdout.readline().strip() for p in owner]  # type: ignore[union-attr]
        assert all(len(regions(tmp_path, p)) == 3 for p in prefixes)
        (tmp_path / "triton_python_backend_shm_region_other").write_bytes(b"x")  # not ours: never touched
        dead.send_signal(signal.SIGKILL)
        dead.wait()
        mine = ShmRegions(tmp_path)
        mine.claim()
        assert regions(tmp_path, prefixes[0]) == []
        assert not (tmp_path / f"{prefixes[0].removesuffix('_')}.lock").exists()
        assert len(regions(tmp_path, prefixes[1])) == 3  # its owner lives
        assert (tmp_path / "triton_python_backend_shm_region_other").exists()
        assert mine.backend_config() == [f"--backend-config=python,shm-region-prefix-name={mine.prefix}"]
        assert mine.prefix.startswith(PREFIX) and mine.prefix not in prefixes
    finally:
        for proc in owner:
            proc.kill()
            proc.wait()
            proc.stdout.close()  # type: ignore[union-attr]


def test_release_removes_its_own_regions_and_lock_and_a_claim_again_its_earlier_tritons(tmp_path: Path) -> None:
    mine = ShmRegions(tmp_path)
    mine.claim()
    (tmp_path / f"{mine.prefix}a").write_bytes(b"x")  # left by a Triton of ours that was killed
    mine.claim()  # the next start
    assert regions(tmp_path, mine.prefix) == []
    (tmp_path / f"{mine.prefix}b").write_bytes(b"x")
    mine.release()
    assert list(tmp_path.iterdir()) == []
    mine.release()  # twice is harmless


def test_without_the_folder_nothing_is_named_or_removed(tmp_path: Path) -> None:
    missing = ShmRegions(tmp_path / "none")
    missing.claim()
    assert missing.backend_config() == []
    missing.release()
