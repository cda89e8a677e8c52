"""The README documents every setting the services accept."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from tokenmesh.config import env_name
from tokenmesh.prober import ProberConfig
from tokenmesh.router import RouterConfig
from tokenmesh.worker import WorkerConfig
from tokenmesh_gateway import GatewayConfig

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()


def test_every_setting_is_in_the_readme_table() -> None:
    missing = []
    for service, cls in (("router", RouterConfig), ("worker", WorkerConfig), ("prober", ProberConfig),
                         ("gateway", GatewayConfig)):
        for field in dataclasses.fields(cls):
            row = f"| `{service}` | `--{field.name.replace('_', '-')}` | `{env_name(service, field.name)}` |"
            if row not in README:
                missing.append(row)
    assert not missing, "README configuration table lacks:\n" + "\n".join(missing)
