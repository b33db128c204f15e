"""Checks of the ``mori`` stub (tests/vllm/mori_stub): a MoRI whose data plane is pdkv's TCP
read protocol. No vLLM engine is started.

1. descriptors: ``EngineDesc.pack()`` is pdkv's descriptor byte for byte (the vector of
   core/src/wire/data_plane.rs), it round-trips, and anything else is a ValueError saying why;
2. stub client <-> stub server over CPU torch tensors: the bytes arrive, a read outside the
   registered memory fails with ERR_NOT_FOUND, the flip knob flips exactly one byte, chunking,
   concurrency, the session and WRITE rules;
3. stub client <-> a real pdkv prefill rank (``pdkv._native.Rank``): staged blocks read back
   untagged with their exact bytes, an unstaged block fails as revoked;
4. hand-built requests to the stub server: a tagged (0xA2) read with the transfer flag is
   served, the incarnation flag is status 6 on an open connection, unknown flags are status 4
   and the connection closes, and the other refusals of pdkv's protocol.

Run (a few seconds)::

    cd tests/vllm
    PYTHONPATH=. /root/.cache/pdkv/vllm-0.34.0/bin/python -m pdkv_vllm_test.test_mori_stub

Exit status 0 when every check passed, 1 otherwise. ``MORI_STUB_TEST_SABOTAGE=1`` replaces every
expected value by a wrong one, to show that every check can fail: the run must then report
every check failed.
"""

from __future__ import annotations

import json
import os
import random
import socket
import struct
import sys
import threading
import time
from contextlib import contextmanager

import torch

# The stub is imported from its folder, as the MoRIIO server's PYTHONPATH names it.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "mori_stub"))

from mori import _tcp  # noqa: E402
from mori.io import (  # noqa: E402
    STATS,
    BackendType,
    EngineDesc,
    IOEngine,
    IOEngineConfig,
    MemoryDesc,
    PollCqMode,
    RdmaBackendConfig,
    StatusCode,
    TransferStatus,
    XgmiBackendConfig,
    reset_stats,
)

SABOTAGE = os.environ.get("MORI_STUB_TEST_SABOTAGE") == "1"
RESULTS = {"passed": 0, "failed": 0}


def _wrong(expected):
    """A value that is not `expected`, of the same kind where possible."""
    if isinstance(expected, bool):
        return not expected
    if isinstance(expected, StatusCode):
        return StatusCode.SUCCESS if expected != StatusCode.SUCCESS else StatusCode.ERR_BAD_STATE
    if isinstance(expected, int):
        return expected + 1
    if isinstance(expected, (bytes, bytearray)):
        return bytes([expected[0] ^ 0xFF]) + bytes(expected[1:]) if expected else b"\x00"
    if isinstance(expected, str):
        return expected + " (sabotaged)"
    if isinstance(expected, (tuple, list)):
        return type(expected)([_wrong(expected[0]), *expected[1:]]) if expected else type(expected)([None])
    return object()


def _show(value) -> str:
    text = repr(value)
    return text[:200] + "..." if len(text) > 200 else text


def check(name: str, got, expected, detail: str = "") -> bool:
    """One table row: `got` must equal `expected`."""
    if SABOTAGE:
        expected = _wrong(expected)
    ok = got == expected
    RESULTS["passed" if ok else "failed"] += 1
    if not ok:
        print(f"FAIL {name}: got {_show(got)}, expected {_show(expected)}" + (f" ({detail})" if detail else ""))
    return ok


def raises(fn, *args, **kwargs) -> tuple[str, str]:
    """(exception type name, message) of calling fn, or ("", "") when it returns."""
    try:
        fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001
        return type(e).__name__, str(e)
    return "", ""


def failed_with(status: TransferStatus, prefix: str) -> tuple[bool, StatusCode, bool]:
    """(Failed(), Code(), whether Message() starts with `prefix`)."""
    return status.Failed(), status.Code(), status.Message().startswith(prefix)


@contextmanager
def env(name: str, value: str | None):
    old = os.environ.get(name)
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def free_port(also: int = 0) -> int:
    """A port free now (and, with `also`, the port that far above it too)."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if not also:
            return port
        if port + also > 65535:
            continue
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port + also))
            return port
        except OSError:
            continue
    raise RuntimeError("no free port")


def differing(a: bytes, b: bytes) -> list[int]:
    return [i for i in range(min(len(a), len(b))) if a[i] != b[i]]


def tensor_bytes(t: torch.Tensor, start: int = 0, length: int | None = None) -> bytes:
    raw = t.view(torch.uint8).numpy().tobytes()
    return raw[start:] if length is None else raw[start:start + length]


# ---------------------------------------------------------------- 1. descriptors

# core/src/wire/data_plane.rs, a_pdkv_descriptor_round_trips_with_exact_bytes.
VECTOR_RDMA = b"\x83\xa4pdkv\x01\xa9transport\xa4rdma\xa4addr\xad10.0.0.3:7000"
VECTOR_TCP = b"\x83\xa4pdkv\x01\xa9transport\xa3tcp\xa4addr\xad10.0.0.3:7000"


def fixstr(s: str) -> bytes:
    raw = s.encode()
    assert len(raw) < 32
    return bytes([0xA0 | len(raw)]) + raw


def fixmap(*entries: tuple[str, bytes]) -> bytes:
    return bytes([0x80 | len(entries)]) + b"".join(fixstr(k) + v for k, v in entries)


def descriptor(pdkv: bytes = b"\x01", transport: str = "tcp", addr: str = "h:1") -> bytes:
    return fixmap(("pdkv", pdkv), ("transport", fixstr(transport)), ("addr", fixstr(addr)))


def test_descriptors() -> None:
    check("encode_descriptor = pdkv's test vector (rdma)",
          _tcp.encode_descriptor("rdma", "10.0.0.3:7000"), VECTOR_RDMA)
    engine = IOEngine("producer:10.0.0.3:6301:tp0:dp0", IOEngineConfig("10.0.0.3", 7000))
    packed = engine.get_engine_desc().pack()
    check("EngineDesc.pack() = pdkv's vector with tcp", packed, VECTOR_TCP)
    desc = EngineDesc.unpack(packed)
    check("unpack: host, port, key", (desc.host, desc.port, desc.key),
          ("10.0.0.3", 7000, "pdkv-tcp://10.0.0.3:7000"))
    check("unpack then pack is the same bytes", desc.pack(), packed)
    check("unpack equals the local desc", desc == engine.get_engine_desc(), True)
    long_host = "h" * 40
    long_packed = EngineDesc("k", long_host, 65535).pack()
    check("a 46-byte address is a str8", long_packed[-48:-46], b"\xd9\x2e")
    check("str8 round-trips", EngineDesc.unpack(long_packed).addr, f"{long_host}:65535")
    reordered = fixmap(("addr", fixstr("h:9")), ("transport", fixstr("tcp")), ("pdkv", b"\x01"))
    check("keys in any order", EngineDesc.unpack(reordered).addr, "h:9")
    check("bytearray accepted", EngineDesc.unpack(bytearray(packed)).port, 7000)

    # msgpack-c's MSGPACK_DEFINE(key, gpuId, hostname, backends, tcpHandle) of a MoRI EngineDesc.
    mori_desc = (
        b"\x95" + fixstr("mori-engine-P0-tp1") + b"\x01" + fixstr("node-3") + b"\x91\x03"
        + b"\x92" + fixstr("10.0.0.3") + b"\xcd\xb8\x13"
    )
    pdkv1, tcp = ("pdkv", b"\x01"), ("transport", fixstr("tcp"))
    bad = [
        ("empty", b"", "empty"),
        ("a MoRI EngineDesc", mori_desc, "looks like a MoRI EngineDesc"),
        ("an older pdkv map", fixmap(("addr", fixstr("h:1")), tcp), "without a `pdkv` key"),
        ("text", b"mori-engine-desc", "a MessagePack int (fixint)"),
        ("an int", b"\x05", "a MessagePack int (fixint), 1 bytes"),
        ("byte 0xc1", b"\xc1\x00", "never-used byte 0xc1"),
        ("an int array", b"\x93\x01\x02\x03", "a MessagePack array (fixarray)"),
        ("a map16", b"\xde\x00\x00", "a MessagePack map (map16)"),
        ("version 2", descriptor(pdkv=b"\x02"), "version 2; this stub reads version 1"),
        ("version as uint8", descriptor(pdkv=b"\xcc\x01"),
         "`pdkv` is a MessagePack int (uint8), expected a positive fixint"),
        ("version as str", descriptor(pdkv=fixstr("1")), "`pdkv` is a MessagePack str (fixstr)"),
        ("transport udp", descriptor(transport="udp"), "transport `udp`"),
        ("transport rdma", descriptor(transport="rdma"), "tcp data plane only"),
        ("address without port", descriptor(addr="h"), "address `h` is not host:port"),
        ("address without host", descriptor(addr=":80"), "address `:80` is not host:port"),
        ("port 99999", descriptor(addr="h:99999"), "address `h:99999` is not host:port"),
        ("port 0", descriptor(addr="h:0"), "address `h:0` is not host:port"),
        ("port +80", descriptor(addr="h:+80"), "address `h:+80` is not host:port"),
        ("trailing byte", descriptor() + b"\x00", "1 trailing bytes"),
        ("truncated", descriptor()[:-1], "truncated"),
        ("duplicate key", fixmap(pdkv1, tcp, ("addr", fixstr("h:1")), ("addr", fixstr("h:2"))),
         "duplicate key `addr`"),
        ("unknown key", fixmap(pdkv1, tcp, ("addr", fixstr("h:1")), ("x", b"\x01")), "unknown key `x`"),
        ("no addr", fixmap(pdkv1, tcp), "without `addr`"),
        ("non-UTF-8 address", fixmap(pdkv1, tcp, ("addr", b"\xa3h:\xff")), "not UTF-8"),
        ("a str, not bytes", "h:1", "bytes, not str"),
    ]
    for name, blob, words in bad:
        kind, message = raises(EngineDesc.unpack, blob)
        check(f"unpack refuses {name}", (kind in ("ValueError", "DescriptorError"), words in message),
              (True, True), message)
    check("pack refuses port 0", raises(EngineDesc("k", "h", 0).pack)[0], "DescriptorError")

    md = MemoryDesc(1 << 44, 2048)
    check("MemoryDesc.pack is u64be base ++ u64be len", md.pack(),
          b"\x00\x00\x10\x00\x00\x00\x00\x00" + b"\x00" * 6 + b"\x08\x00")
    back = MemoryDesc.unpack(md.pack())
    check("MemoryDesc round trip",
          (back.data, back.size, back.engine_key, back.device_id, back.device_bus_id, back.loc),
          (1 << 44, 2048, "", -1, "", "cpu"))
    check("MemoryDesc refuses 15 bytes", "16 bytes" in raises(MemoryDesc.unpack, b"\x00" * 15)[1], True)

    # The names MoRIIO imports, used as it uses them.
    check("BackendType", (BackendType.XGMI != BackendType.RDMA, str(BackendType.RDMA)),
          (True, "BackendType.RDMA"))
    RdmaBackendConfig(1, -1, 1, PollCqMode.POLLING, enable_notification=False)
    XgmiBackendConfig()
    check("StatusCode members", [c.name for c in StatusCode],
          ["SUCCESS", "INIT", "IN_PROGRESS", "ERR_INVALID_ARGS", "ERR_NOT_FOUND", "ERR_RDMA_OP",
           "ERR_BAD_STATE", "ERR_GPU_OP"])
    status = TransferStatus()
    check("a new TransferStatus is Init",
          (status.Init(), status.InProgress(), status.Succeeded(), status.Failed(), status.WaitFor(1)),
          (True, False, False, False, False))
    status.Update(StatusCode.ERR_RDMA_OP, "post failed: SQ full")
    check("no stub message says SQ full", ("SQ full" in status.Message(), status.Failed(), status.WaitFor(1)),
          (False, True, True))


# ---------------------------------------------------------------- 2. stub client <-> stub server

BLOCK = 256
BLOCKS = 8
LAYERS = 2
REGION = BLOCK * BLOCKS


class Pair:
    """A producer engine serving one shared MR of random bytes, and a consumer reading it."""

    def __init__(self) -> None:
        port = free_port()
        self.endpoint = ("127.0.0.1", port)
        self.producer = IOEngine(f"producer:127.0.0.1:{port}:tp0:dp0", IOEngineConfig("127.0.0.1", port))
        config = RdmaBackendConfig(1, -1, 1, PollCqMode.POLLING, enable_notification=False)
        self.producer.create_backend(BackendType.RDMA, config)
        gen = torch.Generator().manual_seed(11)
        self.remote = torch.randint(0, 256, (LAYERS * REGION,), dtype=torch.uint8, generator=gen)
        self.remote_md = self.producer.register_torch_tensor(self.remote)
        self.consumer = IOEngine("consumer:127.0.0.1:0:tp0:dp0", IOEngineConfig("127.0.0.1", 0))
        self.local = torch.zeros(LAYERS * REGION, dtype=torch.uint8)
        self.local_packed = self.consumer.register_torch_tensor(self.local).pack()
        self.consumer.register_remote_engine(EngineDesc.unpack(self.producer.get_engine_desc().pack()))
        self.session = self.consumer.create_session(
            MemoryDesc.unpack(self.local_packed), MemoryDesc.unpack(self.remote_md.pack())
        )

    def read(self, lo, ro, sz) -> TransferStatus:
        self.local.zero_()
        return self.session.batch_read(lo, ro, sz, self.consumer.allocate_transfer_uid())

    def landed(self, lo, ro, sz) -> bool:
        return all(
            tensor_bytes(self.local, l, s) == tensor_bytes(self.remote, r, s) for l, r, s in zip(lo, ro, sz)
        )

    def kept(self) -> int:
        return self.consumer._client.idle_connections(self.endpoint)

    def close(self) -> None:
        self.producer.shutdown()
        self.consumer.shutdown()


def test_stub_pair(pair: Pair) -> None:
    check("register: data and size", (pair.remote_md.data, pair.remote_md.size),
          (pair.remote.data_ptr(), LAYERS * REGION))
    check("the server listens at the configured port", pair.producer.data_address, pair.endpoint)
    check("non-contiguous tensor refused", raises(pair.producer.register_torch_tensor, torch.zeros(4, 4).t()),
          ("RuntimeError", "input tensor must be contiguous"))

    lo, ro, sz = [0, 512, 1024], [3 * BLOCK, 0, REGION + 7 * BLOCK], [BLOCK, 2 * BLOCK, BLOCK]
    status = pair.read(lo, ro, sz)
    check("batch_read succeeds", (status.Succeeded(), status.Failed(), status.Code(), status.Message()),
          (True, False, StatusCode.SUCCESS, ""))
    check("the bytes arrived", pair.landed(lo, ro, sz), True)
    check("nothing else was written", tensor_bytes(pair.local, 1536), bytes(LAYERS * REGION - 1536))
    check("one kept connection", pair.kept(), 1)

    status = pair.read([0], [LAYERS * REGION - 10], [BLOCK])
    check("out of region: Failed, ERR_NOT_FOUND, pdkv's status and text",
          failed_with(status, "pdkv data plane refused: out of range: range ["),
          (True, StatusCode.ERR_NOT_FOUND, True), status.Message())
    check("the connection is kept after an access refusal", pair.kept(), 1)
    bogus = pair.consumer.create_session(MemoryDesc.unpack(pair.local_packed), MemoryDesc(16, 4096))
    status = bogus.batch_read([0], [0], [BLOCK], 1)
    check("unregistered: Failed, ERR_NOT_FOUND", failed_with(status, "pdkv data plane refused: unregistered: "),
          (True, StatusCode.ERR_NOT_FOUND, True), status.Message())

    before = STATS["requests_sent"]
    for name, args, words in [
        ("a local range past the local region", ([LAYERS * REGION - 8], [0], [16]), "runs past the local region"),
        ("lists of different lengths", ([0, 1], [0], [1]), "2 local offsets, 1 remote offsets and 1 sizes"),
        ("a negative size", ([0], [0], [-1]), "negative"),
        ("an int for a list", (0, 0, 16), "must be a list of ints"),
    ]:
        status = pair.session.batch_read(*args, 1)
        check(f"invalid args: {name}", (status.Code(), words in status.Message()),
              (StatusCode.ERR_INVALID_ARGS, True), status.Message())
    check("invalid args send nothing", STATS["requests_sent"], before)
    check("an empty batch succeeds", pair.session.batch_read([], [], [], 1).Succeeded(), True)

    # Past the per-request limits a read is cut into requests (the limits lowered to see it).
    old = (_tcp.CLIENT_MAX_RANGES, _tcp.CLIENT_MAX_TOTAL_BYTES)
    _tcp.CLIENT_MAX_RANGES, _tcp.CLIENT_MAX_TOTAL_BYTES = 2, 600
    try:
        before = STATS["requests_sent"]
        lo = [0, 300, 600, 900, 1200, 2000]
        ro = [0, 256, 512, 1024, 2048, 3000]
        sz = [256, 256, 256, 256, 256, 1000]
        status = pair.read(lo, ro, sz)
        check("chunked read succeeds", status.Succeeded(), True, status.Message())
        check("chunked read lands every byte", pair.landed(lo, ro, sz), True)
        # Pieces 256 x5, then 1000 as 600+400: [256,256] [256,256] [256] [600] [400].
        check("chunked into 5 requests", STATS["requests_sent"] - before, 5)
    finally:
        _tcp.CLIENT_MAX_RANGES, _tcp.CLIENT_MAX_TOTAL_BYTES = old

    # Several threads at once, as MoRIIO's do.
    errors: list[str] = []

    def reader(seed: int) -> None:
        rng = random.Random(seed)
        local = torch.zeros(LAYERS * REGION, dtype=torch.uint8)
        md = MemoryDesc.unpack(pair.consumer.register_torch_tensor(local).pack())
        session = pair.consumer.create_session(md, MemoryDesc.unpack(pair.remote_md.pack()))
        for _ in range(20):
            lo = [i * BLOCK for i in range(4)]
            ro = [b * BLOCK for b in rng.sample(range(LAYERS * BLOCKS), 4)]
            status = session.batch_read(lo, ro, [BLOCK] * 4, 0)
            if not status.Succeeded():
                errors.append(status.Message())
            elif any(tensor_bytes(local, l, BLOCK) != tensor_bytes(pair.remote, r, BLOCK) for l, r in zip(lo, ro)):
                errors.append(f"thread {seed}: bytes differ")

    threads = [threading.Thread(target=reader, args=(s,)) for s in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    check("8 threads x 20 reads: all succeed with the right bytes", errors, [])
    check("at most one connection per concurrent reader", pair.kept() <= 8, True)

    # Counters.
    reset_stats()
    pair.read([0, 1000], [5, 4000], [100, 96])
    pair.read([0], [LAYERS * REGION], [1])
    keys = ("bytes_read", "ranges_read", "bytes_served", "ranges_served", "failures", "refusals_sent")
    check("STATS", {k: STATS[k] for k in keys},
          {"bytes_read": 196, "ranges_read": 2, "bytes_served": 196, "ranges_served": 2, "failures": 1,
           "refusals_sent": 1})

    # The flip knob: exactly one byte, the first of the n-th range.
    lo, ro, sz = [0, 512, 1024], [0, 512, 2048], [BLOCK, BLOCK, BLOCK]
    clean = pair.read(lo, ro, sz).Succeeded() and tensor_bytes(pair.local)
    for knob, where in [("read:2", [512]), ("serve:3", [1024])]:
        reset_stats()
        with env(_tcp.FLIP_ENV, knob):
            status = pair.read(lo, ro, sz)
        check(f"MORI_STUB_FLIP={knob}: one byte differs, the first of that range",
              (status.Succeeded(), differing(tensor_bytes(pair.local), clean)), (True, where))
    # Both sides in this one process: one range served to a raw request first, so the server's
    # 2nd range is this read's 1st and the client's 2nd its 2nd.
    reset_stats()
    with env(_tcp.FLIP_ENV, "2"):
        with socket.create_connection(pair.endpoint, timeout=5) as s:
            s.sendall(untagged([(pair.remote_md.data, 8)]))
            answer(s, 8)
        pair.read(lo, ro, sz)
    check("MORI_STUB_FLIP=2 flips on both sides", differing(tensor_bytes(pair.local), clean), [0, 512])
    with env(_tcp.FLIP_ENV, "two"):
        status = pair.read(lo, ro, sz)
    check("a bad MORI_STUB_FLIP is an invalid-args failure",
          (status.Code(), "MORI_STUB_FLIP='two'" in status.Message()),
          (StatusCode.ERR_INVALID_ARGS, True), status.Message())

    # WRITE mode.
    kind, message = raises(pair.session.batch_write, [0], [0], [1], 1)
    check("batch_write: READ mode only", (kind, message.startswith("READ mode only")),
          ("NotImplementedError", True), message)
    check("write: READ mode only", raises(pair.session.write, 0, 0, 1, 1)[0], "NotImplementedError")

    # wait_all.
    check("no wait_all by default", hasattr(pair.consumer, "wait_all"), False)
    with env("MORI_STUB_WAIT_ALL", "1"):
        waiting = IOEngine("w", IOEngineConfig("127.0.0.1", 0))
    ok, failed = TransferStatus(StatusCode.SUCCESS), TransferStatus(StatusCode.ERR_NOT_FOUND, "x")
    check("MORI_STUB_WAIT_ALL=1: wait_all",
          [waiting.wait_all(s, timeout_ms=10) for s in ([ok, ok], [ok, failed], [TransferStatus()])],
          [StatusCode.SUCCESS, StatusCode.ERR_NOT_FOUND, StatusCode.IN_PROGRESS])
    waiting.shutdown()

    # Sessions: the one remote engine, local memory of this engine.
    lone = IOEngine("lone", IOEngineConfig("127.0.0.1", 0))
    lone_md = lone.register_torch_tensor(torch.zeros(16, dtype=torch.uint8))
    check("create_session without a remote engine", raises(lone.create_session, lone_md, pair.remote_md)[1],
          "mori stub: create_session before any register_remote_engine")
    lone.register_remote_engine(EngineDesc.unpack(descriptor(addr="127.0.0.1:1")))
    lone.register_remote_engine(EngineDesc.unpack(descriptor(addr="127.0.0.1:1")))
    check("the same engine twice is one endpoint",
          type(lone.create_session(lone_md, pair.remote_md)).__name__, "IOEngineSession")
    lone.register_remote_engine(EngineDesc.unpack(descriptor(addr="127.0.0.1:2")))
    check("two remote endpoints are ambiguous",
          "2 remote engines registered" in raises(lone.create_session, lone_md, pair.remote_md)[1], True)
    lone.shutdown()
    message = raises(pair.consumer.create_session, MemoryDesc(16, 16), pair.remote_md)[1]
    check("a local desc this engine did not register", "not memory this engine registered" in message, True)

    # Nothing listening: a failed connect is a Failed status, not an exception.
    dead = IOEngine("dead", IOEngineConfig("127.0.0.1", 0))
    dead_md = MemoryDesc.unpack(dead.register_torch_tensor(torch.zeros(16, dtype=torch.uint8)).pack())
    dead.register_remote_engine(EngineDesc.unpack(descriptor(addr=f"127.0.0.1:{free_port()}")))
    status = dead.create_session(dead_md, MemoryDesc(16, 16)).batch_read([0], [0], [16], 1)
    check("nothing listening: Failed, ERR_RDMA_OP, no SQ full",
          failed_with(status, "pdkv data plane I/O error: connect to") + ("SQ full" in status.Message(),),
          (True, StatusCode.ERR_RDMA_OP, True, False), status.Message())
    dead.shutdown()


# ---------------------------------------------------------------- 3. stub client <-> pdkv prefill rank

def test_pdkv_prefill_rank() -> None:
    import msgspec  # vLLM's dependency; reads the rank's handshake reply

    from pdkv import _native

    port = free_port(also=100)
    config = json.dumps({
        "deployment": "1P_TP1:1D_TP1", "engine": "P0", "host": "127.0.0.1",
        "handshake_port": port, "notify_port": port + 100,
        "model": {"use_mla": False, "kv_heads": 2, "layers": LAYERS, "bytes_per_token_per_layer": 64,
                  "block_size_tokens": 4},
        "timeouts": {"handshake_ms": 5000, "transfer_ms": 5000, "defer_ms": 20000, "collective_ms": 60000},
    })
    rank = _native.Rank(config, 0, 0, BLOCKS)
    consumer = IOEngine(f"consumer:127.0.0.1:{port}:tp0:dp0", IOEngineConfig("127.0.0.1", 0))
    try:
        ready = None
        deadline = time.monotonic() + 10
        while ready is None and time.monotonic() < deadline:
            for text, _ in rank.poll(1.0):
                said = json.loads(text)
                if "Ready" in said:
                    ready = said["Ready"]
                elif "SetupFailed" in said:
                    raise RuntimeError(f"pdkv rank: {said}")
        check("the pdkv rank is ready", ready is not None, True)
        if ready is None:
            return
        check("block_len", rank.block_len(), BLOCK)
        # The handshake reply the rank sends a MoRIIO decode: metadata, then the layers' descs.
        metadata = msgspec.msgpack.decode(bytes(ready["handshake"][0]))
        layer_descs = msgspec.msgpack.decode(bytes(ready["handshake"][1]))
        agent = metadata["agent_metadata"]
        desc = EngineDesc.unpack(agent)
        check("the rank's agent_metadata reads as its data address", desc.addr, ready["data_addr"])
        check("and packs back to pdkv's exact bytes", desc.pack(), agent)
        names = [f"model.layers.{layer}.self_attn.attn" for layer in range(LAYERS)]
        remote_mds = [MemoryDesc.unpack(layer_descs[name][0]) for name in names]
        check("layer descs: base = kv_caches_base_addr, size = the region",
              [(m.data, m.size) for m in remote_mds], [(b, REGION) for b in metadata["kv_caches_base_addr"]])

        local = torch.zeros(LAYERS * REGION, dtype=torch.uint8)
        local_md = MemoryDesc.unpack(consumer.register_torch_tensor(local).pack())
        consumer.register_remote_engine(desc)
        sessions = [consumer.create_session(local_md, md) for md in remote_mds]

        rng = random.Random(5)
        blocks = [5, 1, 6]
        staged = [bytes(rng.randrange(256) for _ in range(len(blocks) * BLOCK)) for _ in range(LAYERS)]
        for layer, data in enumerate(staged):
            rank.stage(layer, blocks, data)
        rank.staged_transfer("tx-" + "0" * 31 + "1", blocks)

        def read_layer(layer: int, which: list[int]) -> TransferStatus:
            lo = [layer * REGION + i * BLOCK for i in range(len(which))]
            ro = [b * BLOCK for b in which]
            return sessions[layer].batch_read(lo, ro, [BLOCK] * len(which), consumer.allocate_transfer_uid())

        for layer in range(LAYERS):
            status = read_layer(layer, blocks)
            check(f"layer {layer}: staged blocks read untagged", (status.Succeeded(), status.Message()),
                  (True, ""))
            got = tensor_bytes(local, layer * REGION, len(blocks) * BLOCK)
            check(f"layer {layer}: the exact bytes staged", got, staged[layer])
            check(f"layer {layer}: = what the rank holds", got, rank.unstage(layer, blocks))

        status = read_layer(0, [0])
        check("an unstaged block: Failed, ERR_NOT_FOUND, revoked",
              failed_with(status, "pdkv data plane refused: revoked: "),
              (True, StatusCode.ERR_NOT_FOUND, True), status.Message())
        status = read_layer(0, [5, 2])
        check("staged and unstaged in one read: Failed, revoked",
              failed_with(status, "pdkv data plane refused: revoked: "),
              (True, StatusCode.ERR_NOT_FOUND, True), status.Message())
        status = sessions[LAYERS - 1].batch_read([0], [REGION - 16], [BLOCK], 1)
        check("past the last region: Failed, ERR_NOT_FOUND", failed_with(status, "pdkv data plane refused: "),
              (True, StatusCode.ERR_NOT_FOUND, True), status.Message())

        local.zero_()
        reset_stats()
        with env(_tcp.FLIP_ENV, "read:1"):
            status = read_layer(1, blocks)
        check("MORI_STUB_FLIP=read:1 against pdkv: one byte differs, the first",
              (status.Succeeded(), differing(tensor_bytes(local, REGION, len(blocks) * BLOCK), staged[1])),
              (True, [0]))
        check("STATS after that read", (STATS["bytes_read"], STATS["ranges_read"]),
              (len(blocks) * BLOCK, len(blocks)))
    finally:
        consumer.shutdown()
        rank.shutdown(5.0)


# ---------------------------------------------------------------- 4. hand-built requests to the stub server

def ranges_bytes(ranges) -> bytes:
    return b"".join(struct.pack(">QQ", a, n) for a, n in ranges)


def tagged(flags: int, incarnation: int, key: int, ranges) -> bytes:
    return struct.pack(">BBQQI", 0xA2, flags, incarnation, key, len(ranges)) + ranges_bytes(ranges)


def untagged(ranges) -> bytes:
    return struct.pack(">BI", 0xA1, len(ranges)) + ranges_bytes(ranges)


def recv_exact(sock: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        if not chunk:
            raise ConnectionError(f"closed after {len(out)} of {n} bytes")
        out += chunk
    return out


def answer(sock: socket.socket, total: int) -> tuple[int, bytes | str]:
    """(status, the bytes) or (status, the message)."""
    status = recv_exact(sock, 1)[0]
    if status == 0:
        return 0, recv_exact(sock, total)
    (n,) = struct.unpack(">I", recv_exact(sock, 4))
    return status, recv_exact(sock, n).decode()


def closed(sock: socket.socket) -> bool:
    sock.settimeout(2)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except socket.timeout:
        return False


def test_hand_built(pair: Pair) -> None:
    base, size = pair.remote_md.data, pair.remote_md.size
    inside = [(base + 256, 100), (base + REGION + 8, 64)]
    expected = tensor_bytes(pair.remote, 256, 100) + tensor_bytes(pair.remote, REGION + 8, 64)

    def connect() -> socket.socket:
        s = socket.create_connection(pair.endpoint, timeout=5)
        s.settimeout(5)
        return s

    with connect() as s:
        s.sendall(tagged(0x02, 0, 0xDEADBEEF_CAFEF00D, inside))
        check("0xA2, transfer flag: served (the key is not checked)", answer(s, 164), (0, expected))
        s.sendall(tagged(0x00, 0, 0, inside))
        check("0xA2, no flags: served", answer(s, 164), (0, expected))
        s.sendall(tagged(0x03, 7, 1, inside))
        status, message = answer(s, 164)
        check("0xA2, incarnation flag: status 6", (status, "incarnation 7" in str(message)), (6, True), str(message))
        s.sendall(untagged(inside))
        check("... and the connection stays open", answer(s, 164), (0, expected))
        s.sendall(untagged([(16, 8)]))
        check("unregistered address: status 1", answer(s, 8), (1, "no registered region holds address 0x10"))
        s.sendall(untagged([(base + size - 4, 8)]))
        status, message = answer(s, 8)
        check("past the region's end: status 3", (status, str(message).startswith("range [")), (3, True), str(message))
        s.sendall(untagged([(base, 4), (16, 4)]))
        check("one bad range refuses the whole request", answer(s, 8)[0], 1)
        s.sendall(untagged([]))
        check("no ranges: status 0 and nothing", answer(s, 0), (0, b""))
        s.sendall(untagged(inside))
        check("... still in step after all that", answer(s, 164), (0, expected))

    for name, request, status, words in [
        ("flags 0x04", tagged(0x04, 0, 0, inside), 4, "unknown flags 0x04 in a tagged read"),
        ("incarnation flag, incarnation 0", tagged(0x01, 0, 0, inside), 4, "incarnation 0 is outside 1..="),
        ("bad magic", b"\x42" + untagged(inside)[1:], 4, "bad magic byte 0x42, expected 0xa1 or 0xa2"),
        ("65537 ranges", struct.pack(">BI", 0xA1, 65537), 5, "65537 ranges in one request; the limit is 65536"),
        ("over 1 GiB", untagged([(base, 1 << 29), (base, (1 << 29) + 1)]), 5,
         "1073741825 bytes in one request; the limit is 1073741824"),
    ]:
        with connect() as s:
            s.sendall(request)
            got, message = answer(s, 0)
            check(f"{name}: status {status}", (got, str(message).startswith(words)), (status, True), str(message))
            check(f"{name}: the server closes the connection", closed(s), True)

    with connect() as s:
        s.sendall(bytes(random.Random(3).randrange(256) for _ in range(4096)))
    with connect() as s:
        s.sendall(b"\xa1\x00")  # a request cut short, then gone
    status = pair.read([0], [0], [BLOCK])
    check("the server still serves after garbage", (status.Succeeded(), pair.landed([0], [0], [BLOCK])),
          (True, True))


def main() -> int:
    began = time.monotonic()
    test_descriptors()
    pair = Pair()
    try:
        test_stub_pair(pair)
        test_hand_built(pair)
    finally:
        pair.close()
    test_pdkv_prefill_rank()
    seconds = round(time.monotonic() - began, 1)
    print(json.dumps({**RESULTS, "checks": sum(RESULTS.values()), "sabotage": SABOTAGE, "seconds": seconds}))
    return 0 if RESULTS["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
