"""A TCP proxy on loopback in front of the S3 server, for the mirror's network faults:

- `cut_after=N`: once N bytes have gone from the server to the client (all connections
  together), the connection carrying byte N is closed mid-response, once;
- `silent=True`: accepts every connection and never answers (nor forwards);
- `rate_bps=R`: server-to-client bytes flow at about R bytes/s (all connections together), and
  `stall=(N, S)`: once N bytes have gone down, nothing more goes for S seconds (a congested link).
"""

from __future__ import annotations

import socket
import threading
import time


class Proxy:
    def __init__(self, upstream_port: int, *, cut_after: int | None = None, silent: bool = False,
                 rate_bps: float | None = None, stall: tuple[int, float] | None = None) -> None:
        self.upstream_port, self.cut_after, self.silent = upstream_port, cut_after, silent
        self.rate_bps, self.stall, self.stalled = rate_bps, stall, False
        self._pace = threading.Lock()  # one down-going chunk at a time when paced
        self.down_bytes, self.cuts, self.accepted = 0, 0, 0
        self._lock = threading.Lock()
        self._socks: list[socket.socket] = []
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                self.accepted += 1
                self._socks.append(client)
            if self.silent:
                threading.Thread(target=self._drain, args=(client,), daemon=True).start()
                continue
            upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            self._socks.append(upstream)
            threading.Thread(target=self._pipe, args=(client, upstream, False), daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, client, True), daemon=True).start()

    def _drain(self, sock: socket.socket) -> None:
        try:
            while sock.recv(65536):
                pass
        except OSError:
            pass

    def _pipe(self, src: socket.socket, dst: socket.socket, down: bool) -> None:
        try:
            while data := src.recv(65536):
                if down:
                    with self._lock:
                        before = self.down_bytes
                        self.down_bytes += len(data)
                        cut = (self.cut_after is not None and self.cuts == 0
                               and before < self.cut_after <= self.down_bytes)
                        if cut:
                            self.cuts += 1
                    if cut:
                        dst.sendall(data[: self.cut_after - before])
                        break
                    if self.rate_bps or self.stall:
                        self._paced(data, dst)
                        continue
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def _paced(self, data: bytes, dst: socket.socket) -> None:
        with self._pace:
            if self.stall is not None and not self.stalled and self.down_bytes >= self.stall[0]:
                self.stalled = True
                time.sleep(self.stall[1])
            if self.rate_bps:
                time.sleep(len(data) / self.rate_bps)
        dst.sendall(data)

    def close(self) -> None:
        self._listener.close()
        with self._lock:
            for s in self._socks:
                try:
                    s.close()
                except OSError:
                    pass


class Down:
    """A loopback port where a server was: bound (so no one else takes it) but not listening,
    so every connection is refused, as when the S3 server is down."""

    def __init__(self) -> None:
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.bind(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        self._sock.close()
