"""The worker's Triton clients run on uvloop, whose transports are not asyncio's: test them on both loops."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from typing import Any

import pytest
import uvloop


def pytest_asyncio_loop_factories(config: pytest.Config, item: pytest.Item) -> Mapping[str, Callable[[], Any]]:
    """Each async test here once on asyncio's loop and once on uvloop's."""
    return {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}
