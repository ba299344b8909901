"""The network allow-list of a sandbox: selective access out of a namespace with no network.

A sandbox has its own network namespace, so it has nothing but its own loopback. For each
allowed endpoint ``IP:PORT`` the host side (``NetBridge``, one per sandbox) listens on a Unix
socket ``PORT.sock`` in a folder of that sandbox, which the backend mounts into the sandbox
read-only; each connection made on that socket is relayed to the endpoint, and to nothing
else. Inside, the executor listens on ``127.0.0.1:PORT`` of the sandbox's loopback and relays
each connection to that socket (``sandbox_executor._forward_allowed``). Code in the sandbox
therefore reaches an allowed endpoint at ``127.0.0.1:PORT``, whatever its address on the
host, and nothing else: the only way out is a socket whose other end the host holds.

This is the bridge that Anthropic's sandbox-runtime and Codex's Linux sandbox put between
``bwrap --unshare-net`` and their proxies (with socat or their own code), here written with
asyncio so that it needs no other package, and pointed at fixed endpoints instead of a proxy.
A tool that gives the namespace a network device (slirp4netns, pasta) would need an extra
package and a packet filter inside for the allow-list.

Simplifications: addresses are IP literals (IPv6 in brackets); host names are not resolved.
Inside, every endpoint is at ``127.0.0.1:PORT``, so two endpoints may not share a port. A
connection to an endpoint that refuses is accepted inside and then closed (the refusal happens
on the host, after the sandbox's side was accepted). Only TCP.
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from rollstream.agent.sandbox_executor import relay

CONNECT_TIMEOUT_S = 10.0  # to an allowed endpoint, from the host


@dataclass(slots=True, kw_only=True, frozen=True)
class Endpoint:
    """One allowed ``IP:PORT``."""

    host: str  # an IP address, as ``ipaddress`` writes it
    port: int

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def parse_allow_net(entries: Sequence[str], *, field: str = "SandboxPool.allow_net"
                    ) -> tuple[Endpoint, ...]:
    """``IP:PORT`` strings (``[IPv6]:PORT``) to endpoints; a clear error naming the entry."""
    if isinstance(entries, str) or not isinstance(entries, Sequence):
        raise TypeError(f"{field} must be a list of 'IP:PORT' strings, got "
                        f"{type(entries).__name__}")
    endpoints: dict[int, Endpoint] = {}
    for i, entry in enumerate(entries):
        where = f"{field}[{i}]"
        if not isinstance(entry, str):
            raise TypeError(f"{where} must be an 'IP:PORT' string, got {type(entry).__name__}")
        host, colon, port = entry.rpartition(":")
        bracketed = host.startswith("[") and host.endswith("]")
        if not colon or not host or not port or (":" in host and not bracketed):
            raise ValueError(f"{where} {entry!r} has no port: expected 'IP:PORT', e.g. "
                             "'127.0.0.1:8080' or '[::1]:8080'")
        try:
            address = ipaddress.ip_address(host[1:-1] if bracketed else host)
        except ValueError:
            raise ValueError(f"{where} {entry!r}: {host!r} is not an IP address (host names "
                             "are not resolved; give 'IP:PORT')") from None
        if bracketed != (address.version == 6):
            raise ValueError(f"{where} {entry!r}: only IPv6 addresses go in brackets")
        if not port.isdigit() or not 1 <= int(port) <= 65535:
            raise ValueError(f"{where} {entry!r}: port {port!r} is not in 1..65535")
        endpoint = Endpoint(host=str(address), port=int(port))
        if endpoint.port in endpoints:
            raise ValueError(f"{where} {entry!r}: port {endpoint.port} is already allowed for "
                             f"{endpoints[endpoint.port]} (inside the sandbox every endpoint "
                             "is 127.0.0.1:PORT, so ports must differ)")
        endpoints[endpoint.port] = endpoint
    return tuple(endpoints.values())


class NetBridge:
    """The host side of one sandbox's allow-list: a Unix socket per endpoint in ``folder``.

    One owner: the sandbox starts it before its process and closes it after; ``close`` ends
    every relayed connection and removes the folder."""

    def __init__(self, endpoints: tuple[Endpoint, ...], folder: Path) -> None:
        self.endpoints, self.folder = endpoints, folder
        self._servers: list[asyncio.Server] = []
        self._connections: set[asyncio.Task] = set()

    def sockets(self) -> list[tuple[int, Path]]:
        return [(e.port, self.folder / f"{e.port}.sock") for e in self.endpoints]

    async def start(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)  # a previous sandbox's in this slot
        self.folder.mkdir(mode=0o755)
        for endpoint, (_, path) in zip(self.endpoints, self.sockets(), strict=True):
            self._servers.append(await asyncio.start_unix_server(
                functools.partial(self._serve, endpoint), path=path))
            # the sandbox's own uid connects; on the host the pool's folder (0700) hides it
            os.chmod(path, 0o666)

    async def _serve(self, endpoint: Endpoint, reader: asyncio.StreamReader,
                     writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._connections.add(task)
        try:
            try:
                async with asyncio.timeout(CONNECT_TIMEOUT_S):
                    up_reader, up_writer = await asyncio.open_connection(endpoint.host,
                                                                         endpoint.port)
            except (OSError, TimeoutError):  # refused or unreachable: the sandbox sees a close
                writer.close()
                return
            await relay(reader, writer, up_reader, up_writer)
        finally:
            self._connections.discard(task)

    async def close(self) -> None:
        for server in self._servers:
            server.close()
        for task in list(self._connections):
            task.cancel()
        await asyncio.gather(*self._connections, return_exceptions=True)
        for server in self._servers:
            await server.wait_closed()
        self._servers.clear()
        shutil.rmtree(self.folder, ignore_errors=True)
