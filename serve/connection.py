"""hypercorn's TCP connection, with its read timeout kept as one deadline per connection.

The rule is hypercorn's: a connection that sends no byte for `read_timeout` seconds is closed,
whatever it is doing (between requests, mid-request, or not reading a response). hypercorn
enforces it by wrapping every read in `asyncio.wait_for`, which makes a task and a timer per
read; on this machine that was about a fifth of a small request's CPU (bench/bench_serve.py,
serve against the ceiling). Here each read only moves a timestamp, and one timer per connection
re-arms itself for the time left, so a timeout costs one callback per `read_timeout` seconds.

`install()` makes hypercorn's asyncio worker build its connections from this class. It is
called before serving, and checks that hypercorn still has the method it replaces.
"""

from __future__ import annotations

import asyncio
from ssl import SSLError

import hypercorn.asyncio.run
from hypercorn.asyncio.tcp_server import MAX_RECV, TCPServer
from hypercorn.events import Closed, RawData


class DeadlineTCPServer(TCPServer):
    """A hypercorn connection whose read timeout is a deadline moved by each read."""

    async def _read_data(self) -> None:
        timeout = self.config.read_timeout
        last_read = self.loop.time()
        timer: asyncio.TimerHandle | None = None

        def check() -> None:
            nonlocal timer
            quiet = self.loop.time() - last_read
            if quiet >= timeout:
                # The pending read sees end of file, and the connection closes as hypercorn's
                # own timeout closes it: through Closed.
                self.writer.transport.abort()
            else:
                timer = self.loop.call_later(timeout - quiet, check)

        if timeout is not None:
            timer = self.loop.call_later(timeout, check)
        try:
            while not self.reader.at_eof():
                try:
                    data = await self.reader.read(MAX_RECV)
                except (ConnectionError, OSError, SSLError):
                    break
                last_read = self.loop.time()
                await self.protocol.handle(RawData(data))
        finally:
            if timer is not None:
                timer.cancel()
        await self.protocol.handle(Closed())


def install() -> None:
    """Serve every new hypercorn connection with DeadlineTCPServer."""
    if not callable(getattr(TCPServer, "_read_data", None)):
        raise RuntimeError("hypercorn's TCPServer has no _read_data: serve/connection.py is stale")
    hypercorn.asyncio.run.TCPServer = DeadlineTCPServer  # type: ignore[misc]
