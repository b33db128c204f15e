"""Unit tests of the known KV bytes and of the driver's option parsing (no engine is started).

Run: cd tests/vllm && PYTHONPATH=. python -m unittest pdkv_vllm_test.test_kvpattern
"""

from __future__ import annotations

import argparse
import unittest

import torch

from pdkv_vllm_test import kvpattern
from pdkv_vllm_test.pd import Run, expected_tokens, parse_corrupt, parse_kill

BLOCK = 4
HEAD_SIZE = 2
DTYPE = torch.float16
HEAD_BYTES = HEAD_SIZE * 2


def cache(heads: int, blocks: int = 4) -> torch.Tensor:
    """A `[blocks, heads, block, K|V]` fp16 layer view, as allocate_kv_cache gives it."""
    return torch.zeros(blocks, heads, BLOCK, 2 * HEAD_SIZE, dtype=DTYPE)


class GeometryTest(unittest.TestCase):
    def test_for_rank(self) -> None:
        # (total KV heads, TP size, TP rank) -> model-wide heads the rank holds.
        table = [
            ((2, 1, 0), (0, 1)),
            ((2, 2, 0), (0,)),
            ((2, 2, 1), (1,)),
            ((8, 4, 3), (6, 7)),
            ((1, 2, 0), (0,)),
            ((1, 2, 1), (0,)),
            ((2, 4, 3), (1,)),
        ]
        for (heads, tp, rank), expected in table:
            with self.subTest(heads=heads, tp=tp, rank=rank):
                g = kvpattern.Geometry.for_rank(heads, tp, rank, HEAD_SIZE, 2)
                self.assertEqual(g.global_heads, expected)


class PatternTest(unittest.TestCase):
    def test_depends_on_each_coordinate(self) -> None:
        base = dict(token=7, pos=3, layer=1, kv=kvpattern.K)
        idx = torch.arange(64)

        def row(token: int, pos: int, layer: int, kv: int) -> torch.Tensor:
            return kvpattern.pattern(torch.tensor([token]), torch.tensor([pos]), layer, kv, idx)

        reference = row(**base)
        self.assertTrue(torch.equal(reference, row(**base)), "deterministic")
        for change in [{"token": 8}, {"pos": 4}, {"layer": 0}, {"kv": kvpattern.V}]:
            with self.subTest(change=change):
                self.assertFalse(torch.equal(reference, row(**{**base, **change})))

    def test_tp_ranks_hold_slices_of_the_tp1_row(self) -> None:
        # A decode engine with another TP size checks the same model-wide bytes.
        tokens, positions = torch.tensor([5, 9]), torch.tensor([0, 1])
        whole = kvpattern.expected_slots(
            tokens, positions, 1, kvpattern.Geometry.for_rank(2, 1, 0, HEAD_SIZE, 2)
        )
        for rank in (0, 1):
            with self.subTest(rank=rank):
                part = kvpattern.expected_slots(
                    tokens, positions, 1, kvpattern.Geometry.for_rank(2, 2, rank, HEAD_SIZE, 2)
                )
                self.assertTrue(torch.equal(part[:, 0], whole[:, rank]))


class WriteCheckTest(unittest.TestCase):
    def setUp(self) -> None:
        self.geometry = kvpattern.Geometry.for_rank(2, 1, 0, HEAD_SIZE, 2)
        self.kv = cache(heads=2)
        # Positions 0..5 of one request in blocks 2 and 0 (block ids need not be ordered).
        self.positions = torch.arange(6)
        self.slots = torch.tensor([2, 0])[self.positions // BLOCK] * BLOCK + self.positions % BLOCK
        self.tokens = torch.tensor([11, 12, 13, 14, 15, 16])
        kvpattern.write(self.kv, self.slots, BLOCK, self.tokens, self.positions, 0, self.geometry)

    def run_check(self) -> kvpattern.CheckResult:
        result = kvpattern.CheckResult()
        kvpattern.check(
            self.kv, self.slots, BLOCK, self.tokens, self.positions, 0, self.geometry, "r", result
        )
        return result

    def test_clean(self) -> None:
        result = self.run_check()
        self.assertEqual(result.bytes_verified, 6 * 2 * 2 * HEAD_BYTES)
        self.assertEqual(result.mismatched_bytes, 0)

    def test_one_flipped_byte_is_named(self) -> None:
        # (position, head slot, byte of the K|V cell) -> (kv, model-wide byte offset).
        table = [
            ((0, 0, 0), ("K", 0)),
            ((5, 1, 3), ("K", HEAD_BYTES + 3)),
            ((4, 0, HEAD_BYTES), ("V", 0)),
            ((1, 1, 2 * HEAD_BYTES - 1), ("V", 2 * HEAD_BYTES - 1)),
        ]
        for (pos, head, byte), (kv, offset) in table:
            with self.subTest(pos=pos, head=head, byte=byte):
                self.setUp()
                slot = int(self.slots[pos])
                raw = kvpattern.as_bytes(self.kv)
                raw[slot // BLOCK, head, slot % BLOCK, byte] ^= 0x5A
                result = self.run_check()
                self.assertEqual(result.mismatched_bytes, 1)
                m = result.mismatches[0]
                self.assertEqual((m.position, m.kv, m.byte_offset), (pos, kv, offset))


class MergeTest(unittest.TestCase):
    def test_merge_adds_counts_and_keeps_the_first_mismatches(self) -> None:
        def result(n: int, wrong: int) -> kvpattern.CheckResult:
            m = kvpattern.Mismatch("r", 0, 0, "K", 0, 1, 2)
            return kvpattern.CheckResult(n, wrong, [m] * wrong)

        # (into, other, keep) -> (bytes, mismatched, recorded)
        table = [
            ((result(10, 0), result(5, 0), 32), (15, 0, 0)),
            ((result(10, 2), result(5, 3), 32), (15, 5, 5)),
            ((result(10, 2), result(5, 3), 4), (15, 5, 4)),
            ((result(10, 4), result(5, 3), 4), (15, 7, 4)),
        ]
        for (into, other, keep), expected in table:
            with self.subTest(expected=expected):
                kvpattern.merge(into, other, keep)
                got = (into.bytes_verified, into.mismatched_bytes, len(into.mismatches))
                self.assertEqual(got, expected)


class DriverOptionsTest(unittest.TestCase):
    def test_parse_corrupt(self) -> None:
        table = [
            ("4:1:5:3", {"request_prefix": "req-4-", "layer": 1, "position": 5, "byte": 3, "kv": "K"}),
            ("0:0:0:0:V", {"request_prefix": "req-0-", "layer": 0, "position": 0, "byte": 0, "kv": "V"}),
            ("1:2:3", None),
            ("1:2:3:4:X", None),
            ("a:2:3:4", None),
        ]
        for text, expected in table:
            with self.subTest(text=text):
                if expected is None:
                    with self.assertRaises(argparse.ArgumentTypeError):
                        parse_corrupt(text)
                else:
                    self.assertEqual(parse_corrupt(text), expected)

    def test_parse_kill(self) -> None:
        table = [
            ("prefill:16", {"side": "prefill", "after": 16}),
            ("decode:1", {"side": "decode", "after": 1}),
            ("decode:0", None),
            ("router:3", None),
            ("prefill", None),
            ("prefill:x", None),
        ]
        for text, expected in table:
            with self.subTest(text=text):
                if expected is None:
                    with self.assertRaises(argparse.ArgumentTypeError):
                        parse_kill(text)
                else:
                    self.assertEqual(parse_kill(text), expected)

    def test_excuse(self) -> None:
        """Only what the kill causes, only after it: a leg on the killed engine raising, or
        decode failing a load of KV that was on a killed prefill. Never a wrong output."""
        table = [
            # (killed side or None, failing side, kind), excused?
            ((None, "prefill", "exception"), False),
            ((None, "decode", "error"), False),
            (("prefill", "prefill", "exception"), True),
            (("prefill", "decode", "error"), True),
            (("prefill", "decode", "exception"), False),
            (("prefill", "decode", "output"), False),
            (("prefill", "prefill", "output"), False),
            (("decode", "decode", "exception"), True),
            (("decode", "decode", "error"), False),
            (("decode", "prefill", "exception"), False),
        ]
        for (killed, side, kind), expected in table:
            with self.subTest(killed=killed, side=side, kind=kind):
                run = Run(args=None, hook=None, prefill=None, decode=None)
                run.kill = None if killed is None else {"side": killed}
                self.assertEqual(bool(run.excuse(side, "req-1", kind)), expected)

    def test_expected_tokens(self) -> None:
        table = [(([3, 9], 3, 1024), [10, 11, 12]), (([1023], 2, 1024), [0, 1])]
        for (prompt, n, vocab), expected in table:
            with self.subTest(prompt=prompt):
                self.assertEqual(expected_tokens(prompt, n, vocab), expected)


if __name__ == "__main__":
    unittest.main()
