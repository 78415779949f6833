"""hypercorn's TCP connection, with its two timeouts kept as deadlines instead of tasks.

The rules are hypercorn's:
- **read timeout**: a connection that sends no byte for `read_timeout` seconds is closed,
  whatever it is doing (between requests, mid-request, or not reading a response);
- **idle timeout**: a connection with no request in progress for `keep_alive_timeout` seconds
  is closed, and so is every idle connection once the worker is shutting down.

hypercorn enforces the first by wrapping every read in `asyncio.wait_for` (a task and a timer
per read), and the second by cancelling and starting an idle task, which itself runs a
`wait_for`, twice per request. On this machine that was about a sixth of a small request's CPU
(bench/bench_serve.py, serve against the ceiling, and py-spy). Here a read, or a change between
busy and idle, only moves a timestamp; one timer per rule re-arms itself for the time left, so
a timeout costs one callback per period. One task per connection, not per request, waits for
shutdown.

Closing is bounded too. asyncio gives a TLS goodbye (close_notify both ways) 30 s, so a peer that
never answers held a closed connection's socket that long, and held a shutting-down worker that
long past its graceful timeout. Here a connection that has begun to close is hung up
TLS_GOODBYE_SECONDS later.

`install()` makes hypercorn's asyncio worker build its connections from this class. It is
called before serving, and checks that hypercorn still has the methods it replaces.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from ssl import SSLError
from typing import Any

import hypercorn.asyncio.run
from hypercorn.asyncio.tcp_server import MAX_RECV, TCPServer
from hypercorn.events import Closed, Event, RawData, Updated

# Seconds a closing connection gets to flush its last bytes and exchange TLS close_notify.
# asyncio waits 30 s for a peer that never answers. An idle connection closed that way held its
# socket that long, and a worker shutting down waited that long past its graceful timeout for a
# client that had stopped reading.
TLS_GOODBYE_SECONDS = 2.0


class DeadlineTCPServer(TCPServer):
    """A hypercorn connection whose read and idle timeouts are deadlines."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.idle_since: float | None = None  # loop time the connection last became idle
        self.idle_timer: asyncio.TimerHandle | None = None
        self.goodbye_timer: asyncio.TimerHandle | None = None
        self.socket = self.writer.get_extra_info("socket")  # kept: a closed transport forgets it

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

    async def protocol_send(self, event: Event) -> None:
        if not isinstance(event, Updated):
            await super().protocol_send(event)
        elif event.idle and self.context.terminated.is_set():
            # Shutting down: an idle connection closes now, as hypercorn's idle task does.
            self._task_group.spawn(self._initiate_server_close)
        else:
            self._set_idle(event.idle)

    async def _idle_timeout(self) -> None:
        """Started once by run(), as the connection opens idle; cancelled when it closes."""
        self._set_idle(True)
        await self.context.terminated.wait()
        if self.idle_since is not None:
            await asyncio.shield(self._initiate_server_close())

    def _set_idle(self, idle: bool) -> None:
        self.idle_since = self.loop.time() if idle else None
        if idle and self.idle_timer is None:
            self.idle_timer = self.loop.call_later(self.config.keep_alive_timeout, self._check_idle)

    def _check_idle(self) -> None:
        self.idle_timer = None
        if self.idle_since is None:
            return  # busy; the next change to idle arms the timer again
        quiet = self.loop.time() - self.idle_since
        if quiet < self.config.keep_alive_timeout:
            self.idle_timer = self.loop.call_later(
                self.config.keep_alive_timeout - quiet, self._check_idle
            )
        else:
            self._task_group.spawn(self._initiate_server_close)

    async def _initiate_server_close(self) -> None:
        self._bound_goodbye()
        await super()._initiate_server_close()

    async def _close(self) -> None:
        if self.idle_timer is not None:
            self.idle_timer.cancel()
            self.idle_timer = None
        self._bound_goodbye()
        # SSLError: the client sent data after our TLS close_notify (late HTTP/2 WINDOW_UPDATEs
        # do), so the TLS shutdown failed. The connection is gone either way. hypercorn lets the
        # error out, and at shutdown it ended the worker with a traceback and exit 1.
        with contextlib.suppress(SSLError):
            await super()._close()

    def _bound_goodbye(self) -> None:
        """Once a close begins, end the connection TLS_GOODBYE_SECONDS later if it is open."""
        if self.goodbye_timer is None:
            self.goodbye_timer = self.loop.call_later(TLS_GOODBYE_SECONDS, self._hang_up)

    def _hang_up(self) -> None:
        # Not transport.abort(): asyncio's TLS transport forgets its protocol when closed twice
        # (hypercorn closes it more than once), and abort() then does nothing. Shutting the
        # socket down ends both directions, and the transport reports the connection lost. On
        # a socket the transport has already closed this raises, and there is nothing to do.
        with contextlib.suppress(OSError):
            self.socket.shutdown(socket.SHUT_RDWR)


def install() -> None:
    """Serve every new hypercorn connection with DeadlineTCPServer."""
    for method in (
        "_read_data",
        "protocol_send",
        "_idle_timeout",
        "_close",
        "_initiate_server_close",
    ):
        if not callable(getattr(TCPServer, method, None)):
            stale = f"hypercorn's TCPServer has no {method}: serve/connection.py is stale"
            raise RuntimeError(stale)
    hypercorn.asyncio.run.TCPServer = DeadlineTCPServer  # type: ignore[misc]
