# vLLM's own MoRIIO answers for `cargo xtask moriio-conformance` (xtask/src/moriio/).
#
# Imports the REAL moriio_common.py, moriio_connector.py and moriio_engine.py extracted from the
# wheel of a vLLM release (plus vLLM's network_utils.py and envs.py), with stubs/ standing in for
# torch, numpy, MoRI and the vLLM modules that need them (each stub says why it cannot change an
# answer). It then asks vLLM's functions and methods, called on minimal objects that carry only
# the attributes they read, for every rule pdkv re-implements, over every prefill and decode
# layout up to --max-ranks ranks a side, and runs two wire interactions of vLLM against vLLM
# (handshake, release notify) on loopback. With --messages it also delivers every message pdkv
# sends (bytes xtask got from pdkv's decode node, and a sample of every message variant) to a
# fresh vLLM notify or handshake listener each, from a DEALER as pdkv's, and checks the
# listener thread still serves vLLM's own release or dial afterwards. It prints nothing but
# progress on stderr and writes one JSON document (--out); xtask computes pdkv's answers and
# compares. No network but loopback.

import argparse
import ast
import inspect
import json
import logging
import os
import socket
import sys
import textwrap
import threading
import time
import types

MORIIO = "vllm.distributed.kv_transfer.kv_connector.v1.moriio"
# Modules that must come from the wheel, never from stubs/.
REAL_MODULES = [
    f"{MORIIO}.moriio_common",
    f"{MORIIO}.moriio_connector",
    f"{MORIIO}.moriio_engine",
    "vllm.utils.network_utils",
    "vllm.envs",
]
HANDSHAKE_BASE = 6301
NOTIFY_BASE = 61005
HOST = "127.0.0.1"
TRANSFER_ID = "tx-pdkv-conformance"
REQUEST_ID = "req-pdkv-conformance"

# The methods of vLLM's MoRIIOConnectorWorker the harness (and tests/moriio/mixed.py) calls.
WORKER_METHODS = [
    "_resolve_read_source",
    "_next_flex_tp_rank",
    "_spreads_replicated_reads",
    "_remote_tp_rank",
    "_read_blocks_for_req",
    "_read_blocks",
    "_send_read_release",
    "get_engine_name_with_dp",
    "get_engine_name_with_dp_tp",
    "_moriio_handshake",
    "get_finished",
    # A worker's step entry and what it calls, for tests/moriio/mixed.py,
    # which runs vLLM's decode and prefill steps (the harness does not).
    "start_load_kv",
    "_eager_handshake_all_dp_ranks",
    # The handshake 0.25 and 0.26 make on the read path (start_load_kv waits for it).
    "_background_moriio_handshake",
    "_await_reads_issued_this_step",
    # The sessions a read goes through, for mixed.py's read plans.
    "_get_built_session",
    # Where a release before 0.31 is sent from, once its reads succeeded, and what the read
    # path of 0.26 to 0.30 asks of a status.
    "_pop_done_transfers",
    "_is_sq_full_status",
    # The offsets a read before 0.31 computes for its (here empty) local blocks.
    "_compute_block_transfer_offsets",
]
# The receive state _read_blocks and _pop_done_transfers keep, which releases before 0.31 need
# set up as their __init__ sets it up (see Vllm.read_and_release).
RECV_STATE = ["_recving_transfers", "_recving_transfers_callback_addr", "_recving_transfers_start"]
# Step state of a decode worker that some releases' __init__ sets up and others lack (0.31 and
# 0.32 collect a step's Mamba reads; 0.25 and 0.26 keep their read-path handshakes' futures and
# set a WRITE flag when one ends), for tests/moriio/mixed.py.
STEP_STATE = ["_mamba_reads_this_step", "_handshake_futures", "write_ready_flags"]
# The one layer a read before 0.31 goes through.
LAYER = "model.layers.0.self_attn.attn"


def log(msg):
    print(f"  harness: {msg}", file=sys.stderr, flush=True)


def layouts(max_ranks):
    """Every (dp, tp) with dp * tp <= max_ranks, in (dp, tp) order."""
    return [(dp, tp) for dp in range(1, max_ranks + 1) for tp in range(1, max_ranks // dp + 1)]


def error_text(e):
    return f"{type(e).__name__}: {e}"


class Vllm:
    """The imported real modules and minimal worker classes carrying real methods."""

    def __init__(self, vllm_src, stubs):
        sys.path[:0] = [stubs, vllm_src]
        import importlib

        self.common = importlib.import_module(f"{MORIIO}.moriio_common")
        self.connector = importlib.import_module(f"{MORIIO}.moriio_connector")
        self.engine = importlib.import_module(f"{MORIIO}.moriio_engine")
        self.parallel_state = importlib.import_module("vllm.distributed.parallel_state")
        self.modules = {}
        src = os.path.realpath(vllm_src)
        self.src = src
        for name in REAL_MODULES:
            path = os.path.realpath(sys.modules[name].__file__)
            if not path.startswith(src + os.sep):
                raise SystemExit(f"{name} was imported from {path}, not from the wheel under {src}")
            self.modules[name] = os.path.relpath(path, src)
        worker = self.connector.MoRIIOConnectorWorker
        # A class holding the real methods (the functions themselves, taken from vLLM's class), so
        # they call each other as in vLLM; instances get only the attributes those methods read.
        # A release that lacks some of them (older ones have no flexible read and no holder
        # release) gets a class without them, named in self.missing_methods, so the questions
        # that need them fail by name instead of the whole import.
        self.Worker = type(
            "MiniWorker",
            (),
            {name: worker.__dict__[name] for name in WORKER_METHODS if name in worker.__dict__},
        )
        self.missing_methods = [name for name in WORKER_METHODS if name not in worker.__dict__]
        # Releases before 0.27 dial the TP rank their own mapping picks (no explicit one), and
        # their ReqMeta has no owner DP rank (they read DP rank 0).
        dial = inspect.signature(worker._moriio_handshake)
        self.dial_takes_tp_rank = "remote_tp_rank" in dial.parameters
        self.req_meta_has_owner = "remote_dp_rank" in self.common.ReqMeta.__dataclass_fields__
        # From 0.31 a request without local blocks is released at once by _read_blocks; before,
        # every request goes through a session and a read (Vllm.read_and_release).
        read = inspect.getsource(worker._read_blocks)
        self.releases_without_blocks = "if not any(local_block_ids)" in read
        self.recv_state = self._init_expressions(RECV_STATE)
        self.step_state = self._init_expressions(STEP_STATE)
        self.side_channel_expr = self._side_channel_expression()

    def _side_channel_expression(self):
        """vLLM's own expression for the handshake listener's port, taken from
        MoRIIOConnectorWorker.__init__ (which needs a GPU and MoRI to run), and a check that
        register_kv_caches passes that port to _moriio_handshake_listener and that the notify
        listener binds moriio_config.notify_port."""
        worker = self.connector.MoRIIOConnectorWorker
        init = ast.parse(textwrap.dedent(inspect.getsource(worker.__init__)))
        expr = None
        notify_wired = False
        for node in ast.walk(init):
            if isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names = [ast.unparse(t) for t in targets]
                if "self.side_channel_port" in names:
                    expr = node.value
                if "self.moriio_wrapper.notify_port" in names:
                    notify_wired = ast.unparse(node.value) == "self.moriio_config.notify_port"
        if expr is None or not notify_wired:
            raise SystemExit(
                "MoRIIOConnectorWorker.__init__ no longer sets self.side_channel_port and "
                "self.moriio_wrapper.notify_port = self.moriio_config.notify_port as vLLM 0.33 "
                "does: update tests/moriio/harness.py for this vLLM version"
            )
        reg = inspect.getsource(worker.register_kv_caches)
        if "self.side_channel_port" not in reg or "self._moriio_handshake_listener" not in reg:
            raise SystemExit(
                "register_kv_caches no longer starts _moriio_handshake_listener on "
                "self.side_channel_port: update tests/moriio/harness.py"
            )
        return compile(ast.Expression(expr), "<MoRIIOConnectorWorker.side_channel_port>", "eval")

    def _init_expressions(self, names):
        """vLLM's own initial values of the attributes `names` that MoRIIOConnectorWorker.__init__
        sets (those it does not set are left out), taken from its source as the listener port is."""
        worker = self.connector.MoRIIOConnectorWorker
        init = ast.parse(textwrap.dedent(inspect.getsource(worker.__init__)))
        found = {}
        for node in ast.walk(init):
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    name = ast.unparse(target).removeprefix("self.")
                    if name in names:
                        found[name] = compile(ast.Expression(node.value), f"<{name}>", "eval")
        return found

    def read_source(self, w, meta):
        """(source TP rank, flexible) of worker w's read of meta's request: vLLM's
        _resolve_read_source, or before 0.27 (which has none) the fixed mapping its _read_blocks
        uses, never flexible."""
        if hasattr(w, "_resolve_read_source"):
            return w._resolve_read_source(meta)
        return w._remote_tp_rank(meta.tp_size), False

    def read_and_release(self, w, request_id, meta):
        """Worker w reads meta's request and releases the prefill ranks, by vLLM's own
        _read_blocks_for_req. From 0.31 a request without local blocks is released at once. A
        release before 0.31 always takes the session and posts one read per layer, then releases
        from _pop_done_transfers once the reads succeeded: it gets one layer, stand-ins for the
        session, the offsets and the RDMA read (a read that succeeded; there is no MoRI here),
        and the receive state its __init__ sets up, so that its own _read_blocks picks the rank
        and the port and its own _pop_done_transfers sends the release."""
        if self.releases_without_blocks:
            return w._read_blocks_for_req(request_id, meta)
        for name, expr in self.recv_state.items():
            if name not in vars(w):
                setattr(w, name, eval(expr, vars(self.connector)))
        w.layer_name_to_local_kv_cache_metadata = {LAYER: []}
        w.layer_to_group = {LAYER: 0}
        w._has_mamba = False
        w.moriio_config.transfer_timeout = 30.0
        w._get_built_session = lambda engine_id: ([None], None)
        w._compute_block_transfer_offsets = lambda *args, **kwargs: ([0], [0], [1])
        w.moriio_wrapper.read_remote_data = lambda *args: SucceededRead()
        w._read_blocks_for_req(request_id, meta)
        w._pop_done_transfers()

    def listener_config(self, dp_size, dp, tp_size, tp, handshake_base, notify_base):
        """vLLM's real MoRIIOConfig.from_vllm_config for rank (dp, tp), with the TP rank and
        size vLLM's parallel state would report, and the listener port __init__ derives."""
        self.parallel_state.set_tp(tp, tp_size)
        extra = {
            "notify_port": str(notify_base),
            "handshake_port": str(handshake_base),
            "http_port": "8000",
            "host_ip": HOST,
            "read_mode": "true",
            # Required keys before vLLM 0.28 (the discovery heartbeat's proxy); these are the
            # defaults later releases use when they are absent, so no answer changes.
            "proxy_ip": "",
            "proxy_ping_port": "0",
        }
        config = types.SimpleNamespace(
            kv_transfer_config=types.SimpleNamespace(kv_connector_extra_config=extra),
            parallel_config=types.SimpleNamespace(
                data_parallel_rank=dp,
                data_parallel_size_local=dp_size,
                data_parallel_size=dp_size,
            ),
        )
        cfg = self.common.MoRIIOConfig.from_vllm_config(config)
        me = types.SimpleNamespace(moriio_config=cfg, dp_rank=cfg.dp_rank, tp_rank=cfg.tp_rank)
        handshake_listen = eval(self.side_channel_expr, vars(self.connector), {"self": me})
        return cfg, handshake_listen

    def dial(self, w, host, base, tp_size, engine_id, dp, tp):
        """vLLM's real _moriio_handshake from worker w to rank (dp, tp) (tp None: the rank its
        own mapping picks). A release without the explicit TP rank argument (before 0.27) dials
        the rank its mapping picks, so it is asked only for that rank."""
        if self.dial_takes_tp_rank:
            return w._moriio_handshake(host, base, tp_size, engine_id, dp, tp)
        if tp is not None and tp != w._remote_tp_rank(tp_size):
            raise TypeError(f"this release dials only the mapped TP rank, not rank {tp}")
        return w._moriio_handshake(host, base, tp_size, engine_id, dp)

    def release(self, w, transfer_id, host, ports):
        """Worker w's release of a READ to the given notify ports: vLLM's _send_read_release, or,
        in a release without it (before 0.33), the send_notify call _pop_done_transfers makes
        there for its one port."""
        if hasattr(w, "_send_read_release"):
            return w._send_read_release(transfer_id, host, ports)
        for port in ports:
            w.moriio_wrapper.send_notify(
                transfer_id,
                host,
                port,
                message_type="release",
                message_fields={"consumer_tp_size": w.world_size},
            )

    def decode_worker(self, world_size, tp_rank, dp_rank, use_mla, backend, wrapper=None):
        w = self.Worker()
        w.world_size = world_size
        w.tp_rank = tp_rank
        w.dp_rank = dp_rank
        w.use_mla = use_mla
        w.moriio_config = types.SimpleNamespace(backend=backend)
        w.mode = self.common.MoRIIOMode.READ
        w.moriio_wrapper = wrapper
        return w

    def req_meta(self, prefill_dp, prefill_tp, owner):
        """A real ReqMeta as the decode side builds it from kv_transfer_params; no local blocks,
        so _read_blocks releases at once (the path of a request aborted before allocation),
        with the same notify ports a completed read releases to in _pop_done_transfers."""
        # A release without an owner DP rank reads DP rank 0; its meta cannot name another.
        owner_field = {"remote_dp_rank": owner} if self.req_meta_has_owner or owner else {}
        return self.common.ReqMeta(
            transfer_id=TRANSFER_ID,
            local_block_ids=[[]],
            remote_block_ids=[[1, 2, 3]],
            remote_host=HOST,
            remote_port=HANDSHAKE_BASE,
            remote_handshake_port=HANDSHAKE_BASE,
            remote_notify_port=NOTIFY_BASE,
            remote_engine_id=f"{HOST}:{HANDSHAKE_BASE}",
            tp_size=prefill_tp,
            remote_dp_size=prefill_dp,
            **owner_field,
        )

    def recording_wrapper(self):
        """A real MoRIIOWrapper whose send_notify runs unchanged but finds, for every path, a
        socket that records what it is sent instead of a ZeroMQ DEALER."""
        wrapper = self.engine.MoRIIOWrapper()
        wrapper.paths = RecordingPaths()
        return wrapper, wrapper.paths.sent


class SucceededRead:
    """A MoRI transfer status whose read succeeded (a stand-in: the read itself is not asked)."""

    def Succeeded(self):  # noqa: N802 - MoRI's name
        return True

    def Failed(self):  # noqa: N802 - MoRI's name
        return False


class RecordingSocket:
    def __init__(self, path, sent):
        self.path, self.sent = path, sent

    def send(self, data):
        self.sent.append((self.path, bytes(data)))


class RecordingPaths(dict):
    """MoRIIOWrapper.paths (its DEALER per notify path) that has a recording socket for every
    path, so send_notify never opens one."""

    def __init__(self):
        super().__init__()
        self.sent = []

    def __contains__(self, path):
        return True

    def __getitem__(self, path):
        return RecordingSocket(path, self.sent)


def port_of(path):
    return int(path.rsplit(":", 1)[1])


def pure_rules(v, max_ranks):
    import msgpack

    all_layouts = layouts(max_ranks)
    out = {"combos": [], "expected_acks": [], "ports": [], "heads": []}

    # Ports: every rank of every prefill layout, as vLLM's listeners bind and its dialers dial.
    dial_rank = {}
    for dp_size, tp_size in all_layouts:
        ranks = []
        for dp in range(dp_size):
            for tp in range(tp_size):
                cfg, handshake_listen = v.listener_config(
                    dp_size, dp, tp_size, tp, HANDSHAKE_BASE, NOTIFY_BASE
                )
                dialed = []

                class Dialed(Exception):
                    pass

                def recording_ctx(socket_type, addr):
                    dialed.append(addr)
                    raise Dialed()

                saved = v.connector.zmq_ctx
                v.connector.zmq_ctx = recording_ctx
                try:
                    w = v.decode_worker(tp_size, tp, 0, False, "rdma")
                    try:
                        v.dial(w, HOST, HANDSHAKE_BASE, tp_size, "e", dp, tp)
                    except Dialed:
                        pass
                finally:
                    v.connector.zmq_ctx = saved
                # The release dial: a decode rank of equal TP size reading rank (dp, tp). Before
                # 0.27 a request cannot name its owner and is read from DP rank 0, so no release
                # goes to another DP rank (None).
                release_dial = None
                if v.req_meta_has_owner or dp == 0:
                    wrapper, sent = v.recording_wrapper()
                    w = v.decode_worker(tp_size, tp, 0, False, "rdma", wrapper)
                    v.read_and_release(w, REQUEST_ID, v.req_meta(dp_size, tp_size, dp))
                    release_ports = [port_of(p) for p, _ in sent]
                    if len(release_ports) != 1:
                        raise SystemExit(f"rank ({dp},{tp}): released to {release_ports}")
                    release_dial = release_ports[0]
                    dial_rank[(dp_size, tp_size, release_dial)] = (dp, tp)
                if len(dialed) != 1:
                    raise SystemExit(f"rank ({dp},{tp}): dialed {dialed}")
                ranks.append(
                    {
                        "dp": dp,
                        "tp": tp,
                        "handshake_listen": handshake_listen,
                        "notify_listen": cfg.notify_port,
                        "handshake_dial": port_of(dialed[0]),
                        "release_dial": release_dial,
                    }
                )
        out["ports"].append({"prefill": [dp_size, tp_size], "ranks": ranks})
    log(f"ports: {len(out['ports'])} prefill layouts")

    for producer in range(1, max_ranks + 1):
        for consumer in range(1, max_ranks + 1):
            rec = {"producer": producer, "consumer": consumer}
            try:
                rec["value"] = v.connector.get_moriio_expected_ack_count(producer, consumer)
            except Exception as e:  # noqa: BLE001 - vLLM's refusal is the answer
                rec["error"] = error_text(e)
            out["expected_acks"].append(rec)

    for decode_tp in range(1, max_ranks + 1):
        for prefill_tp in range(1, max_ranks + 1):
            for kv_heads in range(1, max_ranks + 1):
                for mla in (False, True):
                    rec = {"decode_tp": decode_tp, "prefill_tp": prefill_tp, "kv_heads": kv_heads, "mla": mla}
                    try:
                        v.connector.validate_moriio_heterogeneous_tp_kv_heads(
                            local_tp_size=decode_tp,
                            remote_tp_size=prefill_tp,
                            total_num_kv_heads=kv_heads,
                            is_mla=mla,
                        )
                        rec["error"] = None
                    except Exception as e:  # noqa: BLE001
                        rec["error"] = error_text(e)
                    out["heads"].append(rec)
    log(f"head guard: {len(out['heads'])} cases")

    out["writes"] = write_mappings(v, max_ranks)
    log(f"WRITE mapping: {len(out['writes']['shapes'])} shapes")

    # Source, release targets and acks: every decode layout against every prefill layout.
    for d_dp, d_tp in all_layouts:
        for p_dp, p_tp in all_layouts:
            for mla in (False, True):
                flexible_shape = d_tp == 1 and mla and p_dp == 1 and p_tp > 1
                backends = ["rdma", "xgmi"] if flexible_shape else ["rdma"]
                reads = 2 * p_tp + 1 if flexible_shape else 2
                for backend in backends:
                    for owner in sorted({0, p_dp - 1}):
                        out["combos"].append(
                            combo(v, msgpack, dial_rank, d_dp, d_tp, p_dp, p_tp, mla, backend, owner, reads)
                        )
    log(f"source, release and ack rules: {len(out['combos'])} layout pairs")
    return out


WRITE_HEADS = list(range(1, 17)) + [32, 64, 128]


def write_mappings(v, max_ranks):
    """vLLM's WRITE-mode TP mapping (moriio_tp_mapping.compute_write_tp_mapping, 0.33 on) for
    every pair of TP sizes up to max_ranks, KV head counts WRITE_HEADS (MLA once), with and
    without recurrent state: each prefill rank's targets, or vLLM's refusal. A release without
    the module (before 0.33) pairs prefill TP rank k with decode TP rank k in its write path and
    has no mapping to ask: {"module": null}."""
    import importlib

    try:
        mapping = importlib.import_module(f"{MORIIO}.moriio_tp_mapping")
    except ModuleNotFoundError:
        return {"module": None, "shapes": []}
    path = os.path.realpath(mapping.__file__)
    if not path.startswith(v.src + os.sep):
        raise SystemExit(f"{mapping.__name__} was imported from {path}, not from the wheel under {v.src}")
    shapes = []
    for producer in range(1, max_ranks + 1):
        for consumer in range(1, max_ranks + 1):
            for mla in (False, True):
                for heads in [1] if mla else WRITE_HEADS:
                    for mamba in (False, True):
                        rec = {"prefill_tp": producer, "decode_tp": consumer, "kv_heads": heads,
                               "mla": mla, "mamba": mamba}
                        ranks = []
                        try:
                            for rank in range(producer):
                                m = mapping.compute_write_tp_mapping(rank, producer, consumer, heads, mla, mamba)
                                ranks.append(
                                    {
                                        "local_heads": m.local_num_heads,
                                        "remote_heads": m.remote_num_heads,
                                        "targets": [
                                            [t.tp_rank, t.local_head, t.remote_head, t.num_heads, t.local_slice,
                                             t.local_slices, t.remote_slice, t.remote_slices, t.num_writers]
                                            for t in m.targets
                                        ],
                                    }
                                )
                            rec["ranks"] = ranks
                        except Exception as e:  # noqa: BLE001 - vLLM's refusal is the answer
                            rec["error"] = error_text(e)
                        shapes.append(rec)
    return {"module": mapping.__name__, "shapes": shapes}


def combo(v, msgpack, dial_rank, d_dp, d_tp, p_dp, p_tp, mla, backend, owner, reads):
    rec = {
        "decode": [d_dp, d_tp],
        "prefill": [p_dp, p_tp],
        "mla": mla,
        "backend": backend,
        "owner": owner,
        "ranks": [],
        "acks": [],
    }
    # First read's releases of every decode rank, for the ack rule.
    first_releases = {}
    for d in range(d_dp):
        for r in range(d_tp):
            rank = {"dp": d, "tp": r}
            resolver = v.decode_worker(d_tp, r, d, mla, backend)
            wrapper, sent = v.recording_wrapper()
            releaser = v.decode_worker(d_tp, r, d, mla, backend, wrapper)
            try:
                meta = v.req_meta(p_dp, p_tp, owner)
                # Each read as [source TP rank, flexible, [ports released to]] (compact: there
                # are some 170,000 of them); the distinct release payloads once per rank.
                picks, payloads = [], []
                for k in range(reads):
                    tp, flexible = v.read_source(resolver, meta)
                    del sent[:]
                    v.read_and_release(releaser, REQUEST_ID, meta)
                    for _, data in sent:
                        payload = msgpack.loads(data)
                        if payload not in payloads:
                            payloads.append(payload)
                    if k == 0:
                        first_releases[(d, r)] = list(sent)
                    picks.append([tp, flexible, [port_of(path) for path, _ in sent]])
                rank["reads"] = picks
                rank["payloads"] = payloads
            except Exception as e:  # noqa: BLE001
                rank["error"] = error_text(e)
            rec["ranks"].append(rank)
    if any("error" in rank for rank in rec["ranks"]):
        return rec
    # Acks: the releases one decode DP group sends for one request, delivered to the prefill
    # rank each was addressed to, through the real notify handling (MoRIIOWrapper._handle_message,
    # as its listener thread calls it) and the real get_finished (pop_finished_req_ids, then
    # resolve_moriio_transfer_ack).
    for group in sorted({0, d_dp - 1}):
        try:
            expected = v.connector.get_moriio_expected_ack_count(p_tp, d_tp)
        except Exception as e:  # noqa: BLE001
            expected = None
        v.common.set_role(v.common.ROLE.PRODUCER)
        inbox = {tp: [] for tp in range(p_tp)}
        for r in range(d_tp):
            for path, data in first_releases[(group, r)]:
                dp, tp = dial_rank[(p_dp, p_tp, port_of(path))]
                if dp != owner:
                    raise SystemExit(f"a release went to DP rank {dp}, not the owner {owner}")
                inbox[tp].append(data)
        ranks = []
        for tp in range(p_tp):
            wrapper = v.engine.MoRIIOWrapper(tp_rank=tp, dp_rank=owner)
            prefill = v.Worker()
            prefill.is_producer = True
            prefill.mode = v.common.MoRIIOMode.READ
            prefill.moriio_wrapper = wrapper
            prefill.world_size = p_tp
            prefill.transfer_id_to_request_id = {TRANSFER_ID: REQUEST_ID}
            prefill._pending_unmapped_acks = []
            prefill._consumer_notification_counts = {}
            prefill._completed_consumer_notifications = set()
            reported = []
            done, _ = prefill.get_finished()
            if REQUEST_ID in done:
                reported.append(0)
            for i, data in enumerate(inbox[tp]):
                wrapper._handle_message(data)
                done, _ = prefill.get_finished()
                if REQUEST_ID in done:
                    reported.append(i + 1)
            ranks.append({"tp": tp, "received": len(inbox[tp]), "reported": reported})
        rec["acks"].append({"group": group, "expected": expected, "ranks": ranks})
    return rec


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def wire_rows(v):
    """vLLM against vLLM on loopback: proves the stubs leave the wire code working."""
    rows = []
    for label, p_tp, p_rank, d_tp, d_rank, explicit in [
        ("P TP2 rank (0,1), D TP2 rank 1 (fixed mapping)", 2, 1, 2, 1, None),
        ("P TP4 rank (0,3), D TP1 MLA (flexible: explicit TP rank)", 4, 3, 1, 0, 3),
    ]:
        if explicit is not None and not v.dial_takes_tp_rank:
            # Before 0.27 a dial cannot name its TP rank (no flexible read): nothing to ask.
            continue
        rows.append(wire_handshake(v, label, p_tp, p_rank, d_tp, d_rank, explicit))
    rows.append(wire_release(v))
    return rows


def sample_metadata(v, base):
    """A MoRIIOAgentMetadata as register_kv_caches builds it, with vLLM 0.33's per-layer maps
    where the release has them (0.33 on)."""
    fields = v.common.MoRIIOAgentMetadata.__struct_fields__
    maps = {
        "kv_head_layouts": {"model.layers.0.self_attn.attn": [1, 2, 3]},
        "attention_block_sizes": {"model.layers.0.self_attn.attn": 16},
    }
    return v.common.MoRIIOAgentMetadata(
        engine_id=f"{HOST}:{base}",
        agent_metadata=b"\x00mori-engine-desc\xff",
        kv_caches_base_addr=[0x7F0000000000, 0x7F0000400000],
        num_blocks=128,
        block_len=36864,
        attn_backend_name="ROCM_AITER_MLA",
        **{name: value for name, value in maps.items() if name in fields},
    )


LAYER_MAP = {
    "model.layers.0.self_attn.attn": [b"packed-memory-desc-0"],
    "model.layers.1.self_attn.attn": [b"packed-memory-desc-1"],
}


def start_handshake_listener(v, p_tp, p_rank):
    """vLLM's real _moriio_handshake_listener for rank p_rank of a P TP p_tp engine, bound where
    vLLM's __init__ puts it (side_channel_port), with a base chosen so that port is free on this
    machine. Returns the thread, the base, the listener's port and the metadata it serves."""
    port = free_port()
    _, listen = v.listener_config(1, 0, p_tp, p_rank, port, NOTIFY_BASE)
    base = port - (listen - port)
    _, listen = v.listener_config(1, 0, p_tp, p_rank, base, NOTIFY_BASE)
    metadata = sample_metadata(v, base)
    ready = threading.Event()
    thread = threading.Thread(
        target=v.connector.MoRIIOConnectorWorker._moriio_handshake_listener,
        args=(metadata, ready, listen, p_rank, 0, LAYER_MAP),
        daemon=True,
    )
    thread.start()
    if not ready.wait(10):
        raise RuntimeError("the listener did not bind in 10 s")
    return thread, base, listen, metadata


def vllm_dial(v, base, p_tp, d_tp, d_rank, explicit, timeout):
    """vLLM's real _moriio_handshake from decode rank d_rank against the engine at base. Returns
    the dialer, the engine id it filed the answer under, and {"agents": ...} or {"error": ...}, or
    {} when no answer came within timeout (the dial then blocks in its daemon thread, as vLLM's
    would)."""

    class Engine:
        remote_engine_ip = None
        registered = []

        def register_remote_engine(self, packed):
            self.registered.append(packed)
            return "remote-engine-key"

    dialer = v.decode_worker(d_tp, d_rank, 0, True, "rdma", Engine())
    dialer.local_kv_cache_metadata = []
    dialer.remote_kv_cache_metadata = []
    dialer.layer_name_to_remote_kv_cache_metadata = {}
    dialer.remote_moriio_metadata = {}
    eid = f"{HOST}:{base}_dp0"
    result = {}

    def dial():
        try:
            result["agents"] = v.dial(dialer, HOST, base, p_tp, eid, 0, explicit)
        except Exception as e:  # noqa: BLE001
            result["error"] = error_text(e)

    t = threading.Thread(target=dial, daemon=True)
    t.start()
    t.join(timeout)
    return dialer, eid, dict(result)


def wire_handshake(v, label, p_tp, p_rank, d_tp, d_rank, explicit):
    row = {"interaction": "handshake", "direction": "vllm->vllm", "layout": label}
    try:
        _, base, listen, metadata = start_handshake_listener(v, p_tp, p_rank)
        dialer, eid, result = vllm_dial(v, base, p_tp, d_tp, d_rank, explicit, 10)
        if not result:
            raise RuntimeError(f"the dialer got no answer in 10 s (listening at {listen})")
        if "error" in result:
            raise RuntimeError(result["error"])
        checks = [
            (result["agents"] == {"remote-engine-key"}, f"agents {result['agents']}"),
            (dialer.moriio_wrapper.registered == [metadata.agent_metadata], "registered engine desc"),
            (dialer.moriio_wrapper.remote_engine_ip == HOST, "remote_engine_ip"),
            (dialer.remote_moriio_metadata.get(eid) == metadata, "decoded MoRIIOAgentMetadata"),
            (dialer.layer_name_to_remote_kv_cache_metadata.get(eid) == LAYER_MAP, "layer map"),
        ]
        failed = [what for ok, what in checks if not ok]
        row["ok"] = not failed
        row["detail"] = (
            f"listener at base+{listen - base}, dialer reached it; metadata and layer map round-trip"
            if not failed
            else "wrong: " + ", ".join(failed)
        )
    except Exception as e:  # noqa: BLE001
        row["ok"] = False
        row["detail"] = error_text(e)
    return row


def wire_release(v):
    """Two decode ranks of a D4 release one P2 rank (fan-in 2): vLLM's _send_read_release over
    a real DEALER to vLLM's async_wait_reqid ROUTER; pop_finished_req_ids, then
    resolve_moriio_transfer_ack completes on the second ack only."""
    row = {
        "interaction": "release notify",
        "direction": "vllm->vllm",
        "layout": "P TP2 rank (0,1) <- D TP4 ranks 2 and 3 (fan-in 2)",
    }
    senders = []
    try:
        port = free_port()
        cfg, _ = v.listener_config(1, 0, 2, 1, HANDSHAKE_BASE, port - 1)
        producer = v.engine.MoRIIOWrapper(tp_rank=1, dp_rank=0)
        producer.notify_port = cfg.notify_port
        v.common.set_role(v.common.ROLE.PRODUCER)
        producer.async_wait_reqid()
        counts, completed, outcomes, acks = {}, set(), [], []
        for rank in (2, 3):
            wrapper = v.engine.MoRIIOWrapper(tp_rank=rank, dp_rank=0)
            senders.append(wrapper)
            w = v.decode_worker(4, rank, 0, False, "rdma", wrapper)
            # Released exactly as _pop_done_transfers does once the read landed.
            v.release(w, TRANSFER_ID, HOST, (str(cfg.notify_port),))
            deadline = time.monotonic() + 10
            popped = []
            while not popped and time.monotonic() < deadline:
                popped = producer.pop_finished_req_ids()
                if not popped:
                    time.sleep(0.005)
            if not popped:
                raise RuntimeError(f"no release reached the notify listener at {cfg.notify_port} in 10 s")
            acks.extend(popped)
            for ack in popped:
                outcomes.append(
                    v.connector.resolve_moriio_transfer_ack(
                        ack,
                        producer_tp_size=2,
                        live_transfer_ids={TRANSFER_ID},
                        notification_counts=counts,
                        completed_transfer_ids=completed,
                    )
                )
        want_ack = v.common.MoRIIOTransferAck(TRANSFER_ID, 4)
        ok = acks == [want_ack, want_ack] and outcomes == [None, TRANSFER_ID]
        row["ok"] = ok
        row["detail"] = (
            f"2 acks {tuple(want_ack)} popped; resolve_moriio_transfer_ack gave {outcomes}"
            if ok
            else f"acks {acks}, outcomes {outcomes}"
        )
    except Exception as e:  # noqa: BLE001
        row["ok"] = False
        row["detail"] = error_text(e)
    finally:
        for wrapper in senders:
            wrapper.shutdown()
    return row


# Every pdkv message at vLLM's listeners (--messages, written by xtask/src/moriio/messages.rs).
PROBE_ID = "tx-pdkv-probe"
# How long a live listener has to handle a message, or to answer the probe after it.
ANSWER_TIMEOUT = 5.0
# How long the probe waits at a listener whose thread has already ended (threading says so, and
# the thread closed its socket on the way out): nothing can answer it, so this only shows the
# probe going unanswered.
DEAD_GRACE = 0.1


class ThreadEnds:
    """The exception that ended each watched listener thread, through threading.excepthook (a
    listener thread that raises just ends: vLLM never joins it)."""

    def __init__(self):
        self.watched = set()
        self.errors = {}
        self.previous = threading.excepthook
        threading.excepthook = self.hook

    def hook(self, args):
        if args.thread in self.watched:
            self.errors[args.thread] = error_text(args.exc_value)
        else:
            self.previous(args)

    def watch(self, thread):
        self.watched.add(thread)

    def restore(self):
        threading.excepthook = self.previous


def wait_for(condition, timeout):
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.002)
    return condition()


def pdkv_dealer(identity, port):
    """A DEALER as pdkv's decode rank opens one (backend-rdma/src/decode_rank.rs: dial and
    notifier): its routing identity is the rank's name, and each message is sent as the frames
    given, nothing added."""
    import zmq

    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, identity.encode())
    sock.setsockopt(zmq.LINGER, 0)
    # The notify listener binds in its own thread, perhaps after this connects: retry within
    # milliseconds rather than ZeroMQ's default 100 ms (when to connect, not what is sent).
    sock.setsockopt(zmq.RECONNECT_IVL, 5)
    sock.connect(f"tcp://{HOST}:{port}")
    return sock


def deliver_notify(v, frames, identity, ends):
    """Sends one message to a fresh notify listener of a prefill rank (vLLM's own
    MoRIIOWrapper.async_wait_reqid thread, producer role, READ mode), then vLLM's own release
    (_send_read_release) to see whether the listener still serves."""
    port = free_port()
    listener = v.engine.MoRIIOWrapper(tp_rank=0, dp_rank=0)
    listener.notify_port = port
    handled = []
    real = listener._handle_message

    def observed(msg):
        # vLLM's own handler, unchanged; its outcome is noted so the probe is sent only once
        # the message was handled (ZeroMQ does not order two connections' messages).
        try:
            real(msg)
        except Exception as e:
            handled.append(error_text(e))
            raise
        handled.append(None)

    listener._handle_message = observed
    v.common.set_role(v.common.ROLE.PRODUCER)
    listener.async_wait_reqid()
    thread = listener.notify_thread
    ends.watch(thread)
    sock = pdkv_dealer(identity, port)
    prober = v.engine.MoRIIOWrapper(tp_rank=0, dp_rank=0)
    try:
        sock.send_multipart(frames)
        wait_for(lambda: handled or not thread.is_alive(), ANSWER_TIMEOUT)
        if handled and handled[0] is not None:
            # The handler raised; the thread ends once the listener's socket is closed.
            wait_for(lambda: not thread.is_alive(), ANSWER_TIMEOUT)
        delivered = bool(handled) or not thread.is_alive()
        w = v.decode_worker(1, 0, 0, False, "rdma", prober)
        v.release(w, PROBE_ID, HOST, (str(port),))
        probed, acks = False, []

        def pop():
            nonlocal probed
            for ack in listener.pop_finished_req_ids():
                if ack.transfer_id == PROBE_ID:
                    probed = True
                else:
                    acks.append([ack.transfer_id, ack.consumer_tp_size])
            return probed

        wait_for(pop, ANSWER_TIMEOUT if thread.is_alive() else DEAD_GRACE)
        alive = probed and thread.is_alive()
        error = ends.errors.get(thread) or (handled[0] if handled else None)
        if alive:
            did = []
            if acks:
                did.append("counted " + ", ".join(f"ack ({t!r}, {n})" for t, n in acks))
            if listener.done_remote_allocate_req_dict:
                did.append("kept a WRITE allocation for " + ", ".join(map(repr, listener.done_remote_allocate_req_dict)))
            did.append("served the probe release")
            did = "; ".join(did)
        elif not delivered:
            did = f"nothing handled in {ANSWER_TIMEOUT:.0f} s"
        else:
            did = f"thread ended: {error}" if error else "the probe release went unanswered"
        return {"delivered": delivered, "alive": alive, "error": error, "acks": acks, "did": did}
    finally:
        sock.close(linger=0)
        prober.shutdown()


def send_for_replies(v, frames, identity, thread, listen):
    """Sends frames to a handshake listener from a pdkv DEALER; returns the messages it
    answered with (two after get_meta_msg) once it has answered both or its thread ended."""
    import zmq

    sock = pdkv_dealer(identity, listen)
    replies = []
    try:
        sock.send_multipart(frames)
        deadline = time.monotonic() + ANSWER_TIMEOUT
        while len(replies) < 2 and thread.is_alive() and time.monotonic() < deadline:
            if sock.poll(10, zmq.POLLIN):
                replies.append(sock.recv_multipart())
    finally:
        sock.close(linger=0)
    return replies


def deliver_handshake(v, frames, identity, ends):
    """Sends one message to a fresh handshake listener of a prefill rank (vLLM's own
    _moriio_handshake_listener), then a real vLLM _moriio_handshake dial to see whether it
    still answers."""
    thread, base, listen, _ = start_handshake_listener(v, 1, 0)
    ends.watch(thread)
    replies = send_for_replies(v, frames, identity, thread, listen)
    delivered = bool(replies) or not thread.is_alive()
    _, _, result = vllm_dial(v, base, 1, 1, 0, None, ANSWER_TIMEOUT if thread.is_alive() else DEAD_GRACE)
    alive = "agents" in result and thread.is_alive()
    error = ends.errors.get(thread) or result.get("error")
    if alive:
        sizes = " and ".join(f"{len(r[-1])} bytes" for r in replies)
        answered = f"answered {len(replies)} message(s) ({sizes}); " if replies else ""
        did = answered + "served vLLM's dial"
    elif not delivered:
        did = f"no answer and no end in {ANSWER_TIMEOUT:.0f} s"
    else:
        did = f"thread ended: {error}" if error else "vLLM's dial went unanswered"
    return {"delivered": delivered, "alive": alive, "error": error, "acks": [], "did": did}


def every_message(v, path):
    """Delivers every message xtask listed to a fresh vLLM listener each, so one listener's end
    cannot hide the next message's effect; also asks a vLLM handshake listener for its metadata
    the way pdkv's decode rank dials, so xtask can decode what vLLM 0.33 advertises."""
    with open(path) as f:
        doc = json.load(f)
    identity = doc["identity"]
    ends = ThreadEnds()
    results = []
    try:
        for m in doc["messages"]:
            frames = [bytes.fromhex(frame) for frame in m["frames"]]
            deliver = deliver_notify if m["socket"] == "notify" else deliver_handshake
            try:
                rec = deliver(v, frames, identity, ends)
            except Exception as e:  # noqa: BLE001 - the harness itself could not deliver it
                rec = {"delivered": False, "alive": False, "error": error_text(e), "acks": [], "did": error_text(e)}
            rec.update({"id": m["id"], "name": m["name"], "socket": m["socket"]})
            results.append(rec)
        metadata = {"frames": [], "error": None}
        try:
            thread, _, listen, _ = start_handshake_listener(v, 1, 0)
            replies = send_for_replies(v, [v.common.MoRIIOConstants.GET_META_MSG], identity, thread, listen)
            metadata["frames"] = [[frame.hex() for frame in reply] for reply in replies]
        except Exception as e:  # noqa: BLE001
            metadata["error"] = error_text(e)
    finally:
        ends.restore()
    dead = sum(not r["alive"] for r in results)
    log(f"every pdkv message: {len(results)} deliveries, {dead} ended a listener")
    return results, metadata


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--vllm-src", required=True, help="the files extracted from the vLLM wheel")
    parser.add_argument("--vllm-version", required=True)
    parser.add_argument("--stubs", required=True)
    parser.add_argument("--max-ranks", type=int, default=16)
    parser.add_argument("--out", required=True)
    parser.add_argument("--messages", help="pdkv's messages to deliver to vLLM's listeners (JSON, from xtask)")
    parser.add_argument("--verbose", action="store_true", help="show vLLM's own log lines")
    args = parser.parse_args()
    logging.basicConfig(stream=sys.stderr, level=logging.WARNING)
    # "MoRIIO is not available" (no mori.io: expected here) and the like stay quiet unless asked.
    logging.getLogger("vllm").setLevel(logging.INFO if args.verbose else logging.CRITICAL)
    started = time.monotonic()
    v = Vllm(args.vllm_src, args.stubs)
    doc = {
        "vllm_version": args.vllm_version,
        "python": "%d.%d.%d" % sys.version_info[:3],
        "max_ranks": args.max_ranks,
        "modules": v.modules,
    }
    doc.update(pure_rules(v, args.max_ranks))
    doc["wire"] = wire_rows(v)
    doc["messages"], doc["vllm_metadata"] = (
        every_message(v, args.messages) if args.messages else ([], {"frames": [], "error": "no --messages given"})
    )
    with open(args.out + ".tmp", "w") as f:
        json.dump(doc, f, separators=(",", ":"))
    os.replace(args.out + ".tmp", args.out)
    log(f"done in {time.monotonic() - started:.1f} s")
    sys.stderr.flush()
    # Listener threads block in recv for ever (as in vLLM); skip interpreter teardown.
    os._exit(0)


if __name__ == "__main__":
    main()
