"""MetricsServer: GET /metrics over HTTP on a node's own asyncio loop (`--metrics-port`).

    server = MetricsServer("127.0.0.1", 9100)
    port = await server.start()      # raises OSError naming the address when it cannot bind
    ...
    await server.stop()

It serves `pdserve.serving.metrics.render()` (this process's REGISTRY) and answers 404 elsewhere. Scrapes
run on the node's event loop; collectors must not block (EngineCollector reads a kept snapshot).
"""

from __future__ import annotations

import logging

from aiohttp import web

from pdserve.serving.metrics.registry import render

logger = logging.getLogger(__name__)


async def _metrics(request: web.Request) -> web.Response:
    body, content_type = render()
    # aiohttp wants the charset apart from the media type.
    media, _, params = content_type.partition(";")
    charset = params.split("charset=")[-1].strip() if "charset=" in params else None
    return web.Response(body=body, content_type=media.strip(), charset=charset)


class MetricsServer:
    def __init__(self, host: str, port: int) -> None:
        if not 0 <= port < 65536:
            raise ValueError(f"metrics port must be in 0..65535, got {port}")
        self.host = host
        self.port = port
        self._runner: web.AppRunner | None = None

    async def start(self) -> int:
        """Bind and serve; returns the bound port (the OS's choice when constructed with 0)."""
        app = web.Application()
        app.router.add_get("/metrics", _metrics)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, self.host, self.port)
        try:
            await site.start()
        except OSError as e:
            await runner.cleanup()
            raise OSError(e.errno, f"metrics server cannot bind {self.host}:{self.port}: {e.strerror}") from e
        self._runner = runner
        self.port = runner.addresses[0][1]
        logger.info("metrics on http://%s:%d/metrics", self.host, self.port)
        return self.port

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
