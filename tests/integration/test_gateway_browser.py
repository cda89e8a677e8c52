"""A real browser's EventSource resumes a gateway stream after its connection is cut (headless Chromium).

Not part of `make test` (marker ``browser``): `make test-browser` installs
Debian's ``chromium`` when it is missing and runs it; it fails without one. The mesh is the in-process one
over the fake engine: what is under test is the browser's reconnect with
``Last-Event-ID`` and the gateway's answer to it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from pathlib import Path

import httpx
import orjson
import pytest

from tests.support.gateway_helpers import Reader, gateway_over
from tests.support.mesh import in_process_mesh
from tests.support.tcp_proxy import TcpProxy

pytestmark = [pytest.mark.integration, pytest.mark.browser]

PAGE = """<!doctype html><script>
const params = new URLSearchParams(location.search);
const source = new EventSource(params.get("stream"));
let text = "", ids = [], opens = 0, errors = 0;
source.onopen = () => { opens += 1; };
source.onerror = () => { errors += 1; };  // the browser reconnects by itself, with Last-Event-ID
source.onmessage = (event) => {
  if (event.data === "[DONE]") {
    source.close();
    fetch(params.get("report"), {method: "POST", body: JSON.stringify({text, ids, opens, errors})});
    return;
  }
  for (const choice of JSON.parse(event.data).choices) text += choice.text || "";
  if (event.lastEventId) ids.push(event.lastEventId);
};
</script>"""

TOKENS = 200


async def test_a_browser_eventsource_reconnects_with_last_event_id_and_gets_exactly_the_rest(
    tmp_path: Path,
) -> None:
    reports: asyncio.Queue[bytes] = asyncio.Queue()

    async def collect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(
            int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:")
        )
        await reports.put(await reader.readexactly(length))
        writer.write(b"HTTP/1.1 204 No Content\r\nAccess-Control-Allow-Origin: *\r\n\r\n")
        await writer.drain()
        writer.close()

    collector = await asyncio.start_server(collect, "127.0.0.1", 0)
    async with in_process_mesh(backend_settings={"delay": 0.05}) as mesh, gateway_over(mesh) as gw:
        proxy = TcpProxy("127.0.0.1", gw.port)
        await proxy.start()
        browser = None
        try:
            # Start a resumable generation and drop it: it runs on, detached, for the browser to follow.
            async with httpx.AsyncClient(base_url=gw.url) as http:
                async with http.stream(
                    "POST",
                    "/completions",
                    headers={"X-Request-Id": "page-1"},
                    json={"prompt": "hi", "max_tokens": TOKENS, "stream": True},
                ) as response:
                    await Reader(response).events(1)
            page = tmp_path / "page.html"
            page.write_text(PAGE)
            stream = f"http://{proxy.address}/v1/completions/page-1/stream"
            report = f"http://127.0.0.1:{collector.sockets[0].getsockname()[1]}/report"
            browser = await asyncio.create_subprocess_exec(
                "chromium",
                "--headless=new",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-web-security",
                "--no-first-run",
                f"--user-data-dir={tmp_path / 'profile'}",
                f"{page.as_uri()}?stream={stream}&report={report}",
                stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.DEVNULL,
                start_new_session=True,
            )
            await asyncio.sleep(2.5)  # the page is streaming by now (the generation takes ~10 s)
            proxy.cut()  # the network path fails mid-stream
            result = orjson.loads(await asyncio.wait_for(reports.get(), 40))
        finally:
            if browser is not None and browser.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(browser.pid, signal.SIGKILL)  # the browser we started, and its helpers
                await browser.wait()
            await proxy.stop()
            collector.close()
    assert result["opens"] >= 2 and result["errors"] >= 1, result  # it was cut and reconnected
    assert result["text"] == "".join(f"tok{i} " for i in range(TOKENS))  # every token once, in order
    seqs = [int(i.rpartition(":")[2]) for i in result["ids"]]
    assert seqs == sorted(set(seqs)) and seqs[0] == 1
