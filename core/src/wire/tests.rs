//! The wire codec's tests: every message round-trips, the bytes match what MoRIIO's Python packs,
//! older forms decode, and malformed input (tables and a mutation property) gives typed errors.

use proptest::prelude::*;
use serde::ser::{SerializeMap, SerializeSeq};
use serde::{Serialize, Serializer};

use super::fields::U32_MAX;
use super::*;
use crate::ids::{Incarnation, TransferId};
use crate::release::ReleaseSender;

/// A test-only MessagePack value, serialized by rmp-serde, to build malformed maps.
#[derive(Clone, Debug)]
enum V {
    U(u64),
    I(i64),
    S(String),
    B(Vec<u8>),
    A(Vec<V>),
    M(Vec<(&'static str, V)>),
    Nil,
    F(f64),
}

impl Serialize for V {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            V::U(v) => s.serialize_u64(*v),
            V::I(v) => s.serialize_i64(*v),
            V::S(v) => s.serialize_str(v),
            V::B(v) => s.serialize_bytes(v),
            V::A(items) => {
                let mut seq = s.serialize_seq(Some(items.len()))?;
                for item in items {
                    seq.serialize_element(item)?;
                }
                seq.end()
            }
            V::M(entries) => {
                let mut map = s.serialize_map(Some(entries.len()))?;
                for (k, v) in entries {
                    map.serialize_entry(k, v)?;
                }
                map.end()
            }
            V::Nil => s.serialize_unit(),
            V::F(v) => s.serialize_f64(*v),
        }
    }
}

fn s(v: &str) -> V {
    V::S(v.to_owned())
}

fn pack(entries: Vec<(&'static str, V)>) -> Vec<u8> {
    rmp_serde::to_vec_named(&V::M(entries)).unwrap()
}

const TID: &str = "tx-0c5f2a9e-3b7d-4e21-9a64-8f1d2c3b4a5e";

fn tid() -> TransferId {
    TransferId::new(TID)
}

fn release_map(extra: Vec<(&'static str, V)>) -> Vec<u8> {
    let mut entries = vec![("type", s("release")), ("transfer_id", s(TID))];
    entries.extend(extra);
    pack(entries)
}

/// `msg` with a `pdkv_mac` (bytes 0, 1, ..., 15), for the messages that carry one.
fn with_mac(msg: ControlMessage) -> ControlMessage {
    let mac = Some(crate::auth::Mac(std::array::from_fn(|i| i as u8)));
    match msg {
        ControlMessage::Release(r) => ControlMessage::Release(Release { mac, ..r }),
        ControlMessage::ReadLease(l) => ControlMessage::ReadLease(ReadLease { mac, ..l }),
        other => other,
    }
}

fn release(consumer_tp_size: Option<u16>, sender: Option<(&str, u16, u16)>) -> ControlMessage {
    ControlMessage::Release(Release {
        transfer_id: tid(),
        consumer_tp_size,
        sender: sender.map(|(engine_id, dp_rank, tp_rank)| ReleaseSender {
            engine_id: engine_id.to_owned(),
            dp_rank,
            tp_rank,
        }),
        incarnation: None,
        mac: None,
    })
}

fn metadata(rank: Option<RankInfo>) -> ControlMessage {
    metadata_with(rank, Extensions::NONE)
}

fn metadata_with(rank: Option<RankInfo>, extensions: Extensions) -> ControlMessage {
    ControlMessage::HandshakeMetadata(HandshakeMetadata {
        engine_id: "prefill-0:6301".to_owned(),
        agent_metadata: vec![0, 1, 2, 0xff],
        kv_caches_base_addr: vec![0x7f3a_0000_0000, 5],
        num_blocks: 21504,
        block_len: 73728,
        attn_backend_name: "FLASHMLA".to_owned(),
        rank,
        extensions,
        incarnation: None,
    })
}

/// `msg` with `pdkv_incarnation` set, for the messages that carry one.
fn with_incarnation(msg: ControlMessage, value: u64) -> ControlMessage {
    let inc = Incarnation::new(value);
    match msg {
        ControlMessage::Release(r) => ControlMessage::Release(Release { incarnation: inc, ..r }),
        ControlMessage::ReadLease(l) => ControlMessage::ReadLease(ReadLease { incarnation: inc, ..l }),
        ControlMessage::HandshakeMetadata(m) => {
            ControlMessage::HandshakeMetadata(HandshakeMetadata { incarnation: inc, ..m })
        }
        other => other,
    }
}

fn check(input: &[u8], expected: Result<ControlMessage, WireError>) {
    assert_eq!(decode(input), expected, "input {input:02x?}");
}

/// Every message kind survives encode then decode, and the bytes start as MoRIIO's do.
#[test]
fn every_message_round_trips() {
    let messages = [
        release(Some(8), None),
        release(None, None),
        release(Some(8), Some(("decode-0:6301", 3, 5))),
        release(None, Some(("d", 0, 9))),
        ControlMessage::LegacyCompletion(tid()),
        ControlMessage::RemoteBlocks(RemoteBlocks {
            req_id: "cmpl-1".to_owned(),
            transfer_id: tid(),
            block_ids: vec![0, 127, 128, 65536, u32::MAX],
            decode_dp_rank: 7,
        }),
        ControlMessage::WriteDone(WriteDone::single(tid())),
        ControlMessage::WriteDone(WriteDone { transfer_id: tid(), writers: 2 }),
        ControlMessage::WriteDone(WriteDone { transfer_id: tid(), writers: u16::MAX }),
        ControlMessage::WriteFailed(WriteFailed { transfer_id: tid() }),
        ControlMessage::ReadLease(ReadLease {
            transfer_id: tid(),
            lease_ms: 30_000,
            incarnation: None,
            mac: None,
        }),
        with_incarnation(
            ControlMessage::ReadLease(ReadLease {
                transfer_id: tid(),
                lease_ms: 1,
                incarnation: None,
                mac: None,
            }),
            1,
        ),
        with_incarnation(release(Some(8), Some(("decode-0:6301", 3, 5))), Incarnation::MAX),
        with_incarnation(metadata_with(None, Extensions::ALL), 0x1234_5678_9abc),
        with_mac(with_incarnation(release(Some(8), Some(("decode-0:6301", 3, 5))), 9)),
        with_mac(ControlMessage::ReadLease(ReadLease {
            transfer_id: tid(),
            lease_ms: 30_000,
            incarnation: None,
            mac: None,
        })),
        metadata_with(None, Extensions::ALL.with(crate::wire::Extension::Auth)),
        ControlMessage::HandshakeRequest,
        metadata(None),
        metadata(Some(RankInfo { dp_rank: 1, tp_rank: 3, tp_size: 8 })),
        metadata_with(None, Extensions::ALL),
        metadata_with(Some(RankInfo { dp_rank: 1, tp_rank: 3, tp_size: 8 }), Extensions::ALL),
    ];
    for msg in messages {
        let bytes = encode(&msg);
        check(&bytes, Ok(msg));
    }
}

/// Exact bytes of the release Python's `msgpack.packb` builds (key order type, transfer_id,
/// consumer_tp_size), and the raw bytes of the legacy completion.
#[test]
fn encodes_the_bytes_moriio_sends() {
    let check_bytes = |msg: ControlMessage, expected: &[u8]| assert_eq!(encode(&msg), expected);
    let mut release_bytes = vec![0x83, 0xa4];
    release_bytes.extend(b"type\xa7release\xabtransfer_id\xd9\x27");
    release_bytes.extend(TID.as_bytes());
    release_bytes.extend(b"\xb0consumer_tp_size\x08");
    check_bytes(release(Some(8), None), &release_bytes);
    check_bytes(ControlMessage::LegacyCompletion(tid()), TID.as_bytes());
    check_bytes(ControlMessage::HandshakeRequest, b"get_meta_msg");
    check_bytes(
        ControlMessage::WriteDone(WriteDone::single(TransferId::new("t"))),
        b"\x82\xa4type\xaawrite_done\xabtransfer_id\xa1t",
    );
    // vLLM 0.33's payload: {"type", "transfer_id"} updated with num_writers when not 1.
    check_bytes(
        ControlMessage::WriteDone(WriteDone { transfer_id: TransferId::new("t"), writers: 8 }),
        b"\x83\xa4type\xaawrite_done\xabtransfer_id\xa1t\xabnum_writers\x08",
    );
    check_bytes(
        ControlMessage::WriteFailed(WriteFailed { transfer_id: TransferId::new("t") }),
        b"\x82\xa4type\xacwrite_failed\xabtransfer_id\xa1t",
    );
}

/// A `write_done` names at least one writer: 0 would complete a transfer nobody wrote.
#[test]
fn write_done_refuses_zero_writers() {
    let bytes = pack(vec![("type", s("write_done")), ("transfer_id", s(TID)), ("num_writers", V::U(0))]);
    check(
        &bytes,
        Err(WireError::OutOfRange { field: "num_writers", value: 0, min: 1, max: i128::from(u16::MAX) }),
    );
    let bytes = pack(vec![("type", s("write_done")), ("transfer_id", s(TID)), ("num_writers", V::U(65536))]);
    assert!(decode(&bytes).is_err());
}

/// Forms a MoRIIO peer produces that pdkv accepts without producing them itself.
#[test]
fn accepts_older_and_tolerated_forms() {
    // A msgpack str as a legacy completion; raw ASCII text including a single digit.
    check(b"\xa4tx-1", Ok(ControlMessage::LegacyCompletion(TransferId::new("tx-1"))));
    check(b"7", Ok(ControlMessage::LegacyCompletion(TransferId::new("7"))));
    // remote_blocks without `type` (MoRIIO infers it from `req_id`) or `decode_rank`.
    check(
        &pack(vec![("req_id", s("r")), ("transfer_id", s(TID)), ("block_notify_list", V::A(vec![V::U(4)]))]),
        Ok(ControlMessage::RemoteBlocks(RemoteBlocks {
            req_id: "r".to_owned(),
            transfer_id: tid(),
            block_ids: vec![4],
            decode_dp_rank: 0,
        })),
    );
    // Unknown keys anywhere, holding any well-formed value, are ignored.
    check(
        &release_map(vec![
            ("consumer_tp_size", V::U(2)),
            ("future", V::M(vec![("x", V::A(vec![V::F(1.5), V::Nil, V::B(vec![0xff])]))])),
        ]),
        Ok(release(Some(2), None)),
    );
    // Python packs small ints as fixints, but a signed or wider int is the same number.
    check(&release_map(vec![("consumer_tp_size", V::I(4))]), Ok(release(Some(4), None)));
}

/// Malformed inputs, each with the exact error.
#[test]
fn rejects_malformed_input_with_typed_errors() {
    use WireError::*;
    let mut too_deep = V::Nil;
    for _ in 0..MAX_DEPTH {
        too_deep = V::A(vec![too_deep]);
    }
    let valid = release_map(vec![("consumer_tp_size", V::U(8))]);
    let mut trailing = valid.clone();
    trailing.push(0x00);
    let cases: Vec<(Vec<u8>, WireError)> = vec![
        (vec![], Empty),
        (vec![b'a'; MAX_MESSAGE_BYTES + 1], TooLarge { len: MAX_MESSAGE_BYTES + 1, max: MAX_MESSAGE_BYTES }),
        (valid[..valid.len() - 1].to_vec(), Truncated { offset: valid.len() - 1 }),
        (trailing, TrailingBytes { offset: valid.len(), len: valid.len() + 1 }),
        (vec![0xdf, 0xff, 0xff, 0xff, 0xff], Truncated { offset: 0 }),
        (vec![0x81, 0xa1, b'x', 0xc1], ReservedMarker { offset: 3 }),
        (pack(vec![("deep", too_deep)]), TooDeep { max: MAX_DEPTH }),
        (vec![0xc0], Unrecognized { first_byte: 0xc0 }),
        (b"tx-\xff".to_vec(), InvalidUtf8 { field: "transfer_id" }),
        (vec![0xa2, 0xff, 0xfe], InvalidUtf8 { field: "transfer_id" }),
        (vec![0xa0], EmptyField { field: "transfer_id" }),
        (
            b"\x82\xa4type\xa7release\xabtransfer_id\xa2\xff\xfe".to_vec(),
            InvalidUtf8 { field: "transfer_id" },
        ),
        (vec![0x81, 0x01, 0x02], WrongType { field: "map key", expected: "str", found: "int" }),
        (release_map(vec![("transfer_id", s("again"))]), DuplicateKey { key: "transfer_id".to_owned() }),
        (
            pack(vec![("type", s("ack")), ("transfer_id", s(TID))]),
            UnknownType { type_name: "ack".to_owned() },
        ),
        (pack(vec![("type", V::U(1))]), WrongType { field: "type", expected: "str", found: "int" }),
        (pack(vec![("transfer_id", s(TID))]), MissingField { field: "type" }),
        (pack(vec![("type", s("release"))]), MissingField { field: "transfer_id" }),
        (
            pack(vec![("type", s("read_lease")), ("transfer_id", s(TID)), ("lease_ms", V::U(0))]),
            OutOfRange { field: "lease_ms", value: 0, min: 1, max: i128::from(u32::MAX) },
        ),
        (pack(vec![("type", s("read_lease")), ("transfer_id", s(TID))]), MissingField { field: "lease_ms" }),
        (pack(vec![("type", s("release")), ("transfer_id", s(""))]), EmptyField { field: "transfer_id" }),
        (
            pack(vec![("type", s("release")), ("transfer_id", V::S("x".repeat(MAX_STR_BYTES + 1)))]),
            TooLong { field: "transfer_id", len: MAX_STR_BYTES + 1, max: MAX_STR_BYTES },
        ),
        (
            pack(vec![("type", s("release")), ("transfer_id", V::B(TID.as_bytes().to_vec()))]),
            WrongType { field: "transfer_id", expected: "str", found: "bin" },
        ),
        (
            release_map(vec![("consumer_tp_size", V::U(0))]),
            OutOfRange { field: "consumer_tp_size", value: 0, min: 1, max: 65535 },
        ),
        (
            release_map(vec![("pdkv_incarnation", V::U(0))]),
            OutOfRange { field: "pdkv_incarnation", value: 0, min: 1, max: i128::from(Incarnation::MAX) },
        ),
        (
            release_map(vec![("pdkv_incarnation", V::U(1 << 53))]),
            OutOfRange {
                field: "pdkv_incarnation",
                value: 1 << 53,
                min: 1,
                max: i128::from(Incarnation::MAX),
            },
        ),
        (
            release_map(vec![("pdkv_incarnation", s("7"))]),
            WrongType { field: "pdkv_incarnation", expected: "int", found: "str" },
        ),
        (
            release_map(vec![("pdkv_mac", V::B(vec![0; 15]))]),
            WrongLength { field: "pdkv_mac", len: 15, expected: 16 },
        ),
        (
            release_map(vec![("pdkv_mac", V::B(vec![0; 17]))]),
            WrongLength { field: "pdkv_mac", len: 17, expected: 16 },
        ),
        (
            release_map(vec![("pdkv_mac", s("0123456789abcdef"))]),
            WrongType { field: "pdkv_mac", expected: "bin", found: "str" },
        ),
        (
            release_map(vec![("consumer_tp_size", V::I(-1))]),
            OutOfRange { field: "consumer_tp_size", value: -1, min: 1, max: 65535 },
        ),
        (
            release_map(vec![("consumer_tp_size", V::U(65536))]),
            OutOfRange { field: "consumer_tp_size", value: 65536, min: 1, max: 65535 },
        ),
        (
            release_map(vec![("consumer_tp_size", s("8"))]),
            WrongType { field: "consumer_tp_size", expected: "int", found: "str" },
        ),
        (
            release_map(vec![("consumer_tp_size", V::Nil)]),
            WrongType { field: "consumer_tp_size", expected: "int", found: "nil" },
        ),
        (
            release_map(vec![("sender_engine_id", s("d:1"))]),
            PartialGroup { group: "sender", missing: "sender_dp_rank" },
        ),
        (
            release_map(vec![("sender_engine_id", s("d:1")), ("sender_dp_rank", V::U(0))]),
            PartialGroup { group: "sender", missing: "sender_tp_rank" },
        ),
        (
            release_map(vec![
                ("consumer_tp_size", V::U(4)),
                ("sender_engine_id", s("d:1")),
                ("sender_dp_rank", V::U(0)),
                ("sender_tp_rank", V::U(4)),
            ]),
            RankOutOfGroup { field: "sender_tp_rank", rank: 4, size: 4 },
        ),
        (
            pack(vec![
                ("type", s("remote_blocks")),
                ("req_id", s("r")),
                ("transfer_id", s(TID)),
                ("block_notify_list", V::A(vec![])),
            ]),
            EmptyField { field: "block_notify_list" },
        ),
        (
            pack(vec![
                ("req_id", s("r")),
                ("transfer_id", s(TID)),
                ("block_notify_list", V::A(vec![V::U(0); MAX_BLOCK_IDS + 1])),
            ]),
            TooMany { field: "block_notify_list", len: MAX_BLOCK_IDS + 1, max: MAX_BLOCK_IDS },
        ),
        (
            pack(vec![
                ("req_id", s("r")),
                ("transfer_id", s(TID)),
                ("block_notify_list", V::A(vec![V::I(-3)])),
            ]),
            OutOfRange { field: "block_notify_list", value: -3, min: 0, max: U32_MAX },
        ),
        (
            pack(vec![("engine_id", s("e")), ("agent_metadata", s("not bin"))]),
            WrongType { field: "agent_metadata", expected: "bin", found: "str" },
        ),
        (
            {
                let mut bytes = encode(&metadata(Some(RankInfo { dp_rank: 0, tp_rank: 0, tp_size: 1 })));
                // The last value is `tp_size: 1`; make it 0.
                let last = bytes.len() - 1;
                bytes[last] = 0;
                bytes
            },
            OutOfRange { field: "tp_size", value: 0, min: 1, max: 65535 },
        ),
        (
            encode(&metadata(Some(RankInfo { dp_rank: 0, tp_rank: 8, tp_size: 8 }))),
            RankOutOfGroup { field: "tp_rank", rank: 8, size: 8 },
        ),
    ];
    assert!(cases.len() >= 12);
    for (input, expected) in cases {
        check(&input, Err(expected));
    }
}

/// `pdkv_extensions`: the exact bytes pdkv appends, what a peer's list reads as, and what is
/// refused.
#[test]
fn extensions_are_advertised_by_name() {
    // Appended last: `pdkv_extensions: ["read_lease", "incarnation"]`, then the incarnation.
    let bytes = encode(&metadata_with(None, Extensions::ALL));
    let plain = encode(&metadata(None));
    let mut expected = plain.clone();
    expected[0] += 1; // one more key in the fixmap
    expected.extend(b"\xafpdkv_extensions\x92\xaaread_lease\xabincarnation");
    assert_eq!(bytes, expected);
    let mut with_incarnation_bytes = expected.clone();
    with_incarnation_bytes[0] += 1;
    with_incarnation_bytes.extend(b"\xb0pdkv_incarnation\x2a");
    assert_eq!(encode(&with_incarnation(metadata_with(None, Extensions::ALL), 42)), with_incarnation_bytes);
    assert_eq!(Extensions::NONE.iter().count(), 0);
    assert_eq!(Extensions::ALL.iter().collect::<Vec<_>>(), [Extension::ReadLease, Extension::Incarnation]);
    assert!(Extensions::NONE.with(Extension::ReadLease).has(Extension::ReadLease));
    // MoRIIO's metadata, with vLLM 0.33's layout keys, advertises nothing.
    let with_key = |value: V| {
        let mut entries = vec![
            ("engine_id", s("prefill-0:6301")),
            ("agent_metadata", V::B(vec![0, 1, 2, 0xff])),
            ("kv_caches_base_addr", V::A(vec![V::U(0x7f3a_0000_0000), V::U(5)])),
            ("num_blocks", V::U(21504)),
            ("block_len", V::U(73728)),
            ("attn_backend_name", s("FLASHMLA")),
            ("kv_head_layouts", V::M(vec![("model.layers.0.self_attn.attn", V::A(vec![V::U(8), V::U(0)]))])),
        ];
        entries.extend(value_entry(value));
        decode(&pack(entries))
    };
    fn value_entry(value: V) -> Vec<(&'static str, V)> {
        match value {
            V::Nil => vec![],
            value => vec![("pdkv_extensions", value)],
        }
    }
    let cases: Vec<(V, Result<Extensions, WireError>)> = vec![
        (V::Nil, Ok(Extensions::NONE)),
        (V::A(vec![]), Ok(Extensions::NONE)),
        (V::A(vec![s("read_lease")]), Ok(Extensions::NONE.with(Extension::ReadLease))),
        (V::A(vec![s("incarnation"), s("read_lease")]), Ok(Extensions::ALL)),
        // Names this pdkv does not know (a newer pdkv's) are ignored; repeats are harmless.
        (
            V::A(vec![s("future_thing"), s("read_lease"), s("incarnation"), s("read_lease")]),
            Ok(Extensions::ALL),
        ),
        (V::A(vec![s("future_thing")]), Ok(Extensions::NONE)),
        (
            s("read_lease"),
            Err(WireError::WrongType { field: "pdkv_extensions", expected: "array", found: "str" }),
        ),
        (
            V::A(vec![V::U(1)]),
            Err(WireError::WrongType { field: "pdkv_extensions", expected: "str", found: "int" }),
        ),
        (V::A(vec![s("")]), Err(WireError::EmptyField { field: "pdkv_extensions" })),
        (
            V::A(vec![s("x"); MAX_EXTENSIONS + 1]),
            Err(WireError::TooMany {
                field: "pdkv_extensions",
                len: MAX_EXTENSIONS + 1,
                max: MAX_EXTENSIONS,
            }),
        ),
    ];
    for (value, expected) in cases {
        let got = with_key(value.clone()).map(|m| match m {
            ControlMessage::HandshakeMetadata(m) => m.extensions,
            other => panic!("decoded as {other:?}"),
        });
        assert_eq!(got, expected, "{value:?}");
    }
}

#[test]
fn errors_name_the_field() {
    let text = |e: WireError| e.to_string();
    assert_eq!(
        text(WireError::OutOfRange { field: "consumer_tp_size", value: 0, min: 1, max: 65535 }),
        "field `consumer_tp_size` is 0, outside 1..=65535"
    );
    assert_eq!(
        text(WireError::PartialGroup { group: "sender", missing: "sender_dp_rank" }),
        "the sender fields come all together or not at all, but `sender_dp_rank` is missing"
    );
    assert_eq!(
        text(WireError::TrailingBytes { offset: 3, len: 5 }),
        "2 trailing bytes after the message, which ends at byte 3"
    );
}

#[test]
fn legacy_completion_counts_as_one_plain_release() {
    let plain =
        Release { transfer_id: tid(), consumer_tp_size: None, sender: None, incarnation: None, mac: None };
    assert_eq!(decode(TID.as_bytes()).map(|m| m.as_release()), Ok(Some(plain)));
    assert_eq!(ControlMessage::HandshakeRequest.as_release(), None);
}

fn layers() -> Vec<LayerMemoryDesc> {
    (0..3)
        .map(|i| LayerMemoryDesc {
            layer_name: format!("model.layers.{i}.self_attn.attn"),
            descs: vec![vec![i as u8; i + 1]],
        })
        .collect()
}

#[test]
fn layer_memory_descs_round_trip_and_reject_malformed() {
    let bytes = encode_layer_memory_descs(&layers());
    assert_eq!(decode_layer_memory_descs(&bytes), Ok(layers()));
    const FIELD: &str = "layer memory descriptors";
    let check_layers = |input: Vec<u8>, expected: WireError| {
        assert_eq!(decode_layer_memory_descs(&input), Err(expected), "input {input:02x?}");
    };
    check_layers(vec![0x80], WireError::EmptyField { field: FIELD });
    check_layers(vec![0x90], WireError::WrongType { field: FIELD, expected: "map", found: "array" });
    check_layers(pack(vec![("l", V::A(vec![]))]), WireError::EmptyField { field: FIELD });
    check_layers(
        pack(vec![("l", V::A(vec![s("x")]))]),
        WireError::WrongType { field: FIELD, expected: "bin", found: "str" },
    );
    check_layers(
        pack(vec![("l", V::A(vec![V::B(vec![1])])), ("l", V::A(vec![V::B(vec![2])]))]),
        WireError::DuplicateKey { key: "l".to_owned() },
    );
    check_layers(
        pack(vec![("l", V::A(vec![V::B(vec![0; MAX_BLOB_BYTES + 1])]))]),
        WireError::TooLong { field: FIELD, len: MAX_BLOB_BYTES + 1, max: MAX_BLOB_BYTES },
    );
}

fn arb_id() -> impl Strategy<Value = String> {
    "[a-z][a-z0-9:.-]{0,40}"
}

fn arb_message() -> impl Strategy<Value = ControlMessage> {
    let sender = (arb_id(), any::<u16>(), any::<u16>());
    let incarnation = || prop::option::of((1..=Incarnation::MAX).prop_map(|v| Incarnation::new(v).unwrap()));
    let release = (arb_id(), prop::option::of(1..=u16::MAX), prop::option::of(sender), incarnation())
        .prop_map(|(id, size, sender, incarnation)| {
            ControlMessage::Release(Release {
                transfer_id: TransferId::new(id),
                consumer_tp_size: size,
                sender: sender.map(|(engine_id, dp_rank, tp_rank)| ReleaseSender {
                    engine_id,
                    dp_rank,
                    // The sender's TP rank lies below the TP size it reports.
                    tp_rank: size.map_or(tp_rank, |n| tp_rank % n),
                }),
                incarnation,
                mac: None,
            })
        });
    let legacy = "[!-~][ -~é中]{0,40}"
        .prop_filter("the handshake request is not a transfer id", |id| id.as_bytes() != HANDSHAKE_REQUEST)
        .prop_map(|id| ControlMessage::LegacyCompletion(TransferId::new(id)));
    let blocks = (arb_id(), arb_id(), prop::collection::vec(any::<u32>(), 1..64), any::<u16>()).prop_map(
        |(req_id, id, block_ids, decode_dp_rank)| {
            ControlMessage::RemoteBlocks(RemoteBlocks {
                req_id,
                transfer_id: TransferId::new(id),
                block_ids,
                decode_dp_rank,
            })
        },
    );
    let done = (arb_id(), 1..=u16::MAX).prop_map(|(id, writers)| {
        ControlMessage::WriteDone(WriteDone { transfer_id: TransferId::new(id), writers })
    });
    let failed =
        arb_id().prop_map(|id| ControlMessage::WriteFailed(WriteFailed { transfer_id: TransferId::new(id) }));
    let rank = (any::<u16>(), any::<u16>(), 1..=u16::MAX).prop_map(|(dp_rank, tp_rank, tp_size)| RankInfo {
        dp_rank,
        tp_rank: tp_rank % tp_size,
        tp_size,
    });
    let meta = (
        arb_id(),
        prop::collection::vec(any::<u8>(), 0..64),
        prop::collection::vec(any::<u64>(), 0..8),
        1..=u32::MAX,
        1..=u64::MAX,
        "[A-Z_]{1,16}",
        prop::option::of(rank),
        any::<bool>().prop_map(|all| if all { Extensions::ALL } else { Extensions::NONE }),
        incarnation(),
    )
        .prop_map(
            |(
                engine_id,
                agent_metadata,
                kv_caches_base_addr,
                num_blocks,
                block_len,
                attn,
                rank,
                extensions,
                incarnation,
            )| {
                ControlMessage::HandshakeMetadata(HandshakeMetadata {
                    engine_id,
                    agent_metadata,
                    kv_caches_base_addr,
                    num_blocks,
                    block_len,
                    attn_backend_name: attn,
                    rank,
                    extensions,
                    incarnation,
                })
            },
        );
    let lease = (arb_id(), 1..=u32::MAX, incarnation()).prop_map(|(id, lease_ms, incarnation)| {
        ControlMessage::ReadLease(ReadLease {
            transfer_id: TransferId::new(id),
            lease_ms,
            incarnation,
            mac: None,
        })
    });
    prop_oneof![release, legacy, blocks, done, failed, lease, Just(ControlMessage::HandshakeRequest), meta]
}

/// How a valid encoding is damaged: overwrite, insert or delete a byte, or cut the end.
#[derive(Clone, Debug)]
enum Mutation {
    Set(usize, u8),
    Insert(usize, u8),
    Delete(usize),
    Truncate(usize),
}

fn arb_mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        (any::<usize>(), any::<u8>()).prop_map(|(i, b)| Mutation::Set(i, b)),
        (any::<usize>(), any::<u8>()).prop_map(|(i, b)| Mutation::Insert(i, b)),
        any::<usize>().prop_map(Mutation::Delete),
        any::<usize>().prop_map(Mutation::Truncate),
    ]
}

fn mutate(bytes: &mut Vec<u8>, mutation: &Mutation) {
    let n = bytes.len();
    match *mutation {
        Mutation::Set(i, b) if n > 0 => bytes[i % n] = b,
        Mutation::Insert(i, b) => bytes.insert(i % (n + 1), b),
        Mutation::Delete(i) if n > 0 => {
            bytes.remove(i % n);
        }
        Mutation::Truncate(i) => bytes.truncate(i % (n + 1)),
        _ => {}
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn decode_is_total_on_arbitrary_bytes(bytes in prop::collection::vec(any::<u8>(), 0..256)) {
        // Returning at all, error or not, is the property.
        let _ = decode(&bytes);
        let _ = decode_layer_memory_descs(&bytes);
    }

    #[test]
    fn decode_is_total_on_damaged_messages(
        msg in arb_message(),
        mutations in prop::collection::vec(arb_mutation(), 1..4),
    ) {
        let mut bytes = encode(&msg);
        for mutation in &mutations {
            mutate(&mut bytes, mutation);
        }
        let _ = decode(&bytes);
        let mut layer_bytes = encode_layer_memory_descs(&layers());
        for mutation in &mutations {
            mutate(&mut layer_bytes, mutation);
        }
        let _ = decode_layer_memory_descs(&layer_bytes);
    }

    #[test]
    fn valid_messages_round_trip(msg in arb_message()) {
        prop_assert_eq!(decode(&encode(&msg)), Ok(msg));
    }
}
