"""``mori.io`` for vLLM 0.34's MoRIIO connector on CPU, with pdkv's TCP read protocol as the data
plane (see ``mori._tcp``).

What MoRIIO uses, and what the stub makes of it:

- ``IOEngine(key, IOEngineConfig(host, port))``; ``create_backend`` keeps its arguments and does
  nothing (``BackendType``, ``RdmaBackendConfig``, ``XgmiBackendConfig``, ``PollCqMode`` exist for
  that call).
- ``get_engine_desc().pack()``: pdkv's descriptor ``{"pdkv": 1, "transport": "tcp", "addr":
  "host:port"}`` for this engine's data server; ``EngineDesc.unpack`` reads pdkv's descriptor
  (from a pdkv prefill rank or from this stub) and raises ``ValueError`` on anything else.
- ``register_torch_tensor(t)``: a contiguous CPU tensor's bytes become a region this engine's
  data server serves (the first call starts the server on (host, port)); returns a
  ``MemoryDesc`` whose ``pack()`` is pdkv's 16-byte layer descriptor u64be(base) ++ u64be(len).
- ``create_session(local, remote)``: reads go to the one remote engine registered (pdkv memory
  descriptors name no engine, so with none or several registered endpoints it raises).
- ``Session.batch_read(local_offsets, remote_offsets, sizes, uid)``: one untagged ``0xA1`` read
  of (remote.data + ro, size) per range (cut into several requests past the protocol's limits),
  landed at local.data + lo. Synchronous: the ``TransferStatus`` it returns is already final.
  A refusal is ``Failed()`` with ``ERR_NOT_FOUND`` (unregistered, revoked, out of range, other
  incarnation) or ``ERR_BAD_STATE``, and ``Message()`` "pdkv data plane refused: <status>:
  <server's text>"; a broken connection is ``ERR_RDMA_OP``. No message ever says "SQ full"
  (MoRIIO would re-post).
- WRITE mode (``batch_write``, ``write``) raises ``NotImplementedError``.
- ``IOEngine.wait_all`` exists only with ``MORI_STUB_WAIT_ALL=1`` (ROCm/mori's Python wrapper
  has none; MoRIIO looks for it with ``getattr``).

Counters: ``STATS``. Negative control: ``MORI_STUB_FLIP=<n>`` flips the first byte of the n-th
range ``batch_read`` lands and of the n-th range the server sends (``read:<n>`` or
``serve:<n>`` for one side only), logging each flip to stderr.
"""

from __future__ import annotations

import ctypes
import enum
import itertools
import operator
import os
import struct
import threading
import time

from . import _tcp
from ._tcp import STATS, reset_stats

__all__ = [
    "BackendType",
    "EngineDesc",
    "IOEngine",
    "IOEngineConfig",
    "IOEngineSession",
    "MemoryDesc",
    "PollCqMode",
    "RdmaBackendConfig",
    "STATS",
    "StatusCode",
    "TransferStatus",
    "XgmiBackendConfig",
    "reset_stats",
]


class _Enum(enum.IntEnum):
    def __str__(self) -> str:  # as pybind11 prints its enums: "StatusCode.SUCCESS"
        return f"{type(self).__name__}.{self.name}"


class BackendType(_Enum):
    XGMI = 1
    RDMA = 2


class PollCqMode(_Enum):
    POLLING = 0
    EVENT = 1


class StatusCode(_Enum):
    SUCCESS = 0
    INIT = 1
    IN_PROGRESS = 2
    ERR_INVALID_ARGS = 3
    ERR_NOT_FOUND = 4
    ERR_RDMA_OP = 5
    ERR_BAD_STATE = 6
    ERR_GPU_OP = 7


_PENDING = (StatusCode.INIT, StatusCode.IN_PROGRESS)


class _Config:
    """A backend configuration: kept, never used."""

    def __init__(self, *args, **kwargs) -> None:
        self.args = args
        self.kwargs = kwargs

    def __repr__(self) -> str:
        parts = [repr(a) for a in self.args] + [f"{k}={v!r}" for k, v in self.kwargs.items()]
        return f"{type(self).__name__}({', '.join(parts)})"


class RdmaBackendConfig(_Config):
    pass


class XgmiBackendConfig(_Config):
    pass


class IOEngineConfig:
    def __init__(self, host: str = "", port: int = 0, **kwargs) -> None:
        self.host = str(host)
        self.port = int(port)
        self.extra = kwargs

    def __repr__(self) -> str:
        return f"IOEngineConfig(host={self.host!r}, port={self.port})"


def _sanitize(message: str) -> str:
    # MoRIIO re-posts a read whose Failed() message says "SQ full"; no stub failure is that.
    return message.replace("SQ full", "SQ_full")


class TransferStatus:
    """A transfer's state. ``batch_read`` returns it final; ``Wait``/``WaitFor`` block for one
    that is not (``WaitFor`` returns whether it is final)."""

    def __init__(self, code: StatusCode = StatusCode.INIT, message: str = "") -> None:
        self._cond = threading.Condition()
        self._code = StatusCode(code)
        self._message = _sanitize(str(message))

    def Code(self) -> StatusCode:
        with self._cond:
            return self._code

    def Message(self) -> str:
        with self._cond:
            return self._message

    def Init(self) -> bool:
        return self.Code() == StatusCode.INIT

    def InProgress(self) -> bool:
        return self.Code() == StatusCode.IN_PROGRESS

    def Succeeded(self) -> bool:
        return self.Code() == StatusCode.SUCCESS

    def Failed(self) -> bool:
        return self.Code() not in (StatusCode.SUCCESS, *_PENDING)

    def SetCode(self, code: StatusCode) -> None:
        with self._cond:
            self._code = StatusCode(code)
            self._cond.notify_all()

    def SetMessage(self, message: str) -> None:
        with self._cond:
            self._message = _sanitize(str(message))

    def Update(self, code: StatusCode, message: str = "") -> None:
        with self._cond:
            self._code = StatusCode(code)
            self._message = _sanitize(str(message))
            self._cond.notify_all()

    def Wait(self) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._code not in _PENDING)

    def WaitFor(self, timeout_ms: int = -1) -> bool:
        timeout = None if timeout_ms is None or timeout_ms < 0 else timeout_ms / 1000
        with self._cond:
            return self._cond.wait_for(lambda: self._code not in _PENDING, timeout)

    def __repr__(self) -> str:
        return f"TransferStatus({self.Code()}, {self.Message()!r})"


class EngineDesc:
    """An engine's data plane: where its pdkv TCP read server listens. ``key`` is the engine's
    key for a local engine, ``pdkv-tcp://host:port`` for one read from bytes."""

    def __init__(self, key: str, host: str, port: int, transport: str = "tcp") -> None:
        self.key = key
        self.host = host
        self.port = int(port)
        self.transport = transport

    @property
    def addr(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def hostname(self) -> str:
        return self.host

    def pack(self) -> bytes:
        """pdkv's descriptor for this engine, byte for byte as pdkv writes it."""
        _tcp.parse_endpoint(self.addr)  # refuses an empty host or port 0 (nothing to dial)
        return _tcp.encode_descriptor(self.transport, self.addr)

    @staticmethod
    def unpack(data) -> "EngineDesc":
        """Reads pdkv's descriptor; raises ``ValueError`` naming what is wrong otherwise."""
        d = _tcp.decode_descriptor(data)
        return EngineDesc(f"pdkv-tcp://{d.addr}", d.host, d.port, d.transport)

    def __eq__(self, other) -> bool:
        return isinstance(other, EngineDesc) and (self.transport, self.host, self.port) == (
            other.transport, other.host, other.port)

    def __hash__(self) -> int:
        return hash((self.transport, self.host, self.port))

    def __repr__(self) -> str:
        return f"EngineDesc(key={self.key!r}, {self.transport}://{self.addr})"


class MemoryDesc:
    """A memory region: ``data`` (its address), ``size`` (bytes). Packed as pdkv's layer
    descriptor u64be(data) ++ u64be(size); the other fields are not carried (an unpacked
    descriptor has ``engine_key=""``, ``device_id=-1``, ``device_bus_id=""``, ``loc="cpu"``)."""

    PACKED_BYTES = 16

    def __init__(self, data: int = 0, size: int = 0, engine_key: str = "", device_id: int = -1,
                 device_bus_id: str = "", loc: str = "cpu", id: int = 0) -> None:
        self.data = int(data)
        self.size = int(size)
        self.engine_key = engine_key
        self.device_id = device_id
        self.device_bus_id = device_bus_id
        self.loc = loc
        self.id = id

    def pack(self) -> bytes:
        return struct.pack(">QQ", self.data, self.size)

    @staticmethod
    def unpack(data) -> "MemoryDesc":
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise ValueError(f"a memory descriptor is bytes, not {type(data).__name__}")
        data = bytes(data)
        if len(data) != MemoryDesc.PACKED_BYTES:
            raise ValueError(
                f"a pdkv memory descriptor is 16 bytes (u64be base, u64be length), not {len(data)}"
            )
        base, size = struct.unpack(">QQ", data)
        return MemoryDesc(base, size)

    def __eq__(self, other) -> bool:
        return isinstance(other, MemoryDesc) and (self.data, self.size) == (other.data, other.size)

    def __hash__(self) -> int:
        return hash((self.data, self.size))

    def __repr__(self) -> str:
        return f"MemoryDesc(data={self.data:#x}, size={self.size}, engine_key={self.engine_key!r})"


def _ints(name: str, values) -> list[int]:
    if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        raise TypeError(f"{name} must be a list of ints, not {type(values).__name__}")
    out = [operator.index(v) for v in values]
    if any(v < 0 for v in out):
        raise ValueError(f"{name} holds a negative value")
    return out


class IOEngineSession:
    """Reads from one remote memory region into one local one."""

    def __init__(self, engine: "IOEngine", local: MemoryDesc, remote: MemoryDesc,
                 endpoint: tuple[str, int]) -> None:
        self._engine = engine
        self.local = local
        self.remote = remote
        self.endpoint = endpoint

    def allocate_transfer_uid(self) -> int:
        return self._engine.allocate_transfer_uid()

    def alive(self) -> bool:
        return True

    def _fail(self, code: StatusCode, message: str) -> TransferStatus:
        _tcp.count(failures=1)
        return TransferStatus(code, message)

    def read(self, local_offset: int, remote_offset: int, size: int, transfer_uid=None) -> TransferStatus:
        return self.batch_read([local_offset], [remote_offset], [size], transfer_uid)

    def batch_read(self, local_offsets, remote_offsets, sizes, transfer_uid=None) -> TransferStatus:
        """Reads range i, ``sizes[i]`` bytes at ``remote.data + remote_offsets[i]``, into
        ``local.data + local_offsets[i]``; returns the final status."""
        try:
            lo = _ints("local_offsets", local_offsets)
            ro = _ints("remote_offsets", remote_offsets)
            sz = _ints("sizes", sizes)
            if not len(lo) == len(ro) == len(sz):
                raise ValueError(
                    f"{len(lo)} local offsets, {len(ro)} remote offsets and {len(sz)} sizes"
                )
            target = _tcp.flip_target("read")
        except (TypeError, ValueError) as e:
            return self._fail(StatusCode.ERR_INVALID_ARGS, f"mori stub batch_read: {e}")
        local = self.local
        pieces = []
        for i, (l_off, r_off, size) in enumerate(zip(lo, ro, sz)):
            if l_off + size > local.size:
                return self._fail(
                    StatusCode.ERR_INVALID_ARGS,
                    f"mori stub batch_read: local range {i} [{l_off}, {l_off + size}) runs past the "
                    f"local region of {local.size} bytes",
                )
            if not self._engine._regions.contains(local.data + l_off, size):
                return self._fail(
                    StatusCode.ERR_INVALID_ARGS,
                    f"mori stub batch_read: local range {i} at {local.data + l_off:#x} is not in "
                    "memory this engine registered",
                )
            # A range past one request's byte limit is cut into pieces.
            done = 0
            while True:
                n = min(size - done, _tcp.CLIENT_MAX_TOTAL_BYTES)
                pieces.append((self.remote.data + r_off + done, n, local.data + l_off + done))
                done += n
                if done >= size:
                    break
        host, port = self.endpoint
        for request in _tcp.plan_requests(pieces):
            try:
                buf = self._engine._client.read(self.endpoint, [(a, n) for a, n, _ in request])
            except _tcp.RemoteRefusal as r:
                code = (
                    StatusCode.ERR_NOT_FOUND
                    if r.status in (_tcp.STATUS_UNREGISTERED, _tcp.STATUS_REVOKED,
                                    _tcp.STATUS_OUT_OF_RANGE, _tcp.STATUS_OTHER_INCARNATION)
                    else StatusCode.ERR_BAD_STATE
                )
                return self._fail(code, f"pdkv data plane refused: {_tcp.status_name(r.status)}: {r.message}")
            except _tcp.ProtocolError as e:
                message = f"pdkv data plane protocol error from {host}:{port}: {e}"
                return self._fail(StatusCode.ERR_BAD_STATE, message)
            except _tcp.DataPlaneIOError as e:
                return self._fail(StatusCode.ERR_RDMA_OP, f"pdkv data plane I/O error: {e}")
            if buf:
                src = (ctypes.c_char * len(buf)).from_buffer(buf)
                base = ctypes.addressof(src)
                offset = 0
                for _, n, dst in request:
                    ctypes.memmove(dst, base + offset, n)
                    offset += n
                del src
        first = _tcp.claim("ranges_read", "bytes_read", len(sz), sum(sz))
        if target is not None and first <= target < first + len(sz):
            i = target - first
            if sz[i]:
                byte = ctypes.c_ubyte.from_address(local.data + lo[i])
                _tcp.log_flip("read", target, local.data + lo[i], sz[i], byte.value)
                byte.value ^= 0xFF
        return TransferStatus(StatusCode.SUCCESS)

    def write(self, *args, **kwargs):
        raise NotImplementedError("READ mode only: the mori stub cannot write (use MoRIIO's read_mode)")

    def batch_write(self, *args, **kwargs):
        raise NotImplementedError("READ mode only: the mori stub cannot write (use MoRIIO's read_mode)")


class IOEngine:
    """One engine: its registered memory and data server, the remote engines it reads from."""

    Session = IOEngineSession

    def __init__(self, key: str, config: IOEngineConfig) -> None:
        if not isinstance(config, IOEngineConfig):
            raise TypeError(f"IOEngine needs an IOEngineConfig, not {type(config).__name__}")
        self.key = str(key)
        self.config = config
        self._lock = threading.Lock()
        self._regions = _tcp.Regions()
        self._server: _tcp.ReadServer | None = None
        self._remotes: dict[str, EngineDesc] = {}
        self._backends: dict[BackendType, object] = {}
        self._client = _tcp.Client()
        self._uids = itertools.count(1)
        self._uid_lock = threading.Lock()
        if os.environ.get("MORI_STUB_WAIT_ALL") == "1":
            self.wait_all = self._wait_all

    def __repr__(self) -> str:
        where = f"{self.config.host}:{self._server.port if self._server else self.config.port}"
        return f"IOEngine(key={self.key!r}, mori stub over pdkv tcp at {where})"

    # ---- backends: nothing to set up

    def create_backend(self, type: BackendType, config=None) -> None:
        self._backends[type] = config

    def remove_backend(self, type: BackendType) -> None:
        self._backends.pop(type, None)

    # ---- this engine's data plane

    def _ensure_server(self) -> _tcp.ReadServer:
        with self._lock:
            if self._server is None:
                host, port = self.config.host, self.config.port
                try:
                    self._server = _tcp.ReadServer(host, port, self._regions)
                except OSError as e:
                    raise RuntimeError(f"mori stub: cannot serve the data plane on {host}:{port}: {e}") from None
            return self._server

    @property
    def data_address(self) -> tuple[str, int] | None:
        """Where the data server listens, once started."""
        return self._server.address if self._server else None

    def get_engine_desc(self) -> EngineDesc:
        port = self.config.port
        if port == 0:
            # Port 0 picks a free port: the server must be bound before the port is known.
            port = self._ensure_server().port
        return EngineDesc(self.key, self.config.host, port)

    def register_torch_tensor(self, tensor) -> MemoryDesc:
        if not tensor.is_contiguous():
            raise RuntimeError("input tensor must be contiguous")
        if tensor.device.type != "cpu":
            raise ValueError(f"the mori stub serves CPU memory only, not {tensor.device}")
        size = tensor.nelement() * tensor.element_size()
        if size == 0:
            raise ValueError("the mori stub does not register an empty tensor")
        self._ensure_server()
        base = tensor.data_ptr()
        rid = self._regions.register(base, size, tensor)
        return MemoryDesc(base, size, engine_key=self.key, device_id=-1, loc="cpu", id=rid)

    def deregister_memory(self, desc: MemoryDesc) -> bool:
        return self._regions.deregister(desc.data, desc.size)

    # ---- reading remote engines

    def register_remote_engine(self, desc: EngineDesc) -> None:
        if not isinstance(desc, EngineDesc):
            raise TypeError(f"register_remote_engine needs an EngineDesc, not {type(desc).__name__}")
        with self._lock:
            self._remotes[desc.key] = desc

    def deregister_remote_engine(self, desc: EngineDesc) -> None:
        with self._lock:
            self._remotes.pop(desc.key, None)

    def allocate_transfer_uid(self) -> int:
        with self._uid_lock:
            return next(self._uids)

    def create_session(self, local: MemoryDesc, remote: MemoryDesc) -> IOEngineSession:
        """A session reading `remote` (of the one registered remote engine) into `local` (memory
        this engine registered)."""
        with self._lock:
            endpoints = sorted({(d.host, d.port) for d in self._remotes.values()})
        if not endpoints:
            raise RuntimeError("mori stub: create_session before any register_remote_engine")
        if len(endpoints) > 1:
            names = ", ".join(f"{h}:{p}" for h, p in endpoints)
            raise RuntimeError(
                f"mori stub: {len(endpoints)} remote engines registered ({names}); a pdkv memory "
                "descriptor does not say whose memory it is, so a session is ambiguous"
            )
        if not self._regions.contains(local.data, local.size):
            raise ValueError(
                f"mori stub: local memory [{local.data:#x}, +{local.size}) is not memory this "
                "engine registered"
            )
        return IOEngineSession(self, local, remote, endpoints[0])

    def _wait_all(self, statuses, timeout_ms: int = -1) -> StatusCode:
        """Waits for every status up to `timeout_ms` (all, when negative): SUCCESS when all
        succeeded, the first failure's code, else IN_PROGRESS."""
        deadline = None if timeout_ms is None or timeout_ms < 0 else time.monotonic() + timeout_ms / 1000
        for status in statuses:
            if deadline is None:
                status.Wait()
            elif not status.WaitFor(max(0.0, deadline - time.monotonic()) * 1000):
                break
        for status in statuses:
            if status.Failed():
                return status.Code()
        if all(status.Succeeded() for status in statuses):
            return StatusCode.SUCCESS
        return StatusCode.IN_PROGRESS

    def write(self, *args, **kwargs):
        raise NotImplementedError("READ mode only: the mori stub cannot write (use MoRIIO's read_mode)")

    def batch_write(self, *args, **kwargs):
        raise NotImplementedError("READ mode only: the mori stub cannot write (use MoRIIO's read_mode)")

    def shutdown(self) -> None:
        """Stops the data server and closes kept connections (the stub's own; tests use it)."""
        with self._lock:
            server, self._server = self._server, None
        if server is not None:
            server.shutdown()
        self._client.close()
