"""The native module end to end on loopback, without vLLM: a prefill rank and a decode rank of
one P/D pair, the prefill engine's node and the decode side's node, wired as the connector wires
them. Every byte the decode rank lands must be the byte the prefill rank staged, and the
prefill engine must free the transfer exactly once, on the decode rank's release."""

import json
import os
import random
import sys
import time

from pdkv import _native


def config(engine: str, port: int) -> str:
    return json.dumps({
        "deployment": "1P_TP1:1D_TP1", "engine": engine, "host": "127.0.0.1",
        "handshake_port": port, "notify_port": port + 100,
        "model": {"use_mla": False, "kv_heads": 2, "layers": 3, "bytes_per_token_per_layer": 256,
                  "block_size_tokens": 4},
        "timeouts": {"handshake_ms": 5000, "transfer_ms": 5000, "defer_ms": 20000, "collective_ms": 60000},
    })


# What each rank said that no wait has taken yet: one poll may return several messages.
BACKLOG: dict[str, list] = {}


def wait_for(rank, wanted, what, timeout_s=10.0):
    backlog = BACKLOG.setdefault(rank.name(), [])
    deadline = time.monotonic() + timeout_s
    while True:
        for item in backlog:
            if wanted(item[0]):
                backlog.remove(item)
                return item
        if time.monotonic() >= deadline:
            raise AssertionError(f"{rank.name()}: no {what} in {timeout_s} s")
        backlog.extend((json.loads(text), bytes(raw)) for text, raw in rank.poll(0.5))


def main() -> int:
    port = 20000 + os.getpid() % 20000
    num_blocks = 32
    p_rank = _native.Rank(config("P0", port), 0, 0, num_blocks)
    d_rank = _native.Rank(config("D0", port), 0, 0, num_blocks)
    _, ready = wait_for(p_rank, lambda s: "Ready" in s, "Ready")
    wait_for(d_rank, lambda s: "Ready" in s, "Ready")
    block_len = p_rank.block_len()
    assert block_len == 4 * 256, block_len

    prefill = _native.PrefillNode(config("P0", port))
    prefill.worker_message(p_rank.name(), ready)
    decode = _native.DecodeNode(config("D0", port))

    rng = random.Random(7)
    # Each request its own blocks, in no particular order, as a block pool hands them out.
    pool = list(range(num_blocks))
    rng.shuffle(pool)
    requests = []
    for r in range(8):
        blocks = pool[r * 3:r * 3 + 3]
        layers = [bytes(rng.randrange(256) for _ in range(len(blocks) * block_len)) for _ in range(3)]
        for layer, data in enumerate(layers):
            p_rank.stage(layer, blocks, data)
        transfer = f"tx-{r:032x}"
        p_rank.staged_transfer(transfer, blocks)
        params = {"do_remote_decode": True, "transfer_id": transfer, "remote_tp_size": 1}
        answer = json.loads(prefill.finished(f"req-{r}", json.dumps(params), 0, blocks))
        # One list per KV cache group, as vLLM's MoRIIO writes it.
        assert answer["remote_block_ids"] == [blocks] and answer["do_remote_prefill"], answer
        for rank, msg in prefill.to_workers():
            assert rank == p_rank.name()
            p_rank.deliver(msg)
        local = [num_blocks - 1 - b for b in range(r * 3 % 24, r * 3 % 24 + 3)]
        number, reads_into = decode.request(json.dumps(answer), local)
        assert reads_into == local, (reads_into, local)
        requests.append((number, local, layers, f"req-{r}"))

    step, begin = decode.step()
    d_rank.deliver(begin)
    vote, _ = wait_for(d_rank, lambda s: "Vote" in s, "vote")
    assert vote["Vote"] == {"step": step, "ok": True}, vote
    d_rank.vote_result(step, True)
    received = set()
    while len(received) < len(requests):
        said, _ = wait_for(d_rank, lambda s: "Received" in s or "RecvFailed" in s, "a received request")
        assert "Received" in said, said
        received.add(said["Received"]["request"])
    verified = 0
    for number, local, layers, _ in requests:
        for layer, data in enumerate(layers):
            got = d_rank.unstage(layer, local)
            assert got == data, f"request {number}, layer {layer}: bytes differ"
            verified += len(got)

    # The releases reach the prefill rank; its Finished goes to the engine, which frees each
    # transfer once.
    freed = []
    deadline = time.monotonic() + 10
    while len(freed) < len(requests) and time.monotonic() < deadline:
        for text, raw in p_rank.poll(0.2):
            if "Finished" in json.loads(text):
                prefill.worker_message(p_rank.name(), bytes(raw))
        prefill.tick()
        freed.extend(prefill.freed())
        for rank, msg in prefill.to_workers():
            p_rank.deliver(msg)
    assert sorted(freed) == sorted(name for *_, name in requests), freed
    assert prefill.held() == 0

    # Bad input is a ValueError naming what is wrong.
    for bad, words in [("{}", "missing field"), (config("P0", port).replace("P0", "P7"), "no engine P7")]:
        try:
            _native.PrefillNode(bad)
        except ValueError as e:
            assert words in str(e), str(e)
        else:
            raise AssertionError(f"{bad} was accepted")
    try:
        p_rank.stage(9, [0], bytes(block_len))
    except ValueError as e:
        assert "layer 9" in str(e), str(e)
    p_rank.shutdown(5.0)
    d_rank.shutdown(5.0)
    print(json.dumps({"requests": len(requests), "bytes_verified": verified, "freed": len(freed)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
