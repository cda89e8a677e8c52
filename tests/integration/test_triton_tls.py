"""The worker reaches an external Triton over mutual TLS (Triton's --grpc-use-ssl-mutual), as a sidecar may run."""

from __future__ import annotations

from pathlib import Path

import pytest
import tritonclient.grpc.aio as triton_aio

from tokenmesh.certs import make_dev_certs
from tokenmesh.worker import Delta, Finished, GenerationParams
from tokenmesh.worker.triton import (
    SHIPPED_REPOSITORIES,
    TritonBackend,
    TritonBackendConfig,
    TritonProcess,
    TritonProcessConfig,
)

pytestmark = pytest.mark.integration


async def test_a_worker_backend_generates_over_mutual_tls_and_plaintext_is_refused(tmp_path: Path) -> None:
    certs = make_dev_certs(tmp_path / "certs")
    ssl_args = (
        "--grpc-use-ssl-mutual=true",
        f"--grpc-server-cert={certs / 'worker.crt'}",
        f"--grpc-server-key={certs / 'worker.key'}",
        f"--grpc-root-cert={certs / 'ca.crt'}",
    )
    process = TritonProcess(
        TritonProcessConfig(
            work_dir=tmp_path / "triton", extra_args=ssl_args, model_repository=SHIPPED_REPOSITORIES["synthetic"]
        )
    )
    await process.start()
    backend = TritonBackend(
        TritonBackendConfig(
            url=process.url, tls=(str(certs / "ca.crt"), str(certs / "worker.key"), str(certs / "worker.crt"))
        )
    )
    try:
        await backend.start()
        events = [
            e
            async for e in backend.generate(
                GenerationParams(model="synthetic", prompt="hi", max_tokens=5, request_id="tls-1")
            )
        ]
        assert sum(e.tokens for e in events if isinstance(e, Delta)) == 5
        assert isinstance(events[-1], Finished) and events[-1].reason == "length"
        plaintext = triton_aio.InferenceServerClient(process.url)
        with pytest.raises(Exception):  # noqa: B017, PT011 - tritonclient wraps the refused handshake in its own
            await plaintext.is_server_live(client_timeout=3)
        await plaintext.close()
    finally:
        await backend.stop()
        await process.stop()
