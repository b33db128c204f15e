"""pdkv's TCP data plane in Python, for the ``mori.io`` stub.

What is here mirrors pdkv's Rust, so that the stub and pdkv talk to each other unchanged:

- the data-plane descriptor ``{"pdkv": 1, "transport": "tcp", "addr": "host:port"}``, a
  MessagePack map written and read by hand (core/src/wire/data_plane.rs);
- the read protocol (backend-rdma/src/tcp/mod.rs): a request is ``0xA1``, u32 n, n x (u64 addr,
  u64 len), or ``0xA2``, flags, u64 incarnation, u64 transfer key, u32 n, ranges; the answer is
  ``0x00`` and the bytes, or a status byte, u32 length and a UTF-8 message. All big-endian;
- a threaded read server over registered memory (tcp/server.rs), and a client keeping a pool of
  connections per endpoint (tcp/client.rs).

``STATS`` counts what moved; ``MORI_STUB_FLIP`` flips a byte for negative controls.
"""

from __future__ import annotations

import ctypes
import os
import socket
import struct
import sys
import threading
import time
from dataclasses import dataclass

# ---------------------------------------------------------------- protocol constants (tcp/mod.rs)

MAGIC = 0xA1
MAGIC_TAGGED = 0xA2
FLAG_INCARNATION = 1
FLAG_TRANSFER = 2
MAX_RANGES = 65_536
MAX_TOTAL_BYTES = 1 << 30
MAX_MESSAGE_BYTES = 1024
MAX_CONNECTIONS = 256
RANGE_BYTES = 16
# An incarnation lies in 1..=2^53-1 (core/src/ids.rs).
INCARNATION_MAX = (1 << 53) - 1

STATUS_OK = 0
STATUS_UNREGISTERED = 1
STATUS_REVOKED = 2
STATUS_OUT_OF_RANGE = 3
STATUS_MALFORMED = 4
STATUS_LIMIT_EXCEEDED = 5
STATUS_OTHER_INCARNATION = 6
STATUS_INTERNAL = 255

STATUS_NAMES = {
    STATUS_UNREGISTERED: "unregistered",
    STATUS_REVOKED: "revoked",
    STATUS_OUT_OF_RANGE: "out of range",
    STATUS_MALFORMED: "malformed",
    STATUS_LIMIT_EXCEEDED: "limit exceeded",
    STATUS_OTHER_INCARNATION: "other incarnation",
    STATUS_INTERNAL: "internal",
}

# After these the server closes the connection; after any other refusal both sides are in step.
CLOSING_STATUSES = (STATUS_MALFORMED, STATUS_LIMIT_EXCEEDED)

SERVER_IO_TIMEOUT_S = 30.0
DRAIN_TIME_S = 0.1
DRAIN_BYTES = 1 << 20
CONNECT_TIMEOUT_S = 5.0
CLIENT_IO_TIMEOUT_S = 30.0

# How the client cuts a read into requests; the protocol's limits, module attributes so a test
# can lower them to see the chunking work.
CLIENT_MAX_RANGES = MAX_RANGES
CLIENT_MAX_TOTAL_BYTES = MAX_TOTAL_BYTES


def status_name(status: int) -> str:
    return STATUS_NAMES.get(status, f"status {status}")


# ---------------------------------------------------------------- counters and the flip knob

STATS: dict[str, int] = {
    # Client (batch_read): bytes and ranges landed, Failed statuses returned, requests sent.
    "bytes_read": 0,
    "ranges_read": 0,
    "failures": 0,
    "requests_sent": 0,
    # Server: bytes and ranges sent, requests answered with data, requests refused.
    "bytes_served": 0,
    "ranges_served": 0,
    "requests_served": 0,
    "refusals_sent": 0,
}
_STATS_LOCK = threading.Lock()


def count(**deltas: int) -> None:
    with _STATS_LOCK:
        for key, delta in deltas.items():
            STATS[key] += delta


def claim(ranges_key: str, bytes_key: str, ranges: int, nbytes: int) -> int:
    """Counts `ranges` ranges of `nbytes` bytes; returns the 1-based number of the first."""
    with _STATS_LOCK:
        first = STATS[ranges_key] + 1
        STATS[ranges_key] += ranges
        STATS[bytes_key] += nbytes
        return first


def reset_stats() -> None:
    """Zeroes every counter (and so restarts the flip knob's numbering). For tests."""
    with _STATS_LOCK:
        for key in STATS:
            STATS[key] = 0


FLIP_ENV = "MORI_STUB_FLIP"


def flip_target(role: str) -> int | None:
    """The 1-based number of the range whose first byte `role` ("read" or "serve") flips, from
    ``MORI_STUB_FLIP``: ``<n>`` for both roles, ``read:<n>`` or ``serve:<n>`` for one. Read at
    every use, so a test can set and clear it."""
    raw = os.environ.get(FLIP_ENV, "").strip()
    if not raw:
        return None
    which, sep, number = raw.rpartition(":")
    if (sep and which not in ("read", "serve")) or not number.isdigit() or int(number) < 1:
        raise ValueError(f"{FLIP_ENV}={raw!r}: expected <n>, read:<n> or serve:<n> with n >= 1")
    if sep and which != role:
        return None
    return int(number)


def log_flip(what: str, number: int, addr: int, length: int, old: int) -> None:
    print(
        f"mori stub: {FLIP_ENV}={os.environ.get(FLIP_ENV)}: flipped byte 0 of {what} range #{number} "
        f"(address {addr:#x}, {length} bytes): {old:#04x} -> {old ^ 0xFF:#04x}",
        file=sys.stderr,
        flush=True,
    )


# ---------------------------------------------------------------- the data-plane descriptor

DESCRIPTOR_VERSION = 1


class DescriptorError(ValueError):
    """Bytes that are not a pdkv TCP data-plane descriptor; the message says why."""


def _pack_str(text: str) -> bytes:
    raw = text.encode("utf-8")
    n = len(raw)
    if n < 32:
        return bytes([0xA0 | n]) + raw
    if n < 256:
        return bytes([0xD9, n]) + raw
    if n < 65536:
        return b"\xda" + n.to_bytes(2, "big") + raw
    raise DescriptorError(f"a string of {n} bytes does not belong in a descriptor")


def encode_descriptor(transport: str, addr: str) -> bytes:
    """pdkv's descriptor, byte for byte what ``DataPlane::encode`` writes (rmp's named form: a
    fixmap of three, keys in this order, the version a positive fixint, strings in their
    shortest form)."""
    return (
        b"\x83"
        + _pack_str("pdkv")
        + bytes([DESCRIPTOR_VERSION])
        + _pack_str("transport")
        + _pack_str(transport)
        + _pack_str("addr")
        + _pack_str(addr)
    )


def _kind(first: int) -> str:
    """The MessagePack type a value starting with byte `first` has, for messages."""
    if first <= 0x7F or first >= 0xE0:
        return "int (fixint)"
    if 0x80 <= first <= 0x8F:
        return "map (fixmap)"
    if 0x90 <= first <= 0x9F:
        return "array (fixarray)"
    if 0xA0 <= first <= 0xBF:
        return "str (fixstr)"
    return {
        0xC0: "nil", 0xC1: "never-used byte 0xc1", 0xC2: "bool", 0xC3: "bool",
        0xC4: "bin", 0xC5: "bin", 0xC6: "bin", 0xC7: "ext", 0xC8: "ext", 0xC9: "ext",
        0xCA: "float", 0xCB: "float", 0xCC: "int (uint8)", 0xCD: "int (uint16)",
        0xCE: "int (uint32)", 0xCF: "int (uint64)", 0xD0: "int (int8)", 0xD1: "int (int16)",
        0xD2: "int (int32)", 0xD3: "int (int64)", 0xD9: "str (str8)", 0xDA: "str (str16)",
        0xDB: "str (str32)", 0xDC: "array (array16)", 0xDD: "array (array32)",
        0xDE: "map (map16)", 0xDF: "map (map32)",
    }.get(first, "ext")


class _Reader:
    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0

    def byte(self, what: str) -> int:
        if self.pos >= len(self.data):
            raise DescriptorError(f"truncated: {what} missing at byte {self.pos}")
        b = self.data[self.pos]
        self.pos += 1
        return b

    def take(self, n: int, what: str) -> bytes:
        if self.pos + n > len(self.data):
            raise DescriptorError(
                f"truncated: {what} needs {n} bytes at byte {self.pos}, {len(self.data) - self.pos} left"
            )
        out = self.data[self.pos:self.pos + n]
        self.pos += n
        return bytes(out)

    def str(self, what: str) -> str:
        first = self.byte(what)
        if 0xA0 <= first <= 0xBF:
            n = first & 0x1F
        elif first == 0xD9:
            n = self.byte(what)
        elif first == 0xDA:
            n = int.from_bytes(self.take(2, what), "big")
        else:
            raise DescriptorError(f"{what} is a MessagePack {_kind(first)}, expected a str")
        raw = self.take(n, what)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise DescriptorError(f"{what} is not UTF-8: {e}") from None


@dataclass(frozen=True)
class Descriptor:
    transport: str
    host: str
    port: int

    @property
    def addr(self) -> str:
        return f"{self.host}:{self.port}"


def parse_endpoint(addr: str) -> tuple[str, int]:
    """``host:port`` as pdkv reads it (split at the last colon), strictly: a non-empty host and
    a decimal port in 1..65535."""
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isascii() or not port.isdigit() or not 0 < int(port) < 65536:
        raise DescriptorError(f"address `{addr}` is not host:port (a host and a port in 1..65535)")
    return host, int(port)


def decode_descriptor(data) -> Descriptor:
    """Reads a pdkv TCP descriptor, strictly: one whole fixmap of exactly the keys ``pdkv``
    (positive fixint 1), ``transport`` (``"tcp"``) and ``addr`` (``host:port``), in any order,
    each once, strings as fixstr, str8 or str16, nothing after it. Anything else raises
    ``DescriptorError`` (a ``ValueError``) saying what is wrong."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise DescriptorError(f"a descriptor is bytes, not {type(data).__name__}")
    data = bytes(data)
    n = len(data)
    if n == 0:
        raise DescriptorError("not a pdkv descriptor: empty")
    first = data[0]
    if 0x90 <= first <= 0x9F or first in (0xDC, 0xDD):
        head = 1 if first <= 0x9F else (3 if first == 0xDC else 5)
        if n > head and (0xA0 <= data[head] <= 0xBF or data[head] in (0xD9, 0xDA, 0xDB)):
            raise DescriptorError(
                f"not a pdkv descriptor: looks like a MoRI EngineDesc (a MessagePack array starting "
                f"with a str), {n} bytes; this stub speaks pdkv's TCP data plane, not MoRI's"
            )
    if not 0x80 <= first <= 0x8F:
        raise DescriptorError(f"not a pdkv descriptor: a MessagePack {_kind(first)}, {n} bytes")
    reader = _Reader(data)
    reader.pos = 1
    fields: dict[str, object] = {}
    for _ in range(first & 0x0F):
        key = reader.str("a map key")
        if key in fields:
            raise DescriptorError(f"duplicate key `{key}`")
        if key == "pdkv":
            value = reader.byte("the value of `pdkv`")
            if value > 0x7F:
                raise DescriptorError(
                    f"`pdkv` is a MessagePack {_kind(value)}, expected a positive fixint"
                )
            fields[key] = value
        elif key in ("transport", "addr"):
            fields[key] = reader.str(f"the value of `{key}`")
        else:
            raise DescriptorError(f"unknown key `{key}` (a pdkv descriptor has pdkv, transport, addr)")
    if reader.pos != n:
        raise DescriptorError(f"{n - reader.pos} trailing bytes after the map")
    if "pdkv" not in fields:
        raise DescriptorError("not a pdkv descriptor: a MessagePack map without a `pdkv` key")
    if fields["pdkv"] != DESCRIPTOR_VERSION:
        raise DescriptorError(
            f"pdkv descriptor version {fields['pdkv']}; this stub reads version {DESCRIPTOR_VERSION}"
        )
    for key in ("transport", "addr"):
        if key not in fields:
            raise DescriptorError(f"pdkv descriptor without `{key}`")
    transport = str(fields["transport"])
    if transport != "tcp":
        raise DescriptorError(
            f"pdkv descriptor with transport `{transport}`: this stub speaks pdkv's tcp data plane only"
        )
    host, port = parse_endpoint(str(fields["addr"]))
    return Descriptor(transport, host, port)


# ---------------------------------------------------------------- requests

def encode_request(ranges, tag: tuple[int, int, int] | None = None) -> bytes:
    """A request for `ranges` [(addr, len)]: ``0xA1`` untagged, or ``0xA2`` with `tag` =
    (flags, incarnation, transfer key)."""
    if tag is None:
        head = bytes([MAGIC])
    else:
        flags, incarnation, key = tag
        head = struct.pack(">BBQQ", MAGIC_TAGGED, flags, incarnation, key)
    body = b"".join(struct.pack(">QQ", addr, length) for addr, length in ranges)
    return head + struct.pack(">I", len(ranges)) + body


def plan_requests(pieces: list[tuple[int, int, int]]) -> list[list[tuple[int, int, int]]]:
    """Groups (remote addr, len, local addr) pieces, each at most ``CLIENT_MAX_TOTAL_BYTES``,
    into requests within ``CLIENT_MAX_RANGES`` and ``CLIENT_MAX_TOTAL_BYTES``."""
    requests: list[list[tuple[int, int, int]]] = []
    current: list[tuple[int, int, int]] = []
    total = 0
    for piece in pieces:
        if current and (len(current) >= CLIENT_MAX_RANGES or total + piece[1] > CLIENT_MAX_TOTAL_BYTES):
            requests.append(current)
            current, total = [], 0
        current.append(piece)
        total += piece[1]
    if current:
        requests.append(current)
    return requests


def message_bytes(message: str) -> bytes:
    """A message as the wire carries it: u32 length and at most ``MAX_MESSAGE_BYTES`` of UTF-8,
    cut at a character boundary."""
    raw = message.encode("utf-8")[:MAX_MESSAGE_BYTES].decode("utf-8", errors="ignore").encode("utf-8")
    return struct.pack(">I", len(raw)) + raw


# ---------------------------------------------------------------- registered memory

class Regions:
    """Memory a server may serve: (base, size) regions, each with the object keeping it alive."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self._regions: dict[int, tuple[int, int, object]] = {}
        self._next = 1

    def register(self, base: int, size: int, keep: object) -> int:
        with self.lock:
            rid = self._next
            self._next += 1
            self._regions[rid] = (base, size, keep)
            return rid

    def deregister(self, base: int, size: int) -> bool:
        """Forgets the region; once this returns, no server sends its bytes any more."""
        with self.lock:
            for rid, (b, s, _) in list(self._regions.items()):
                if b == base and s == size:
                    del self._regions[rid]
                    return True
            return False

    def check(self, addr: int, length: int) -> tuple[int, str] | None:
        """None when [addr, addr+length) lies inside one region, else (status, message).
        Call with ``lock`` held if the answer is to stay true."""
        end = addr + length
        holder = None
        with self.lock:
            for base, size, _ in self._regions.values():
                if base <= addr < base + size or (length == 0 and addr == base + size):
                    if end <= base + size:
                        return None
                    holder = (base, size)
        if holder is None:
            return STATUS_UNREGISTERED, f"no registered region holds address {addr:#x}"
        base, size = holder
        return (
            STATUS_OUT_OF_RANGE,
            f"range [{addr:#x}, {end:#x}) runs past the end of region [{base:#x}, {base + size:#x})",
        )

    def contains(self, addr: int, length: int) -> bool:
        return self.check(addr, length) is None

    def __len__(self) -> int:
        with self.lock:
            return len(self._regions)


# ---------------------------------------------------------------- the server

def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    """Exactly `n` bytes, or None when the peer closed or the socket failed."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        try:
            k = sock.recv_into(view[got:])
        except OSError:
            return None
        if k == 0:
            return None
        got += k
    return bytes(buf)


@dataclass
class _Refusal:
    status: int
    message: str


@dataclass
class _Request:
    flags: int
    incarnation: int
    transfer: int
    ranges: list[tuple[int, int]]


def _read_request(sock: socket.socket) -> _Request | _Refusal | None:
    """One request, its magic and limits checked as the bytes arrive (tcp/server.rs
    `read_request`); None when the client went away."""
    try:
        # Between requests a connection may idle as long as the client keeps it.
        sock.settimeout(None)
    except OSError:
        return None
    first = _recv_exact(sock, 1)
    if first is None:
        return None
    magic = first[0]
    if magic not in (MAGIC, MAGIC_TAGGED):
        return _Refusal(
            STATUS_MALFORMED, f"bad magic byte {magic:#04x}, expected {MAGIC:#04x} or {MAGIC_TAGGED:#04x}"
        )
    try:
        sock.settimeout(SERVER_IO_TIMEOUT_S)
    except OSError:
        return None
    flags = incarnation = transfer = 0
    if magic == MAGIC_TAGGED:
        head = _recv_exact(sock, 17)
        if head is None:
            return None
        flags = head[0]
        if flags & ~(FLAG_INCARNATION | FLAG_TRANSFER):
            return _Refusal(STATUS_MALFORMED, f"unknown flags {flags:#04x} in a tagged read")
        incarnation, transfer = struct.unpack(">QQ", head[1:])
        if flags & FLAG_INCARNATION and not 1 <= incarnation <= INCARNATION_MAX:
            return _Refusal(STATUS_MALFORMED, f"incarnation {incarnation} is outside 1..={INCARNATION_MAX}")
    raw = _recv_exact(sock, 4)
    if raw is None:
        return None
    (n,) = struct.unpack(">I", raw)
    if n > MAX_RANGES:
        return _Refusal(STATUS_LIMIT_EXCEEDED, f"{n} ranges in one request; the limit is {MAX_RANGES}")
    body = _recv_exact(sock, n * RANGE_BYTES) if n else b""
    if body is None:
        return None
    ranges = list(struct.iter_unpack(">QQ", body))
    total = sum(length for _, length in ranges)
    if total > MAX_TOTAL_BYTES:
        return _Refusal(STATUS_LIMIT_EXCEEDED, f"{total} bytes in one request; the limit is {MAX_TOTAL_BYTES}")
    return _Request(flags, incarnation, transfer, ranges)


def _send_error(sock: socket.socket, status: int, message: str) -> bool:
    count(refusals_sent=1)
    try:
        sock.sendall(bytes([status]) + message_bytes(message))
        return True
    except OSError:
        return False


def _drain_and_close(sock: socket.socket) -> None:
    """Closes a refused connection without losing the answer to a reset (tcp/server.rs)."""
    try:
        sock.shutdown(socket.SHUT_WR)
        sock.settimeout(DRAIN_TIME_S)
        drained = 0
        while drained < DRAIN_BYTES:
            chunk = sock.recv(8192)
            if not chunk:
                break
            drained += len(chunk)
    except OSError:
        pass


def serve_connection(sock: socket.socket, regions: Regions) -> None:
    """Answers one connection's requests until it closes or sends something to refuse."""
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    except OSError:
        pass
    while True:
        request = _read_request(sock)
        if request is None:
            return
        if isinstance(request, _Refusal):
            if _send_error(sock, request.status, request.message):
                _drain_and_close(sock)
            return
        if request.flags & FLAG_INCARNATION:
            # A MoRIIO engine's handshake names no incarnation, so a read naming one is not
            # meant for this server. The request was read in full: the connection stays open.
            message = (
                f"the read is meant for incarnation {request.incarnation}; this server is a "
                "MoRIIO engine's (mori stub) and has no incarnation"
            )
            if not _send_error(sock, STATUS_OTHER_INCARNATION, message):
                return
            continue
        # The transfer key (flag 2) is deliberately not checked: a MoRIIO engine grants nothing
        # per transfer (no pdkv grants exist on this side), so a tagged read is served like an
        # untagged one, from whatever the registered memory holds.
        refusal = None
        with regions.lock:
            for addr, length in request.ranges:
                refusal = regions.check(addr, length)
                if refusal is not None:
                    break
            if refusal is None:
                # Copied under the lock, so deregister() waits for reads in flight.
                pieces = [ctypes.string_at(addr, length) for addr, length in request.ranges]
        if refusal is not None:
            if not _send_error(sock, *refusal):
                return
            continue
        total = sum(len(p) for p in pieces)
        first = claim("ranges_served", "bytes_served", len(pieces), total)
        try:
            target = flip_target("serve")
        except ValueError as e:
            if not _send_error(sock, STATUS_INTERNAL, str(e)):
                return
            continue
        if target is not None and first <= target < first + len(pieces):
            i = target - first
            if pieces[i]:
                flipped = bytearray(pieces[i])
                log_flip("served", target, request.ranges[i][0], len(flipped), flipped[0])
                flipped[0] ^= 0xFF
                pieces[i] = bytes(flipped)
        try:
            sock.sendall(b"\x00")
            for piece in pieces:
                sock.sendall(piece)
        except OSError:
            return
        count(requests_served=1)


class ReadServer:
    """Serves reads of `regions` on (host, port) from its own threads: one accepting, one per
    connection, at most ``MAX_CONNECTIONS`` connections at once."""

    def __init__(self, host: str, port: int, regions: Regions) -> None:
        self._regions = regions
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, _, _, _, sockaddr = infos[0]
        listener = socket.socket(family, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            listener.bind(sockaddr)
            listener.listen(128)
        except OSError:
            listener.close()
            raise
        self._listener = listener
        self.address: tuple[str, int] = listener.getsockname()[:2]
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._open: dict[int, socket.socket] = {}
        self._next = 0
        self._thread = threading.Thread(
            target=self._accept_loop, name=f"mori-stub-data-{self.address[1]}", daemon=True
        )
        self._thread.start()

    @property
    def port(self) -> int:
        return self.address[1]

    def _accept_loop(self) -> None:
        self._listener.settimeout(0.2)
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except socket.timeout:
                continue
            except OSError:
                if self._stop.is_set():
                    return
                # Out of descriptors or a connection reset before accept: keep serving.
                time.sleep(0.01)
                continue
            with self._lock:
                if len(self._open) >= MAX_CONNECTIONS:
                    conn.close()
                    continue
                cid = self._next
                self._next += 1
                self._open[cid] = conn
            threading.Thread(
                target=self._serve, args=(conn, cid), name=f"mori-stub-data-conn-{cid}", daemon=True
            ).start()

    def _serve(self, conn: socket.socket, cid: int) -> None:
        try:
            serve_connection(conn, self._regions)
        except Exception as e:  # noqa: BLE001 - a bug must cost one connection, not the server
            print(f"mori stub: data-plane connection {cid} ended by {e!r}", file=sys.stderr, flush=True)
        finally:
            with self._lock:
                self._open.pop(cid, None)
            try:
                conn.close()
            except OSError:
                pass

    def connections(self) -> int:
        with self._lock:
            return len(self._open)

    def shutdown(self) -> None:
        """Stops accepting and closes every connection."""
        self._stop.set()
        self._thread.join(timeout=5)
        try:
            self._listener.close()
        except OSError:
            pass
        with self._lock:
            conns = list(self._open.values())
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


# ---------------------------------------------------------------- the client

class RemoteRefusal(Exception):
    """The server answered a status other than OK."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status_name(status)}: {message}")
        self.status = status
        self.message = message


class ProtocolError(Exception):
    """The server's answer broke the protocol; the connection is dropped."""


class DataPlaneIOError(Exception):
    """The connection failed (connect, send, receive, timeout, closed)."""


def _recv_into(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ConnectionError("the server closed the connection")
        got += k


def _recv(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    _recv_into(sock, memoryview(buf))
    return bytes(buf)


def exchange(sock: socket.socket, request: bytes, total: int) -> bytearray:
    """Sends one request and reads its answer: the `total` bytes, or raises ``RemoteRefusal``
    or ``ProtocolError``; a failed connection raises ``OSError``."""
    sock.sendall(request)
    status = _recv(sock, 1)[0]
    if status == STATUS_OK:
        buf = bytearray(total)
        _recv_into(sock, memoryview(buf))
        return buf
    (length,) = struct.unpack(">I", _recv(sock, 4))
    if length > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"error message of {length} bytes; the limit is {MAX_MESSAGE_BYTES}")
    raw = _recv(sock, length)
    try:
        message = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ProtocolError(f"error message is not UTF-8: {e}") from None
    raise RemoteRefusal(status, message)


class Client:
    """Reads from pdkv TCP data planes, keeping idle connections per endpoint for reuse; any
    number of threads may read at once (each takes a connection of its own)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle: dict[tuple[str, int], list[socket.socket]] = {}
        self._closed = False

    @staticmethod
    def _connect(endpoint: tuple[str, int]) -> socket.socket:
        sock = socket.create_connection(endpoint, timeout=CONNECT_TIMEOUT_S)
        sock.settimeout(CLIENT_IO_TIMEOUT_S)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock

    def _take(self, endpoint: tuple[str, int]) -> socket.socket:
        with self._lock:
            idle = self._idle.get(endpoint)
            if idle:
                return idle.pop()
        try:
            return self._connect(endpoint)
        except OSError as e:
            raise DataPlaneIOError(f"connect to {endpoint[0]}:{endpoint[1]}: {e}") from None

    def _give(self, endpoint: tuple[str, int], sock: socket.socket) -> None:
        with self._lock:
            if not self._closed:
                self._idle.setdefault(endpoint, []).append(sock)
                return
        sock.close()

    def idle_connections(self, endpoint: tuple[str, int]) -> int:
        with self._lock:
            return len(self._idle.get(endpoint, []))

    def read(self, endpoint: tuple[str, int], ranges: list[tuple[int, int]]) -> bytearray:
        """The bytes of `ranges` (one request, within the limits), back to back. An I/O error
        is retried once on a fresh connection (reads are idempotent); a refusal is not."""
        request = encode_request(ranges)
        total = sum(length for _, length in ranges)
        count(requests_sent=1)
        sock = self._take(endpoint)
        first_error: OSError | None = None
        for attempt in (1, 2):
            try:
                buf = exchange(sock, request, total)
            except OSError as e:
                sock.close()
                if attempt == 2:
                    raise DataPlaneIOError(
                        f"{endpoint[0]}:{endpoint[1]}: {first_error}; again on a fresh connection: {e}"
                    ) from None
                first_error = e
                try:
                    sock = self._connect(endpoint)
                except OSError as e2:
                    raise DataPlaneIOError(
                        f"{endpoint[0]}:{endpoint[1]}: {e}; reconnecting: {e2}"
                    ) from None
                continue
            except RemoteRefusal as r:
                # Only an access refusal leaves both sides in step.
                if r.status in CLOSING_STATUSES:
                    sock.close()
                else:
                    self._give(endpoint, sock)
                raise
            except ProtocolError:
                sock.close()
                raise
            self._give(endpoint, sock)
            return buf
        raise AssertionError("unreachable")

    def close(self) -> None:
        with self._lock:
            self._closed = True
            socks = [s for idle in self._idle.values() for s in idle]
            self._idle.clear()
        for s in socks:
            s.close()
