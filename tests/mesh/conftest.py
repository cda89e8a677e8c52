"""Fixtures of this folder; their code lives in tests/support, shared with the other folders."""

from tests.support.mesh import mesh as mesh  # the in-process mesh (two workers over FakeBackend and a router)
from tests.support.mesh import mesh_road as mesh_road  # parametrizes a test over the router's two roads to a worker
