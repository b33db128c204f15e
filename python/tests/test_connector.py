"""Unit tests of the connector's pure-Python parts that need no engine: the decode worker's inbox
(what it holds of its rank's messages, and for how long), and the bytes a block is staged as. Needs vLLM importable (the connector
module subclasses vLLM's connector base), as in the venv `cargo xtask vllm-test` builds.

    python python/tests/test_connector.py
"""

import unittest

import torch

from pdkv.connector import _block_view, _gather, _Inbox, _scatter


def vote(step, ok=True):
    return {"Vote": {"step": step, "ok": ok}}


def received(request):
    return {"Received": {"request": request}}


def failed(request):
    return {"RecvFailed": {"request": request, "error": {"ReadFailed": "refused"}}}


def verified(request, layer):
    return {"ReadVerified": {"request": request, "layer": layer, "bytes": 1024, "elapsed_us": 9}}


OTHERS = [
    {"StepDone": {"step": 0, "error": None}},
    {"Dialled": {"peer": {}, "ok": True, "elapsed_us": 800}},
    "Heartbeat",
    {"Problem": {"Stalled": {}}},
]


class InboxTest(unittest.TestCase):
    def check(self, steps, expected_held):
        """`steps`: (messages the rank said, the step's number, its request numbers, what the
        worker took); after each step the inbox forgets it. `expected_held`: the inbox's size
        after each step."""
        inbox = _Inbox()
        held = []
        for said, step, requests, takes in steps:
            inbox.add(said)
            for wanted, expected in takes:
                self.assertEqual(inbox.take(wanted), expected)
            inbox.forget_step(step, requests)
            held.append(len(inbox))
        self.assertEqual(held, expected_held)

    def test_only_what_a_wait_can_want_is_held(self):
        reads = [verified(r, layer) for r in range(8) for layer in range(4)]
        self.check([(reads + OTHERS, 0, {}, [])], [0])

    def test_a_long_run_holds_nothing_between_steps(self):
        # 500 steps of 8 requests, 4 layers each: every vote and outcome taken, every read
        # verified said and dropped. Holding every message grew the inbox to 18,000 entries.
        steps = []
        for step in range(500):
            numbers = range(step * 8, step * 8 + 8)
            said = [vote(step)] + [verified(n, layer) for n in numbers for layer in range(4)] + OTHERS
            said += [received(n) for n in numbers]
            takes = [(lambda s, step=step: "Vote" in s and s["Vote"]["step"] == step, vote(step))]
            takes += [(lambda s, n=n: "Received" in s and s["Received"]["request"] == n, received(n)) for n in numbers]
            steps.append((said, step, set(numbers), takes))
        self.check(steps, [0] * 500)

    def test_what_comes_after_its_wait_gave_up_is_forgotten_with_its_step(self):
        # Step 0 gave up on request 1 and on its vote; both arrive late, with step 1's messages.
        step0 = ([received(0)], 0, {0, 1}, [(lambda s: "Received" in s, received(0))])
        step1 = ([vote(0), failed(1), vote(1), received(2)], 1, {2}, [
            (lambda s: "Vote" in s and s["Vote"]["step"] == 1, vote(1)),
            (lambda s: "Received" in s and s["Received"]["request"] == 2, received(2)),
        ])
        self.check([step0, step1], [0, 0])

    def test_a_later_steps_messages_survive_an_earlier_steps_end(self):
        # The rank may answer for step 1 before the worker's wait for step 0 ends.
        said = [vote(0), vote(1), received(5)]
        self.check([(said, 0, {0}, [(lambda s: s == vote(0), vote(0))])], [2])

    def test_take_returns_the_oldest_match_and_none_when_nothing_matches(self):
        inbox = _Inbox()
        inbox.add([received(3), failed(3)])
        self.assertIsNone(inbox.take(lambda s: "Vote" in s))
        self.assertEqual(inbox.take(lambda s: next(iter(s.values()))["request"] == 3), received(3))
        self.assertEqual(inbox.take(lambda s: True), failed(3))
        self.assertIsNone(inbox.take(lambda s: True))


class BlockBytesTest(unittest.TestCase):
    """A staged block must be that block's bytes as they lie in memory: what a MoRIIO peer reads
    at `base + block * block_len` and writes back the same way. Each case builds a cache the way
    vLLM does (a backing buffer viewed in physical order, permuted to the logical order the
    connector is handed) and names where each block's bytes are in the backing buffer."""

    BLOCKS, HEADS, TOKENS, DIM = 5, 2, 4, 3

    def check(self, physical, to_logical, block_spans, blocks=(3, 0, 4)):
        """`physical`: the backing buffer's shape; `to_logical`: the permutation vLLM applies;
        `block_spans(b)`: the (start, end) element ranges of block b in the buffer, in order."""
        numel = 1
        for n in physical:
            numel *= n
        backing = torch.arange(numel, dtype=torch.int32)
        cache = backing.view(physical).permute(to_logical)
        view = _block_view(cache, self.BLOCKS)
        expected = torch.cat([backing[a:e] for b in blocks for a, e in block_spans(b)])
        self.assertEqual(_gather(view, list(blocks)), expected.numpy().tobytes())
        # Writing the bytes back lands them where they came from, and nowhere else.
        copy = torch.zeros(numel, dtype=torch.int32)
        _scatter(_block_view(copy.view(physical).permute(to_logical), self.BLOCKS), list(blocks), expected.numpy().tobytes())
        spans = [span for b in blocks for span in block_spans(b)]
        for i in range(numel):
            inside = any(a <= i < e for a, e in spans)
            self.assertEqual(int(copy[i]), i if inside else 0, f"element {i}")

    def test_nhd_blocks_first(self):
        # vLLM 0.34's default here: logical [B, H, N, C] over physical [B, N, H, C].
        block = self.HEADS * self.TOKENS * self.DIM
        self.check((self.BLOCKS, self.TOKENS, self.HEADS, self.DIM), (0, 2, 1, 3), lambda b: [(b * block, (b + 1) * block)])

    def test_hnd_blocks_first(self):
        block = self.HEADS * self.TOKENS * self.DIM
        self.check((self.BLOCKS, self.HEADS, self.TOKENS, self.DIM), (0, 1, 2, 3), lambda b: [(b * block, (b + 1) * block)])

    def test_kv_first(self):
        # Older layouts: [2, B, N, H, C], a block's K half then its V half.
        half = self.HEADS * self.TOKENS * self.DIM
        kv = self.BLOCKS * half
        self.check(
            (2, self.BLOCKS, self.TOKENS, self.HEADS, self.DIM),
            (0, 1, 2, 3, 4),
            lambda b: [(b * half, (b + 1) * half), (kv + b * half, kv + (b + 1) * half)],
        )

    def test_no_block_dimension_is_refused(self):
        with self.assertRaisesRegex(ValueError, "no block dimension of 5"):
            _block_view(torch.zeros(2, 3, 4), self.BLOCKS)


if __name__ == "__main__":
    unittest.main()
