"""Fixtures of this folder; their code lives in tests/support, shared with the other folders."""

from tests.support.chart import helm as helm  # helm v3 and v4, each test once with each
