"""A regional balancer's /gtm/capacity endpoint on loopback, with a switchable behaviour:
what GTM's probes see of a region (ok, slow, forged, draining, refusing work)."""

from __future__ import annotations

import asyncio
import time

from regional_lb.capacity_report import SIGNATURE_HEADER, CapacityReport, region_secret, sign

SECRET = "s3cret"


class FakeBalancer:
    """A regional balancer's /gtm/capacity endpoint, with a switchable behaviour."""

    def __init__(self, region: str) -> None:
        self.region = region
        self.mode = "ok"
        self.utilisation = 0.3
        self.seq = 0
        self.server: asyncio.Server | None = None
        self.port = 0

    async def start(self, port: int = 0) -> None:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", port)
        self.port = self.server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()
            self.server = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.readuntil(b"\r\n\r\n")
            if self.mode == "slow":
                await asyncio.sleep(1.0)
            self.seq += 1
            report = CapacityReport(
                region=self.region,
                seq=self.seq,
                ts=time.time(),
                instances_healthy=2,
                instances_total=2,
                capacity=100.0,
                outstanding=100.0 * self.utilisation,
                utilisation=self.utilisation,
                draining=self.mode == "draining",
                can_take_work=self.mode not in ("refuse", "draining"),
            )
            body = report.model_dump_json().encode()
            key = region_secret(SECRET.encode(), self.region)
            signature = sign(body, b"forged" if self.mode == "forged" else key)
            status = "200 OK" if report.can_take_work else "503 Service Unavailable"
            writer.write(
                f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n{SIGNATURE_HEADER}: {signature}\r\n"
                "Connection: close\r\n\r\n".encode()
                + body
            )
            await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()
