//! Conformance of `pdkv_core::wire` with MoRIIO's bytes, from fixtures packed by Python's msgpack.
//!
//! The fixtures under tests/fixtures/wire/ are written by tests/fixtures/make_wire_fixtures.py
//! the way vLLM's MoRIIO connector builds each frame. Every fixture must decode to exactly the
//! value below, and encoding that value must give the fixture's bytes back, byte for byte: that
//! is what lets a MoRIIO peer and pdkv share a socket.

use std::path::PathBuf;

use pdkv_core::ids::TransferId;
use pdkv_core::release::{Release, ReleaseSender};
use pdkv_core::wire::{
    decode, decode_layer_memory_descs, encode, encode_layer_memory_descs, ControlMessage, Extensions,
    HandshakeMetadata, LayerMemoryDesc, RankInfo, RemoteBlocks, WireError, WriteDone,
};

const TRANSFER_ID: &str = "tx-0c5f2a9e-3b7d-4e21-9a64-8f1d2c3b4a5e";

fn fixture(name: &str) -> Vec<u8> {
    let path: PathBuf = [env!("CARGO_MANIFEST_DIR"), "tests", "fixtures", "wire", name].iter().collect();
    std::fs::read(&path).unwrap_or_else(|e| {
        panic!("{}: {e}; regenerate with python3 tests/fixtures/make_wire_fixtures.py", path.display())
    })
}

fn tid() -> TransferId {
    TransferId::new(TRANSFER_ID)
}

fn release(consumer_tp_size: Option<u16>, sender: Option<ReleaseSender>) -> ControlMessage {
    ControlMessage::Release(Release {
        transfer_id: tid(),
        consumer_tp_size,
        sender,
        incarnation: None,
        mac: None,
    })
}

fn metadata(rank: Option<RankInfo>, extensions: Extensions) -> ControlMessage {
    let mut agent_metadata: Vec<u8> = (0..40).collect();
    agent_metadata.extend_from_slice(b"mori-engine-desc");
    ControlMessage::HandshakeMetadata(HandshakeMetadata {
        engine_id: "prefill-0:6301".to_owned(),
        agent_metadata,
        kv_caches_base_addr: vec![0x7F3A_0000_0000, 0x7F3A_4000_0000, 0x7F3A_8000_0000],
        num_blocks: 21504,
        block_len: 73728,
        attn_backend_name: "FLASHMLA".to_owned(),
        rank,
        extensions,
        incarnation: None,
    })
}

/// The incarnation the fixtures name (`INCARNATION` in make_wire_fixtures.py).
fn incarnation() -> Option<pdkv_core::ids::Incarnation> {
    pdkv_core::ids::Incarnation::new(0x1F_2E3D_4C5B)
}

/// Each well-formed fixture and the value it stands for.
fn well_formed() -> Vec<(&'static str, ControlMessage)> {
    vec![
        ("release.msgpack", release(Some(8), None)),
        ("release_without_tp_size.msgpack", release(None, None)),
        (
            "release_with_sender.msgpack",
            release(
                Some(8),
                Some(ReleaseSender { engine_id: "decode-0:6301".to_owned(), dp_rank: 3, tp_rank: 5 }),
            ),
        ),
        ("legacy_completion.msgpack", ControlMessage::LegacyCompletion(tid())),
        (
            "remote_blocks.msgpack",
            ControlMessage::RemoteBlocks(RemoteBlocks {
                req_id: "cmpl-___prefill_addr_host:prefill-0,handshake:6301,notify:61005\
                         ___decode_addr_host:decode-0,handshake:6301,notify:61005\
                         _0123456789abcdef0123456789abcdef-0-1a2b3c4d"
                    .to_owned(),
                transfer_id: tid(),
                block_ids: vec![0, 1, 127, 128, 255, 256, 65535, 65536, 4_000_000],
                decode_dp_rank: 2,
            }),
        ),
        ("write_done.msgpack", ControlMessage::WriteDone(WriteDone::single(tid()))),
        ("handshake_request.msgpack", ControlMessage::HandshakeRequest),
        ("handshake_metadata.msgpack", metadata(None, Extensions::NONE)),
        (
            "handshake_metadata_with_ranks.msgpack",
            metadata(Some(RankInfo { dp_rank: 1, tp_rank: 3, tp_size: 8 }), Extensions::NONE),
        ),
        ("handshake_metadata_pdkv.msgpack", {
            let ControlMessage::HandshakeMetadata(m) =
                metadata(Some(RankInfo { dp_rank: 1, tp_rank: 3, tp_size: 8 }), Extensions::ALL)
            else {
                unreachable!("metadata() builds metadata")
            };
            ControlMessage::HandshakeMetadata(HandshakeMetadata { incarnation: incarnation(), ..m })
        }),
        ("release_with_incarnation.msgpack", {
            let sender = ReleaseSender { engine_id: "decode-0:6301".to_owned(), dp_rank: 3, tp_rank: 5 };
            ControlMessage::Release(Release {
                transfer_id: tid(),
                consumer_tp_size: Some(8),
                sender: Some(sender),
                incarnation: incarnation(),
                mac: None,
            })
        }),
    ]
}

#[test]
fn fixtures_decode_to_the_exact_values() {
    for (name, expected) in well_formed() {
        assert_eq!(decode(&fixture(name)), Ok(expected), "{name}");
    }
}

#[test]
fn our_encoding_equals_moriio_bytes() {
    for (name, msg) in well_formed() {
        assert_eq!(encode(&msg), fixture(name), "{name}");
    }
}

#[test]
fn legacy_completion_and_release_without_tp_size_each_count_as_one_release() {
    let plain =
        Release { transfer_id: tid(), consumer_tp_size: None, sender: None, incarnation: None, mac: None };
    for name in ["legacy_completion.msgpack", "release_without_tp_size.msgpack"] {
        let msg = decode(&fixture(name)).map(|m| m.as_release());
        assert_eq!(msg, Ok(Some(plain.clone())), "{name}");
    }
}

#[test]
fn layer_memory_descs_match_moriio_bytes() {
    let expected: Vec<LayerMemoryDesc> = (0..3u8)
        .map(|i| {
            let mut desc = b"\x01memdesc-".to_vec();
            desc.extend(std::iter::repeat_n(i, usize::from(i) + 1));
            LayerMemoryDesc { layer_name: format!("model.layers.{i}.self_attn.attn"), descs: vec![desc] }
        })
        .collect();
    let bytes = fixture("handshake_layers.msgpack");
    assert_eq!(decode_layer_memory_descs(&bytes), Ok(expected.clone()));
    assert_eq!(encode_layer_memory_descs(&expected), bytes);
}

#[test]
fn malformed_fixtures_give_typed_errors() {
    let cases = [
        (
            "malformed_release_zero_tp_size.msgpack",
            WireError::OutOfRange { field: "consumer_tp_size", value: 0, min: 1, max: 65535 },
        ),
        (
            "malformed_partial_sender.msgpack",
            WireError::PartialGroup { group: "sender", missing: "sender_dp_rank" },
        ),
    ];
    for (name, expected) in cases {
        assert_eq!(decode(&fixture(name)), Err(expected), "{name}");
    }
}
