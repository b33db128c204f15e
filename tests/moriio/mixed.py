"""The foreign side of a mixed deployment: a vLLM release's real MoRIIO code against pdkv.

`pdkv cluster DEPLOYMENT --foreign-side prefill|decode --foreign-driver PROGRAM` runs this file
(`mixed.py --vllm-src DIR --stubs DIR [--verbose]`) to play every engine of one side, while real
pdkv connector processes play the other. Every decision is made by vLLM's own functions and
methods, imported by harness.py from the extracted wheel and called on objects that carry only
the attributes they read. Two things are stand-ins: the MoRI engine (register_remote_engine,
MemoryDesc.unpack and create_session record the bytes they are given, which is how a read plan
names the session it goes through) and the decode TP group's CPU all-reduce (a MIN over the
group's worker threads). A killed prefill rank is a process-equivalent within this one: its
listeners end by raising on a frame they refuse, as vLLM's own do, and its tables are dropped.
Logs go to stderr; stdout carries protocol lines only.

Protocol (line JSON both ways, every object has "op"; byte strings are lowercase hex; ids are
strings; engines are numbered per side from 0):
  cluster -> driver
    setup {side, rules:"vllm-0.33" (or an older dialect's, for a release before 0.33), host, model:{use_mla, kv_heads, layers, block_size_tokens},
           engines:[{engine, dp, tp, handshake_port_base, notify_port_base, engine_id}] (this side),
           ranks:[{engine, dp, tp, metadata:{engine_id, agent_metadata, kv_caches_base_addr,
                   num_blocks, block_len, attn_backend_name}, layers:[{name, descs}]}] (prefill)}
        prefill: each rank binds vLLM's handshake and notify listeners where vLLM 0.33 puts them;
        decode: one vLLM decode worker, with its own MoRIIOWrapper, per rank.
    recv {request, engine, dp, params, local_block_ids}   (decode) every TP rank of group
        (engine, dp) runs vLLM's decode step for the request: the eager handshake with every
        rank of the remote engine it has no session with, then the read's release.
    register {transfer_id, request, engine, dp, tp}       (prefill) the rank holds the transfer
        (the scheduler maps it; the worker gets the table with its next step)
    retire {transfer_id, engine, dp, tp}                  (prefill) the rank forgets it
    kill {engine, dp, tp}                                 (prefill) the rank's process dies: its
        listeners stop (each raises on a frame it refuses and closes its socket), and its worker
        and scheduler tables are dropped with everything they held
    restart {rank}                                        (prefill) the rank starts afresh: new
        listeners on its ports, answering with `rank` (as in setup: the restarted data-plane
        server's descriptors), a new worker and empty tables
    shutdown
  driver -> cluster
    ready                            setup done: every listener bound, every worker made
    error {detail}                   fatal (a listener could not bind, a bad setup); exit 1
    read_plan {request, transfer_id, engine, dp, tp, source_dp, source_tp, block_ids,
               engine_desc, memory_descs}
                                     (decode) the read vLLM's _read_blocks would post for the
                                     request on rank (engine, dp, tp), which MoRI cannot post
                                     here: the prefill rank and block ids it reads, and its
                                     session: the agent_metadata of the peer metadata and the
                                     remote memory descriptors of the sessions _get_built_session
                                     returns
    received {request, ok, error?}   (decode) once every TP rank of the group is done
    registered {transfer_id, engine, dp, tp}  (prefill) a step installed the table holding a
                                     registered transfer in the rank's worker; the cluster
                                     answers the proxy, and so dispatches to decode, only after
                                     every live rank of the group said this, as vLLM's engine
                                     answers after the step that computed the prefill
    restarted {engine, dp, tp}       (prefill) the restarted rank's listeners are bound
    finished {transfer_id, engine, dp, tp}   (prefill) vLLM's get_finished, polled every ~2 ms,
                                     resolved the transfer on that rank (never deduplicated)
    problem {detail}                 not fatal: a bad line, a listener thread that died
    bye {stats}                      after shutdown or stdin EOF; then exit 0
"""

import argparse
import collections
import hashlib
import inspect
import json
import logging
import os
import queue
import sys
import threading
import time
import types
from concurrent.futures import ThreadPoolExecutor

import zmq

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

POLL_S = 0.002  # vLLM's engine calls get_finished once a step; pdkv's steps are ~ms apart.
BIND_WAIT_S = 10.0
# What a kill sends each listener of the rank: frames vLLM's own listeners refuse by raising,
# which ends the listener thread and closes its socket (zmq_ctx's finally), so the port is free
# for the restarted rank: the handshake listener raises on any message but get_meta_msg and
# pop_done_recv, the notify listener on one that is neither a MessagePack map nor UTF-8.
KILL_FRAMES = {"handshake": b"pdkv-driver: kill", "notify": b"\xff\xfe"}


def log(msg):
    print(f"  vllm-driver: {msg}", file=sys.stderr, flush=True)


def rank_name(e, d, t):
    return f"e{e}.dp{d}.tp{t}"


def rank_config(v, eng, d, t):
    """vLLM's MoRIIOConfig for rank (d, t) of an engine, and its handshake listener's port."""
    return v.listener_config(eng["dp"], d, eng["tp"], t, eng["handshake_port_base"], eng["notify_port_base"])


def rank_wrapper(v, cfg):
    """The rank's MoRIIOWrapper, made and given its notify port as MoRIIOConnectorWorker.__init__ does."""
    wrapper = v.engine.MoRIIOWrapper(
        tp_rank=cfg.tp_rank, dp_rank=cfg.dp_rank, transfer_timeout=cfg.transfer_timeout
    )
    wrapper.notify_port = cfg.notify_port
    return wrapper


class Out:
    """The protocol stream. It writes to a duplicate of the original stdout and points fd 1 at
    stderr, so nothing else (a stray print, a C library) can put a line into the protocol."""

    def __init__(self):
        self.stream = os.fdopen(os.dup(1), "w", encoding="utf-8")
        os.dup2(2, 1)
        sys.stdout = sys.stderr
        self.lock = threading.Lock()
        self.problems = 0

    def send(self, **msg):
        with self.lock:
            try:
                self.stream.write(json.dumps(msg, separators=(",", ":")) + "\n")
                self.stream.flush()
            except (BrokenPipeError, ValueError):
                pass  # The cluster is gone; nobody is left to tell.

    def problem(self, detail):
        log(f"problem: {detail}")
        with self.lock:
            self.problems += 1
        self.send(op="problem", detail=detail)


class Stats(dict):
    """Counters; a key "name.e0.dp0.tp1" also adds to the total "name"."""

    lock = threading.Lock()

    def add(self, key, n=1):
        with self.lock:
            for k in {key, key.split(".", 1)[0]}:
                self[k] = self.get(k, 0) + n


class CountingSocket:
    """A listener's ROUTER that counts the messages it receives and is otherwise the socket."""

    def __init__(self, sock, on_recv):
        self._sock, self._on_recv = sock, on_recv

    def recv_multipart(self, *args, **kwargs):
        frames = self._sock.recv_multipart(*args, **kwargs)
        self._on_recv(frames)
        return frames

    def __getattr__(self, name):
        return getattr(self._sock, name)


class Binds:
    """Watches the sockets vLLM's zmq_ctx binds, to learn whether a listener thread got its port
    (the notify listener has no ready event, and the handshake listener's is never set when its
    bind fails) and to count what the listeners receive. vLLM's make_zmq_socket still makes
    every socket, with the same arguments."""

    def __init__(self, common):
        self.real = common.make_zmq_socket
        self.cond = threading.Condition()
        self.outcome = {}  # port -> its latest bind's outcome: None (bound) or the exception
        self.counters = {}  # port -> called with every message its listener receives
        self.owner = {}  # port -> the listener that bound it
        common.make_zmq_socket = self.make

    def make(self, *args, **kwargs):
        if not kwargs.get("bind"):
            return self.real(*args, **kwargs)
        port = int(str(kwargs["path"]).rsplit(":", 1)[1])
        try:
            sock = self.real(*args, **kwargs)
        except Exception as e:
            self._record(port, e)
            raise
        self._record(port, None)
        return CountingSocket(sock, self.counters[port]) if port in self.counters else sock

    def _record(self, port, outcome):
        with self.cond:
            self.outcome[port] = outcome
            self.cond.notify_all()

    def start(self, port, start, thread_of):
        """Starts a listener on `port` and returns the outcome of its bind."""
        with self.cond:
            self.outcome.pop(port, None)
        thread = thread_of(start())
        deadline = time.monotonic() + BIND_WAIT_S
        with self.cond:
            while port not in self.outcome:
                if not thread.is_alive():
                    return thread, RuntimeError(f"{thread.name} ended without binding")
                if time.monotonic() > deadline:
                    return thread, TimeoutError(f"{thread.name} did not bind in {BIND_WAIT_S:.0f} s")
                self.cond.wait(0.05)
            return thread, self.outcome[port]


class CpuGroup:
    """Stands in for a decode engine's TP CPU process group in _eager_handshake_all_dp_ranks's
    vote: all_reduce(MIN) blocks until every TP worker of the group has voted, as gloo's does.
    The workers vote in the same order, because every step goes to all of them."""

    def __init__(self, size):
        self.size, self.values, self.round, self.last = size, [], 0, None
        self.cond = threading.Condition()

    def reduce_min(self, value):
        with self.cond:
            mine = self.round
            self.values.append(value)
            if len(self.values) == self.size:
                self.last, self.values, self.round = min(self.values), [], self.round + 1
                self.cond.notify_all()
            else:
                self.cond.wait_for(lambda: self.round > mine)
            # Safe to read: the next round cannot end before every member has left this one.
            return self.last


def install_tp_vote():
    """torch.tensor and torch.distributed.all_reduce, enough for the vote only; every other
    torch name still raises (stubs/torch)."""
    torch = sys.modules["torch"]

    class Vote:
        def __init__(self, data, **_):
            self.value = int(data[0])

        def item(self):
            return self.value

    def all_reduce(tensor, group, op):
        tensor.value = group.reduce_min(tensor.value)

    dist = types.ModuleType("torch.distributed")
    dist.all_reduce, dist.ReduceOp = all_reduce, types.SimpleNamespace(MIN="min")
    torch.tensor, torch.distributed = Vote, dist
    sys.modules["torch.distributed"] = dist


class Prefill:
    """Every foreign prefill rank: vLLM's handshake and notify listeners, bound as
    register_kv_caches binds them, and a producer worker whose real start_load_kv and
    get_finished run every POLL_S, as every engine step runs them."""

    def __init__(self, drv, setup):
        self.drv, self.v, self.out, self.st = drv, drv.v, drv.out, drv.stats
        self.v.common.set_role(self.v.common.ROLE.PRODUCER)
        # The scheduler's own map_request_id / unmap_request_id, one table per rank because
        # register and retire name a rank (in vLLM a DP engine's TP ranks share one scheduler).
        methods = self.v.connector.MoRIIOConnectorScheduler.__dict__
        self.Scheduler = type("Sched", (), {n: methods[n] for n in ("map_request_id", "unmap_request_id")})
        self.engines = {e["engine"]: e for e in setup["engines"]}
        self.ranks, self.commands = {}, queue.Queue()
        self.known = {(r["engine"], r["dp"], r["tp"]) for r in setup["ranks"]}
        for r in sorted(setup["ranks"], key=lambda r: (r["engine"], r["dp"], r["tp"])):
            self._bind(self.engines[r["engine"]], r)
        threading.Thread(target=self._loop, daemon=True, name="engine-steps").start()

    def _bind(self, eng, r):
        v, e, d, t, st = self.v, r["engine"], r["dp"], r["tp"], self.st
        name = rank_name(e, d, t)
        cfg, listen = rank_config(v, eng, d, t)
        md = r["metadata"]
        # As register_kv_caches builds it, with no head, state or block-size layouts.
        metadata = v.common.MoRIIOAgentMetadata(
            engine_id=md["engine_id"],
            agent_metadata=bytes.fromhex(md["agent_metadata"]),
            kv_caches_base_addr=[int(a) for a in md["kv_caches_base_addr"]],
            num_blocks=int(md["num_blocks"]),
            block_len=int(md["block_len"]),
            attn_backend_name=md["attn_backend_name"],
        )
        layer_map = {x["name"]: [bytes.fromhex(desc) for desc in x["descs"]] for x in r["layers"]}
        get_meta = v.common.MoRIIOConstants.GET_META_MSG

        def served(frames):
            if frames[-1] == get_meta:
                st.add(f"handshakes_served.{name}")

        # register_kv_caches's order: the handshake listener, its ready event, the notify listener.
        ready = threading.Event()
        thread = threading.Thread(
            target=v.connector.MoRIIOConnectorWorker._moriio_handshake_listener,
            args=(metadata, ready, listen, cfg.tp_rank, cfg.dp_rank, layer_map),
            daemon=True,
            name=f"moriio_handshake_listener[{name}]",
        )
        listeners = [("handshake", listen, self._listen("handshake", thread, listen, served, eng, (e, d, t)))]
        if not ready.wait(BIND_WAIT_S):
            self.drv.fatal(f"prefill rank {name}: the handshake listener bound :{listen} but never set ready")
        # A producer worker with what MoRIIOConnectorWorker.__init__ gives it and its step reads.
        w = v.Worker()
        w.is_producer, w.world_size = True, eng["tp"]
        w.mode = v.common.MoRIIOMode.READ if cfg.read_mode else v.common.MoRIIOMode.WRITE
        w.transfer_id_to_request_id, w._pending_unmapped_acks = {}, []
        w._consumer_notification_counts, w._completed_consumer_notifications = {}, set()
        w.moriio_wrapper = rank_wrapper(v, cfg)
        pop = w.moriio_wrapper.pop_finished_req_ids

        def counted_pop():
            acks = pop()
            st.add(f"acks_popped.{name}", len(acks))
            return acks

        w.moriio_wrapper.pop_finished_req_ids = counted_pop

        def on_release(frames):
            if frames[-1] != KILL_FRAMES["notify"]:
                st.add(f"releases_received.{name}")

        notify = self._listen("notify", w.moriio_wrapper, cfg.notify_port, on_release, eng, (e, d, t))
        listeners.append(("notify", cfg.notify_port, notify))
        sched = self.Scheduler()
        sched.transfer_id_to_request_id, sched.request_id_to_transfer_id = {}, {}
        self.ranks[(e, d, t)] = types.SimpleNamespace(
            name=name, worker=w, sched=sched, errors=set(), listeners=listeners, announce=[]
        )
        log(f"prefill rank {name}: handshake listener :{listen}, notify listener :{cfg.notify_port}")

    def _listen(self, kind, what, port, on_recv, eng, rank):
        """Starts a listener (the handshake thread, or async_wait_reqid on a wrapper), waits
        for its bind and returns its thread; a bind that fails is fatal, explained."""
        binds, name = self.drv.binds, rank_name(*rank)
        binds.counters[port] = on_recv
        if kind == "notify":
            thread, outcome = binds.start(port, what.async_wait_reqid, lambda _: what.notify_thread)
        else:
            thread, outcome = binds.start(port, what.start, lambda _: what)
        self.drv.labels[thread] = f"{kind} listener of prefill rank {name} (:{port})"
        if outcome is None:
            binds.owner[port] = f"the {kind} listener of rank {name}"
            return thread
        e, d, t = rank
        base = eng[f"{kind}_port_base"]
        detail = (
            f"prefill rank {name} (engine {e}: DP {eng['dp']} x TP {eng['tp']}): vLLM 0.33's {kind} "
            f"listener cannot bind port {port} = {kind} port base {base} + get_port_offset(dp_rank={d}, "
            f"tp_rank={t}) = {base} + {d} + {t} ({harness.error_text(outcome)}); "
            f"{binds.owner.get(port, 'another process')} already listens there"
        )
        if port in binds.owner:
            dial = base + self.v.common.get_port_offset(d, t, eng["tp"])
            detail += (
                ". That offset leaves out tp_size, so on one host two ranks with equal dp + tp collide "
                "whenever dp_size >= 2 and tp_size >= 2 (vLLM's own bug: its dialer expects this rank "
                f"at base + dp * tp_size + tp = {dial})"
            )
            if kind == "handshake":
                detail += "; vLLM's worker itself would wait for the listener's ready event for ever"
        self.drv.fatal(detail)

    def command(self, msg):
        """Queues a register, retire, kill or restart line for the step thread, which applies it
        between steps (whether the rank is up then is its check, in order with the rest)."""
        if msg["op"] == "restart":
            r = msg.get("rank")
            if not isinstance(r, dict):
                raise ValueError("restart needs a rank object")
            key = (r.get("engine"), r.get("dp"), r.get("tp"))
        else:
            key = (msg["engine"], msg["dp"], msg["tp"])
        if key not in self.known:
            raise ValueError(f"no foreign prefill rank {rank_name(*key)}")
        if msg["op"] in ("register", "retire"):
            ids = [msg["transfer_id"]] + ([msg["request"]] if msg["op"] == "register" else [])
            if not all(isinstance(i, str) for i in ids):
                raise ValueError("transfer_id and request must be strings")
        self.commands.put(msg)

    def _loop(self):
        """The engine steps of every rank, in one thread so the tables change only between steps."""
        while True:
            while not self.commands.empty():
                self._schedule(self.commands.get())
            for key, rank in self.ranks.items():
                try:
                    self._step(key, rank)
                except Exception as e:  # noqa: BLE001 - reported once per distinct failure
                    text = harness.error_text(e)
                    if text not in rank.errors:
                        rank.errors.add(text)
                        self.out.problem(f"prefill rank {rank.name}: vLLM's step raised {text}")
            time.sleep(POLL_S)

    def _schedule(self, msg):
        """The scheduler's part of a step: map_request_id when it takes a transfer on
        (update_state_after_alloc), unmap_request_id when it frees it (update_connector_output);
        or a rank's death and its new start."""
        if msg["op"] == "kill":
            return self._kill((msg["engine"], msg["dp"], msg["tp"]))
        if msg["op"] == "restart":
            return self._restart(msg["rank"])
        key, tid = (msg["engine"], msg["dp"], msg["tp"]), msg["transfer_id"]
        rank = self.ranks.get(key)
        if rank is None:
            return self.out.problem(f"{msg['op']} {tid!r} on prefill rank {rank_name(*key)}, which is down")
        try:
            if msg["op"] == "register":
                rank.sched.map_request_id(msg["request"], tid)
                rank.announce.append(tid)
                self.st.add("transfers_registered")
            elif tid in rank.sched.transfer_id_to_request_id:
                request = rank.sched.transfer_id_to_request_id[tid]
                # From 0.31 the transfer id may be named too (a request id the input processor
                # changed); before, the request id alone, which is this table's own.
                if "transfer_id" in inspect.signature(rank.sched.unmap_request_id).parameters:
                    rank.sched.unmap_request_id(request, transfer_id=tid)
                else:
                    rank.sched.unmap_request_id(request)
                self.st.add("transfers_retired")
            else:
                self.out.problem(f"retire of {tid!r} on prefill rank {rank.name}, which does not hold it")
        except Exception as e:  # noqa: BLE001 - never let the step thread die
            self.out.problem(f"{msg['op']} {tid!r} on prefill rank {rank.name}: {harness.error_text(e)}")

    def _kill(self, key):
        """The rank's process dies: its listeners stop (each raises on a frame it refuses, as
        it would on any peer's, and its socket closes), and its worker and scheduler tables,
        with every transfer and ack they held, are gone with it."""
        rank = self.ranks.pop(key, None)
        if rank is None:
            return self.out.problem(f"kill of prefill rank {rank_name(*key)}, which is down")
        with zmq.Context() as ctx:
            for kind, port, thread in rank.listeners:
                self.drv.killed.add(thread)
                with ctx.socket(zmq.DEALER) as sock:
                    sock.setsockopt(zmq.LINGER, 1000)
                    sock.connect(f"tcp://127.0.0.1:{port}")
                    sock.send(KILL_FRAMES[kind])
                    thread.join(BIND_WAIT_S)
                if thread.is_alive():
                    self.out.problem(f"prefill rank {rank.name}: its {kind} listener (:{port}) outlived the kill")
                self.drv.binds.owner.pop(port, None)
        self.st.add(f"ranks_killed.{rank.name}")
        log(f"prefill rank {rank.name}: killed (listeners closed, {len(rank.sched.transfer_id_to_request_id)} "
            f"transfers and {len(rank.worker._pending_unmapped_acks)} unmapped acks forgotten)")

    def _restart(self, r):
        """The rank starts again as a fresh process would: new listeners on the same ports,
        answering with the restarted data-plane server's descriptors, and empty tables."""
        key = (r["engine"], r["dp"], r["tp"])
        if key in self.ranks:
            return self.out.problem(f"restart of prefill rank {rank_name(*key)}, which is up")
        try:
            self._bind(self.engines[r["engine"]], r)
        except Exception as e:  # noqa: BLE001 - the rank stays down, reported
            return self.out.problem(f"restart of prefill rank {rank_name(*key)}: {harness.error_text(e)}")
        self.st.add(f"ranks_restarted.{rank_name(*key)}")
        self.out.send(op="restarted", engine=key[0], dp=key[1], tp=key[2])

    def _step(self, key, rank):
        w = rank.worker
        # build_connector_meta hands the worker the scheduler's table; a worker process receives
        # a copy of it with every step, and start_load_kv installs it.
        meta = self.v.common.MoRIIOConnectorMetadata()
        meta.transfer_id_to_request_id = dict(rank.sched.transfer_id_to_request_id)
        w.start_load_kv(meta)
        # The worker has this step's table now: the prefill is computed in this step, and only
        # then does the engine answer the proxy, so the cluster dispatches to decode after this.
        for tid in rank.announce:
            self.out.send(op="registered", transfer_id=tid, engine=key[0], dp=key[1], tp=key[2])
        rank.announce.clear()
        before = set(w._completed_consumer_notifications)
        done, _ = w.get_finished()
        # get_finished names requests; the transfers it resolved in this call are exactly those
        # resolve_moriio_transfer_ack added to _completed_consumer_notifications.
        resolved = sorted(w._completed_consumer_notifications - before)
        if {w.transfer_id_to_request_id[t] for t in resolved} != set(done):
            self.out.problem(f"prefill rank {rank.name}: done_sending {sorted(done)}, transfers {resolved}")
        for tid in resolved:
            self.st.add(f"transfers_finished.{rank.name}")
            self.out.send(op="finished", transfer_id=tid, engine=key[0], dp=key[1], tp=key[2])

    def report(self):
        # The step thread applies the register and retire lines that came before shutdown first
        # (they arrive together when the run's last transfers are freed), so the tables are final.
        deadline = time.monotonic() + 2
        while not self.commands.empty() and time.monotonic() < deadline:
            time.sleep(POLL_S)
        time.sleep(2 * POLL_S)
        for rank in self.ranks.values():
            self.st.add(f"pending_unmapped_acks.{rank.name}", len(rank.worker._pending_unmapped_acks))
            self.st.add(f"transfers_held_at_shutdown.{rank.name}", len(rank.sched.transfer_id_to_request_id))

    def shutdown(self):
        for rank in self.ranks.values():
            rank.worker.moriio_wrapper.shutdown()


def offsets_of_nothing(layer_name, local_block_ids, remote_block_ids, *args, **kwargs):
    """A read of no local blocks, for a release before 0.31: no offsets, once the remote block
    ids are what vLLM's _compute_block_transfer_offsets takes, a list of block ids."""
    if not isinstance(remote_block_ids, list) or not all(isinstance(b, int) for b in remote_block_ids):
        raise TypeError(
            f"_compute_block_transfer_offsets takes remote_block_ids: list[int], got {remote_block_ids!r:.80}"
        )
    return [], [], []


class Decode:
    """Every foreign decode rank: a vLLM decode worker with its own MoRIIOWrapper. One thread
    per DP group runs one engine step per recv, in which every TP worker runs the real
    start_load_kv concurrently; a step blocks as long as vLLM's step would."""

    def __init__(self, drv, setup):
        self.drv, self.v, self.out, self.st = drv, drv.v, drv.out, drv.stats
        self.v.common.set_role(self.v.common.ROLE.CONSUMER)
        install_tp_vote()
        # 0.31 and 0.32 read the forward context's CUDA-graph mode in the step (a host-side wait
        # is skipped under full-graph capture). These steps run eagerly, as on a CPU, so the
        # mode is "no graph": vLLM's own eager path, the one pdkv's vLLM tests run too.
        if "get_forward_context" in vars(self.v.connector):
            eager = types.SimpleNamespace(NONE="NONE", FULL="FULL", PIECEWISE="PIECEWISE")
            self.v.connector.CUDAGraphMode = eager
            self.v.connector.get_forward_context = lambda: types.SimpleNamespace(cudagraph_runtime_mode=eager.NONE)
        use_mla = bool(setup["model"]["use_mla"])
        self.groups = {}
        for eng in setup["engines"]:
            for d in range(eng["dp"]):
                cpu = CpuGroup(eng["tp"])
                group = types.SimpleNamespace(
                    workers=[self._worker(eng, d, t, use_mla, cpu) for t in range(eng["tp"])],
                    queue=queue.Queue(),
                    busy=False,
                    pool=ThreadPoolExecutor(max_workers=eng["tp"], thread_name_prefix="worker"),
                )
                self.groups[(eng["engine"], d)] = group
                threading.Thread(target=self._loop, args=(group,), daemon=True, name="steps").start()
        log(f"decode: {sum(len(g.workers) for g in self.groups.values())} vLLM decode workers")

    def _worker(self, eng, d, t, use_mla, cpu):
        v, st, name = self.v, self.st, rank_name(eng["engine"], d, t)
        cfg, _ = rank_config(v, eng, d, t)
        # What MoRIIOConnectorWorker.__init__ gives a decode worker and its step reads.
        w = v.Worker()
        w.moriio_config, w.tp_rank, w.dp_rank, w.world_size = cfg, cfg.tp_rank, cfg.dp_rank, eng["tp"]
        w.use_mla, w.is_producer, w._has_mamba, w.transfer_id_to_request_id = use_mla, False, False, {}
        w.mode = v.common.MoRIIOMode.READ if cfg.read_mode else v.common.MoRIIOMode.WRITE
        w.local_kv_cache_metadata, w.remote_kv_cache_metadata = [], []
        w.layer_name_to_remote_kv_cache_metadata, w.remote_moriio_metadata = {}, {}
        w._remote_agents, w._eager_handshaked_engines, w._handshake_lock = {}, set(), threading.RLock()
        # MoRIIO is not thread-safe, so vLLM dials one handshake at a time per worker.
        w._handshake_initiation_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="handshake")
        w.tp_group = types.SimpleNamespace(cpu_group=cpu)
        w._ready_requests, w.load_ready_flag = queue.Queue(), {}
        w._reads_issued_this_step, w._reqs_to_send = [], {}
        # State the step reads that only some releases have (0.31 and 0.32 gather Mamba reads
        # per step), at vLLM's own initial values from its __init__.
        for attr, expr in v.step_state.items():
            if attr not in vars(w):
                setattr(w, attr, eval(expr, vars(v.connector)))
        # A full-attention model has one KV cache group: every layer is in group 0 (0.30 on
        # read this map, which register_kv_caches fills).
        w.layer_to_group = collections.defaultdict(int)
        if not v.releases_without_blocks:
            # Before 0.31 a request without local blocks still reads (nothing) and releases
            # from _pop_done_transfers once its reads succeeded: the receive state its
            # __init__ sets up.
            for attr, expr in v.recv_state.items():
                setattr(w, attr, eval(expr, vars(v.connector)))
            # The offsets of no local blocks are none; vLLM's own computation needs the model's
            # cache tensors, which a CPU run has none of. It does check what its signature
            # says it takes, block ids (list[int]): a prefill answer of another shape (one list
            # per KV cache group for a release that reads one flat list, or the reverse) fails
            # here as vLLM's arithmetic on it would.
            w._compute_block_transfer_offsets = offsets_of_nothing
        w.moriio_wrapper = wrapper = rank_wrapper(v, cfg)
        if not v.releases_without_blocks:
            # The read of nothing a release before 0.31 posts, which MoRI would carry: it
            # succeeded (as the harness's Vllm.read_and_release answers it), so the worker's own
            # _pop_done_transfers releases.
            wrapper.read_remote_data = lambda *args, **kwargs: harness.SucceededRead()
        w.registered = []
        # What _get_built_session reads: its cache, and this worker's own layer regions (filled
        # from the first peer's layer map: a decode worker serves the same model).
        w.built_write_session, w.layer_name_to_local_kv_cache_metadata = {}, {}

        def register_remote_engine(packed):
            # The MoRI part (EngineDesc.unpack, IOEngine.register_remote_engine): record the
            # bytes and answer a key derived from them, as the engine's descriptor key would be.
            w.registered.append(bytes(packed))
            st.add(f"engines_registered.{name}")
            return "mori-engine-" + hashlib.sha1(bytes(packed)).hexdigest()[:16]

        send_notify, handshake = wrapper.send_notify, w._moriio_handshake

        def counted_send_notify(*args, **kwargs):
            send_notify(*args, **kwargs)
            st.add(f"releases_sent.{name}")

        def counted_handshake(*args, **kwargs):
            st.add(f"handshakes_dialled.{name}")
            try:
                return handshake(*args, **kwargs)
            except Exception:
                st.add(f"handshakes_failed.{name}")
                raise

        def build_session(local, remote):
            # The MoRI part (IOEngine.create_session): a session reads the remote region its
            # memory descriptor names; keep the descriptor's bytes.
            st.add(f"sessions_built.{name}")
            return types.SimpleNamespace(local=bytes(local), remote=bytes(remote))

        read_blocks = w._read_blocks

        def planned_read_blocks(**kw):
            self._plan(w, (eng["engine"], d, t), kw)
            return read_blocks(**kw)

        # Instance attributes, so vLLM's calls through self.* reach the counters, then vLLM.
        wrapper.register_remote_engine, wrapper.send_notify = register_remote_engine, counted_send_notify
        # MemoryDesc.unpack is MoRI's too: the packed bytes stand for the descriptor.
        wrapper.get_unpack_memory_metadata, wrapper.build_session = bytes, build_session
        w._moriio_handshake, w._read_blocks = counted_handshake, planned_read_blocks
        return w

    def _plan(self, w, rank, kw):
        """Reports the read vLLM's _read_blocks would post for a request, which MoRI cannot post
        here: the block ids, and the session it reads through. The session key is the one
        _read_blocks derives (the remote TP rank it reads, keyed per (dp, tp) for a flexible
        read, else per DP rank); the sessions and the peer's metadata are what vLLM's own
        _get_built_session returns for that key, as _read_blocks calls it: sessions built once
        from the layer map of the handshake, then cached per key for ever."""
        name = rank_name(*rank)
        try:
            remote_tp_size = int(kw["remote_tp_size"]) or w.world_size
            chosen = kw.get("chosen_tp")
            eff_tp = int(chosen) if chosen is not None else w._remote_tp_rank(remote_tp_size)
            dst, dp = kw["dst_engine_id"], int(kw.get("remote_dp_rank", 0))
            if kw.get("flexible"):
                key = w.get_engine_name_with_dp_tp(dst, dp, eff_tp)
            else:
                key = w.get_engine_name_with_dp(dst, dp)
            remote_layers = w.layer_name_to_remote_kv_cache_metadata.get(key, {})
            if not w.layer_name_to_local_kv_cache_metadata:
                w.layer_name_to_local_kv_cache_metadata = {
                    layer: [f"local:{name}:{layer}:{i}".encode() for i in range(len(descs))]
                    for layer, descs in remote_layers.items()
                }
            sessions, meta = w._get_built_session(key)
            # remote_block_ids is one list per KV cache group when vLLM's prefill answers, one
            # flat list when pdkv's does.
            blocks = kw["remote_block_ids"]
            ids = [b for g in blocks for b in g] if blocks and isinstance(blocks[0], list) else list(blocks)
            self.st.add(f"reads_planned.{name}")
            self.out.send(
                op="read_plan",
                request=kw["request_id"],
                transfer_id=kw["transfer_id"],
                engine=rank[0],
                dp=rank[1],
                tp=rank[2],
                source_dp=dp,
                source_tp=eff_tp,
                block_ids=[int(b) for b in ids],
                engine_desc=bytes(meta.agent_metadata).hex(),
                memory_descs=[s.remote.hex() for s in sessions],
            )
        except Exception as e:  # noqa: BLE001 - a plan that cannot be made is reported, the step goes on
            tid = kw.get("transfer_id")
            self.out.problem(f"decode rank {name}: cannot plan the read of {tid!r}: {harness.error_text(e)}")

    def recv(self, msg):
        rid, key = msg["request"], (msg["engine"], msg["dp"])
        if not isinstance(rid, str) or not isinstance(msg.get("params"), dict):
            raise ValueError("recv needs a string request and a params object")
        if key not in self.groups:
            self.out.problem(f"recv {rid!r} for decode group e{key[0]}.dp{key[1]}, which setup did not name")
            return self._received(rid, "no such foreign decode group")
        self.groups[key].queue.put(msg)

    def _received(self, rid, error=None):
        self.st.add("recv_ok" if error is None else "recv_failed")
        extra = {} if error is None else {"error": error}
        self.out.send(op="received", request=rid, ok=error is None, **extra)

    def _loop(self, group):
        while True:
            msg = group.queue.get()
            group.busy = True
            rid = msg["request"]
            try:
                metas = [self._meta(rid, dict(msg["params"])) for _ in group.workers]
                steps = [group.pool.submit(self._step, w, m) for w, m in zip(group.workers, metas)]
                errors = [(t, f.exception()) for t, f in enumerate(steps)]  # waits for every rank
                failed = [f"tp{t}: {harness.error_text(e)}" for t, e in errors if e]
            except Exception as e:  # noqa: BLE001 - vLLM's refusal is the answer
                failed = [harness.error_text(e)]
            group.busy = False
            self._received(rid, "; ".join(failed) if failed else None)

    def _step(self, w, meta):
        """One engine step of worker w: vLLM's start_load_kv, and before 0.31, whose reads of a
        request without local blocks still go through the data plane, the releases its
        _pop_done_transfers sends once those reads succeeded (vLLM calls it from the step's
        get_finished)."""
        w.start_load_kv(meta)
        if not self.v.releases_without_blocks:
            w._pop_done_transfers()

    def _meta(self, rid, params):
        """The step metadata one TP worker receives for the request, as vLLM's scheduler builds
        it: update_state_after_alloc's checks and transfer id, then build_connector_meta's
        add_new_req. It has no local blocks (one empty list for the model's one KV cache group,
        the path of a request aborted before allocation), so _read_blocks releases at once, to
        the ports and with the bytes a landed read's release has, without a MoRI read."""
        tid = params.get("transfer_id") or f"sidecar-{rid}"
        params.setdefault("transfer_id", tid)
        wanted = ("do_remote_prefill", "remote_block_ids", "remote_engine_id")
        if not (params.get(wanted[0]) and params.get(wanted[1])) or wanted[2] not in params:
            raise ValueError(
                "vLLM's update_state_after_alloc takes no READ for these params (it needs "
                "do_remote_prefill, remote_block_ids and remote_engine_id), so it releases nothing"
            )
        meta = self.v.common.MoRIIOConnectorMetadata()
        meta.add_new_req(request_id=rid, local_block_ids=[[]], kv_transfer_params=params)
        meta.transfer_id_to_request_id = {tid: rid}  # the scheduler's map_request_id
        return meta

    def report(self):
        self.st["recv_unanswered"] = sum(g.queue.qsize() + g.busy for g in self.groups.values())

    def shutdown(self):
        for group in self.groups.values():
            for w in group.workers:
                w.moriio_wrapper.shutdown()
                w._handshake_initiation_executor.shutdown(wait=False)


class Driver:
    def __init__(self, v):
        self.v, self.out, self.stats = v, Out(), Stats()
        self.binds = Binds(v.common)
        self.labels = {}  # listener thread -> what it is
        self.killed = set()  # listener threads a kill of their rank ended
        self.dead = set()  # threads that raised (still alive while their excepthook runs)
        self.side, self.live = None, False
        threading.excepthook = self.thread_died

    def thread_died(self, args):
        label = self.labels.get(args.thread, getattr(args.thread, "name", "a thread"))
        if args.thread in self.killed:
            log(f"{label} ended with its rank's kill: {harness.error_text(args.exc_value)}")
            return
        text = f"{label} died: {harness.error_text(args.exc_value)}"
        self.dead.add(args.thread)
        self.stats.add("threads_died")
        # During setup a dead listener is a failed bind, which setup reports as the error.
        self.out.problem(text) if self.live else log(text)

    def fatal(self, detail):
        log(f"error: {detail}")
        self.out.send(op="error", detail=detail)
        os._exit(1)

    def handle(self, msg):
        op = msg.get("op")
        if op == "setup":
            if self.side is not None:
                raise ValueError("a second setup")
            try:
                # The release loaded decides what it does; the rules pdkv's side follows must be
                # ones whose READ-mode decisions that release makes: every holder released from
                # 0.33 (vllm-0.33), the rank read before (vllm-0.27, vllm-0.28, vllm-0.30), and
                # DP rank 0 read lazily before 0.27, whose dial names no TP rank (vllm-0.25,
                # vllm-0.26).
                rules = msg.get("rules", "vllm-0.33")
                holders = "_send_read_release" not in self.v.missing_methods
                if holders:
                    speaks, what = ["vllm-0.33"], "its decode releases every holder"
                elif self.v.dial_takes_tp_rank:
                    speaks, what = ["vllm-0.27", "vllm-0.28", "vllm-0.30"], "its decode releases only the rank it read"
                else:
                    speaks, what = ["vllm-0.25", "vllm-0.26"], "its decode reads DP rank 0 and handshakes lazily"
                if rules not in speaks:
                    raise ValueError(f"rules {rules!r}: the vLLM release loaded follows {', '.join(speaks)} ({what})")
                self.side = {"prefill": Prefill, "decode": Decode}[msg["side"]](self, msg)
            except Exception as e:  # noqa: BLE001 - a setup that cannot be played is fatal
                self.fatal(f"setup: {harness.error_text(e)}")
            self.live = True
            for th, label in self.labels.items():
                if th in self.dead or not th.is_alive():
                    self.out.problem(f"{label} died during setup")
            self.out.send(op="ready")
        elif op == "shutdown":
            self.shutdown()
        elif op in ("recv", "register", "retire", "kill", "restart"):
            side = Decode if op == "recv" else Prefill
            if not isinstance(self.side, side):
                raise ValueError(f"{op} is for a {side.__name__.lower()} driver")
            self.side.recv(msg) if op == "recv" else self.side.command(msg)
        else:
            raise ValueError(f"unknown op {op!r}")

    def run(self):
        for raw in sys.stdin.buffer:
            line = raw.strip()
            if not line:
                continue
            try:
                msg = json.loads(line)
                if not isinstance(msg, dict):
                    raise ValueError("not a JSON object")
                self.handle(msg)
            except Exception as e:  # noqa: BLE001 - a bad line is reported, never fatal
                text = line[:200].decode("utf-8", "replace")
                self.out.problem(f"bad message {text}: {harness.error_text(e)}")
        log("stdin closed")
        self.shutdown()

    def shutdown(self):
        if self.side is not None:
            self.side.report()
            self.side.shutdown()
        # A listener its rank's kill ended is neither alive nor dead: the process it stood for is.
        serving = [th for th in self.labels if th not in self.killed]
        alive = sum(th.is_alive() and th not in self.dead for th in serving)
        self.stats.update(
            listener_threads_alive=alive,
            listener_threads_dead=len(serving) - alive,
            listener_threads_killed=len(self.labels) - len(serving),
        )
        self.stats["problems"] = self.out.problems
        stats = dict(sorted(self.stats.items()))
        self.out.send(op="bye", stats=stats)
        log(f"bye {json.dumps(stats)}")
        # Listener threads block in recv for ever (as in vLLM); skip the interpreter's teardown.
        os._exit(0)


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--vllm-src", required=True, help="the files extracted from the vLLM wheel")
    parser.add_argument("--stubs", required=True, help="tests/moriio/stubs")
    parser.add_argument("--verbose", action="store_true", help="show vLLM's own log lines")
    args = parser.parse_args()
    # vLLM's own lines carry the driver's prefix too.
    fmt = "  vllm-driver: %(name)s: %(message)s"
    logging.basicConfig(stream=sys.stderr, level=logging.WARNING, format=fmt)
    # "MoRIIO is not available" (no mori.io: expected here) and the like stay quiet unless asked.
    logging.getLogger("vllm").setLevel(logging.INFO if args.verbose else logging.CRITICAL)
    Driver(harness.Vllm(args.vllm_src, args.stubs)).run()


if __name__ == "__main__":
    main()
