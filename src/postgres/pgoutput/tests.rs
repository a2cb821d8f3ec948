//! Hand-built fixtures for every message type, plus property tests: encode
//! then decode round-trips, every truncation of a valid message is an error,
//! and arbitrary bytes never panic.

use super::*;
use proptest::prelude::*;

/// Test-side encoder: the inverse of [`decode`], written from the manual.
fn encode(msg: &LogicalMessage, in_stream: bool) -> Vec<u8> {
    let mut b = Vec::new();
    let xid = |b: &mut Vec<u8>, xid: Option<u32>| {
        if in_stream {
            b.extend_from_slice(&xid.unwrap_or(0).to_be_bytes());
        }
    };
    let cstr = |b: &mut Vec<u8>, s: &str| {
        b.extend_from_slice(s.as_bytes());
        b.push(0);
    };
    fn tuple(b: &mut Vec<u8>, t: &Tuple) {
        b.extend_from_slice(&(t.len() as i16).to_be_bytes());
        for v in t {
            match v {
                TupleValue::Null => b.push(b'n'),
                TupleValue::UnchangedToast => b.push(b'u'),
                TupleValue::Text(d) | TupleValue::Binary(d) => {
                    b.push(if matches!(v, TupleValue::Text(_)) {
                        b't'
                    } else {
                        b'b'
                    });
                    b.extend_from_slice(&(d.len() as i32).to_be_bytes());
                    b.extend_from_slice(d);
                }
            }
        }
    }
    fn old(b: &mut Vec<u8>, o: &OldTuple) {
        match o {
            OldTuple::Key(t) => {
                b.push(b'K');
                tuple(b, t)
            }
            OldTuple::Full(t) => {
                b.push(b'O');
                tuple(b, t)
            }
        }
    }
    match msg {
        LogicalMessage::Begin(m) => {
            b.push(b'B');
            b.extend_from_slice(&m.final_lsn.0.to_be_bytes());
            b.extend_from_slice(&m.commit_time.0.to_be_bytes());
            b.extend_from_slice(&m.xid.to_be_bytes());
        }
        LogicalMessage::Commit(m) => {
            b.push(b'C');
            b.push(m.flags);
            b.extend_from_slice(&m.commit_lsn.0.to_be_bytes());
            b.extend_from_slice(&m.end_lsn.0.to_be_bytes());
            b.extend_from_slice(&m.commit_time.0.to_be_bytes());
        }
        LogicalMessage::Origin(m) => {
            b.push(b'O');
            b.extend_from_slice(&m.commit_lsn.0.to_be_bytes());
            cstr(&mut b, &m.name);
        }
        LogicalMessage::Relation(m) => {
            b.push(b'R');
            xid(&mut b, m.xid);
            b.extend_from_slice(&m.id.to_be_bytes());
            cstr(&mut b, &m.namespace);
            cstr(&mut b, &m.name);
            b.push(m.replica_identity);
            b.extend_from_slice(&(m.columns.len() as i16).to_be_bytes());
            for c in &m.columns {
                b.push(c.flags);
                cstr(&mut b, &c.name);
                b.extend_from_slice(&c.type_oid.to_be_bytes());
                b.extend_from_slice(&c.type_modifier.to_be_bytes());
            }
        }
        LogicalMessage::Type(m) => {
            b.push(b'Y');
            xid(&mut b, m.xid);
            b.extend_from_slice(&m.id.to_be_bytes());
            cstr(&mut b, &m.namespace);
            cstr(&mut b, &m.name);
        }
        LogicalMessage::Insert(m) => {
            b.push(b'I');
            xid(&mut b, m.xid);
            b.extend_from_slice(&m.relation_id.to_be_bytes());
            b.push(b'N');
            tuple(&mut b, &m.new);
        }
        LogicalMessage::Update(m) => {
            b.push(b'U');
            xid(&mut b, m.xid);
            b.extend_from_slice(&m.relation_id.to_be_bytes());
            if let Some(o) = &m.old {
                old(&mut b, o);
            }
            b.push(b'N');
            tuple(&mut b, &m.new);
        }
        LogicalMessage::Delete(m) => {
            b.push(b'D');
            xid(&mut b, m.xid);
            b.extend_from_slice(&m.relation_id.to_be_bytes());
            old(&mut b, &m.old);
        }
        LogicalMessage::Truncate(m) => {
            b.push(b'T');
            xid(&mut b, m.xid);
            b.extend_from_slice(&(m.relation_ids.len() as i32).to_be_bytes());
            b.push(m.options);
            for id in &m.relation_ids {
                b.extend_from_slice(&id.to_be_bytes());
            }
        }
        LogicalMessage::Message(m) => {
            b.push(b'M');
            xid(&mut b, m.xid);
            b.push(m.flags);
            b.extend_from_slice(&m.lsn.0.to_be_bytes());
            cstr(&mut b, &m.prefix);
            b.extend_from_slice(&(m.content.len() as i32).to_be_bytes());
            b.extend_from_slice(&m.content);
        }
        LogicalMessage::StreamStart(m) => {
            b.push(b'S');
            b.extend_from_slice(&m.xid.to_be_bytes());
            b.push(u8::from(m.first_segment));
        }
        LogicalMessage::StreamStop => b.push(b'E'),
        LogicalMessage::StreamCommit(m) => {
            b.push(b'c');
            b.extend_from_slice(&m.xid.to_be_bytes());
            b.push(m.flags);
            b.extend_from_slice(&m.commit_lsn.0.to_be_bytes());
            b.extend_from_slice(&m.end_lsn.0.to_be_bytes());
            b.extend_from_slice(&m.commit_time.0.to_be_bytes());
        }
        LogicalMessage::StreamAbort(m) => {
            b.push(b'A');
            b.extend_from_slice(&m.xid.to_be_bytes());
            b.extend_from_slice(&m.subxid.to_be_bytes());
            if let (Some(lsn), Some(ts)) = (m.abort_lsn, m.abort_time) {
                b.extend_from_slice(&lsn.0.to_be_bytes());
                b.extend_from_slice(&ts.0.to_be_bytes());
            }
        }
    }
    b
}

fn dec(bytes: &[u8], in_stream: bool) -> Result<LogicalMessage, DecodeError> {
    decode(Bytes::copy_from_slice(bytes), in_stream)
}

#[test]
fn begin_fixture() {
    let mut b = vec![b'B'];
    b.extend_from_slice(&0x0000_0001_0000_00A0u64.to_be_bytes());
    b.extend_from_slice(&1_000_000i64.to_be_bytes());
    b.extend_from_slice(&742u32.to_be_bytes());
    assert_eq!(
        dec(&b, false).unwrap(),
        LogicalMessage::Begin(Begin {
            final_lsn: "1/A0".parse().unwrap(),
            commit_time: PgTimestamp(1_000_000),
            xid: 742,
        })
    );
    assert_eq!(PgTimestamp(0).unix_micros(), 946_684_800_000_000);
}

#[test]
fn commit_fixture() {
    let mut b = vec![b'C', 0];
    b.extend_from_slice(&0x10u64.to_be_bytes());
    b.extend_from_slice(&0x38u64.to_be_bytes());
    b.extend_from_slice(&(-5i64).to_be_bytes());
    let LogicalMessage::Commit(c) = dec(&b, false).unwrap() else {
        panic!("not a commit")
    };
    assert_eq!(
        (c.commit_lsn, c.end_lsn, c.commit_time),
        (Lsn(0x10), Lsn(0x38), PgTimestamp(-5))
    );
}

#[test]
fn relation_and_insert_fixture() {
    let mut b = vec![b'R'];
    b.extend_from_slice(&16384u32.to_be_bytes());
    b.extend_from_slice(b"public\0outbox\0");
    b.push(b'd');
    b.extend_from_slice(&2i16.to_be_bytes());
    b.push(1);
    b.extend_from_slice(b"id\0");
    b.extend_from_slice(&2950u32.to_be_bytes());
    b.extend_from_slice(&(-1i32).to_be_bytes());
    b.push(0);
    b.extend_from_slice(b"payload\0");
    b.extend_from_slice(&3802u32.to_be_bytes());
    b.extend_from_slice(&(-1i32).to_be_bytes());
    let LogicalMessage::Relation(r) = dec(&b, false).unwrap() else {
        panic!("not a relation")
    };
    assert_eq!(
        (r.id, r.namespace.as_str(), r.name.as_str()),
        (16384, "public", "outbox")
    );
    assert_eq!(r.columns[0].name, "id");
    assert_eq!(r.columns[0].flags, 1);
    assert_eq!(r.columns[1].type_oid, 3802);

    let mut i = vec![b'I'];
    i.extend_from_slice(&16384u32.to_be_bytes());
    i.push(b'N');
    i.extend_from_slice(&4i16.to_be_bytes());
    i.push(b't');
    i.extend_from_slice(&2i32.to_be_bytes());
    i.extend_from_slice(b"{}");
    i.push(b'n');
    i.push(b'u');
    i.push(b'b');
    i.extend_from_slice(&1i32.to_be_bytes());
    i.push(0xff);
    assert_eq!(
        dec(&i, false).unwrap(),
        LogicalMessage::Insert(Insert {
            xid: None,
            relation_id: 16384,
            new: vec![
                TupleValue::Text(Bytes::from_static(b"{}")),
                TupleValue::Null,
                TupleValue::UnchangedToast,
                TupleValue::Binary(Bytes::from_static(&[0xff])),
            ],
        })
    );
}

#[test]
fn streamed_messages_carry_xid_only_inside_a_stream() {
    let mut d = PgOutputDecoder::new();
    let mut start = vec![b'S'];
    start.extend_from_slice(&99u32.to_be_bytes());
    start.push(1);
    assert_eq!(
        d.decode(Bytes::from(start)).unwrap(),
        LogicalMessage::StreamStart(StreamStart {
            xid: 99,
            first_segment: true
        })
    );
    let mut ins = vec![b'I'];
    ins.extend_from_slice(&99u32.to_be_bytes());
    ins.extend_from_slice(&7u32.to_be_bytes());
    ins.extend_from_slice(&[b'N', 0, 0]);
    let LogicalMessage::Insert(m) = d.decode(Bytes::from(ins)).unwrap() else {
        panic!("not an insert")
    };
    assert_eq!((m.xid, m.relation_id), (Some(99), 7));
    assert_eq!(
        d.decode(Bytes::from_static(b"E")).unwrap(),
        LogicalMessage::StreamStop
    );
    // Outside the stream the same bytes read the xid as the relation id and
    // then find a wrong marker: it is an error, not a silent misread.
    let mut ins2 = vec![b'I'];
    ins2.extend_from_slice(&99u32.to_be_bytes());
    ins2.extend_from_slice(&7u32.to_be_bytes());
    assert!(matches!(
        d.decode(Bytes::from(ins2)),
        Err(DecodeError::UnexpectedTupleMarker {
            message: "INSERT",
            ..
        })
    ));
}

#[test]
fn stream_abort_with_and_without_parallel_fields() {
    let mut a = vec![b'A'];
    a.extend_from_slice(&5u32.to_be_bytes());
    a.extend_from_slice(&6u32.to_be_bytes());
    let LogicalMessage::StreamAbort(m) = dec(&a, false).unwrap() else {
        panic!()
    };
    assert_eq!((m.xid, m.subxid, m.abort_lsn), (5, 6, None));
    a.extend_from_slice(&0x99u64.to_be_bytes());
    a.extend_from_slice(&7i64.to_be_bytes());
    let LogicalMessage::StreamAbort(m) = dec(&a, false).unwrap() else {
        panic!()
    };
    assert_eq!(
        (m.abort_lsn, m.abort_time),
        (Some(Lsn(0x99)), Some(PgTimestamp(7)))
    );
}

#[test]
fn malformed_inputs_are_typed_errors() {
    assert_eq!(dec(b"", false), Err(DecodeError::Empty));
    assert_eq!(dec(b"Z", false), Err(DecodeError::UnknownMessage(b'Z')));
    assert!(matches!(
        dec(b"B\0\0", false),
        Err(DecodeError::Truncated {
            field: "final LSN",
            ..
        })
    ));
    // Relation name without its NUL terminator.
    let mut r = vec![b'R', 0, 0, 0, 1];
    r.extend_from_slice(b"public\0outb");
    assert!(matches!(
        dec(&r, false),
        Err(DecodeError::Truncated {
            field: "relation name",
            ..
        })
    ));
    // Invalid UTF-8 in an origin name.
    let mut o = vec![b'O'];
    o.extend_from_slice(&0u64.to_be_bytes());
    o.extend_from_slice(&[0xc3, 0x28, 0]);
    assert!(matches!(dec(&o, false), Err(DecodeError::InvalidUtf8 { .. })));
    // Unknown column kind.
    let mut i = vec![b'I', 0, 0, 0, 1, b'N', 0, 1, b'x'];
    assert!(matches!(
        dec(&i, false),
        Err(DecodeError::UnknownColumnKind { kind: b'x', .. })
    ));
    // Negative column length.
    i.truncate(8);
    i.push(b't');
    i.extend_from_slice(&(-2i32).to_be_bytes());
    assert!(matches!(dec(&i, false), Err(DecodeError::Negative { .. })));
    // Column length beyond the message.
    i.truncate(9);
    i.extend_from_slice(&i32::MAX.to_be_bytes());
    assert!(matches!(
        dec(&i, false),
        Err(DecodeError::Truncated {
            field: "column value",
            ..
        })
    ));
    // A hostile column count is refused before allocating.
    let huge = [b'I', 0, 0, 0, 1, b'N', 0x7f, 0xff];
    assert!(matches!(dec(&huge, false), Err(DecodeError::Truncated { .. })));
    // A hostile truncate count likewise.
    let t = [b'T', 0x7f, 0xff, 0xff, 0xff, 0];
    assert!(matches!(dec(&t, false), Err(DecodeError::Truncated { .. })));
    // Wrong markers in UPDATE and DELETE.
    assert!(matches!(
        dec(&[b'U', 0, 0, 0, 1, b'X'], false),
        Err(DecodeError::UnexpectedTupleMarker {
            message: "UPDATE",
            ..
        })
    ));
    assert!(matches!(
        dec(&[b'D', 0, 0, 0, 1, b'N'], false),
        Err(DecodeError::UnexpectedTupleMarker {
            message: "DELETE",
            ..
        })
    ));
    // Errors say what went wrong.
    let text = dec(b"B", false).unwrap_err().to_string();
    assert!(text.contains("truncated") && text.contains("final LSN"), "{text}");
}

fn arb_bytes() -> impl Strategy<Value = Bytes> {
    proptest::collection::vec(any::<u8>(), 0..40).prop_map(Bytes::from)
}

fn arb_name() -> impl Strategy<Value = String> {
    "[a-zA-Z_é한]{0,12}"
}

fn arb_value() -> impl Strategy<Value = TupleValue> {
    prop_oneof![
        Just(TupleValue::Null),
        Just(TupleValue::UnchangedToast),
        arb_bytes().prop_map(TupleValue::Text),
        arb_bytes().prop_map(TupleValue::Binary),
    ]
}

fn arb_tuple() -> impl Strategy<Value = Tuple> {
    proptest::collection::vec(arb_value(), 0..6)
}

fn arb_old() -> impl Strategy<Value = OldTuple> {
    prop_oneof![
        arb_tuple().prop_map(OldTuple::Key),
        arb_tuple().prop_map(OldTuple::Full)
    ]
}

/// Any message together with whether it is sent inside a stream block.
fn arb_message() -> impl Strategy<Value = (LogicalMessage, bool)> {
    let lsn = any::<u64>().prop_map(Lsn);
    let ts = any::<i64>().prop_map(PgTimestamp);
    let in_stream = any::<bool>();
    let data_xid = |s: bool, x: u32| if s { Some(x) } else { None };
    prop_oneof![
        (lsn.clone(), ts.clone(), any::<u32>()).prop_map(|(final_lsn, commit_time, xid)| {
            (
                LogicalMessage::Begin(Begin {
                    final_lsn,
                    commit_time,
                    xid,
                }),
                false,
            )
        }),
        (any::<u8>(), lsn.clone(), lsn.clone(), ts.clone()).prop_map(|(flags, c, e, t)| {
            (
                LogicalMessage::Commit(Commit {
                    flags,
                    commit_lsn: c,
                    end_lsn: e,
                    commit_time: t,
                }),
                false,
            )
        }),
        (lsn.clone(), arb_name())
            .prop_map(|(commit_lsn, name)| { (LogicalMessage::Origin(Origin { commit_lsn, name }), false) }),
        (
            in_stream,
            any::<u32>(),
            any::<u32>(),
            arb_name(),
            arb_name(),
            any::<u8>(),
            proptest::collection::vec((any::<u8>(), arb_name(), any::<u32>(), any::<i32>()), 0..5)
        )
            .prop_map(move |(s, x, id, namespace, name, ri, cols)| {
                let columns = cols
                    .into_iter()
                    .map(|(flags, name, type_oid, type_modifier)| RelationColumn {
                        flags,
                        name,
                        type_oid,
                        type_modifier,
                    })
                    .collect();
                let xid = data_xid(s, x);
                (
                    LogicalMessage::Relation(Relation {
                        xid,
                        id,
                        namespace,
                        name,
                        replica_identity: ri,
                        columns,
                    }),
                    s,
                )
            }),
        (in_stream, any::<u32>(), any::<u32>(), arb_name(), arb_name()).prop_map(
            move |(s, x, id, namespace, name)| {
                (
                    LogicalMessage::Type(TypeInfo {
                        xid: data_xid(s, x),
                        id,
                        namespace,
                        name,
                    }),
                    s,
                )
            }
        ),
        (in_stream, any::<u32>(), any::<u32>(), arb_tuple()).prop_map(move |(s, x, r, new)| {
            (
                LogicalMessage::Insert(Insert {
                    xid: data_xid(s, x),
                    relation_id: r,
                    new,
                }),
                s,
            )
        }),
        (
            in_stream,
            any::<u32>(),
            any::<u32>(),
            proptest::option::of(arb_old()),
            arb_tuple()
        )
            .prop_map(move |(s, x, r, old, new)| {
                (
                    LogicalMessage::Update(Update {
                        xid: data_xid(s, x),
                        relation_id: r,
                        old,
                        new,
                    }),
                    s,
                )
            }),
        (in_stream, any::<u32>(), any::<u32>(), arb_old()).prop_map(move |(s, x, r, old)| {
            (
                LogicalMessage::Delete(Delete {
                    xid: data_xid(s, x),
                    relation_id: r,
                    old,
                }),
                s,
            )
        }),
        (
            in_stream,
            any::<u32>(),
            any::<u8>(),
            proptest::collection::vec(any::<u32>(), 0..6)
        )
            .prop_map(move |(s, x, options, relation_ids)| {
                (
                    LogicalMessage::Truncate(Truncate {
                        xid: data_xid(s, x),
                        options,
                        relation_ids,
                    }),
                    s,
                )
            }),
        (
            in_stream,
            any::<u32>(),
            any::<u8>(),
            lsn.clone(),
            arb_name(),
            arb_bytes()
        )
            .prop_map(move |(s, x, flags, lsn, prefix, content)| {
                (
                    LogicalMessage::Message(LogicalDecodingMessage {
                        xid: data_xid(s, x),
                        flags,
                        lsn,
                        prefix,
                        content,
                    }),
                    s,
                )
            }),
        (any::<u32>(), any::<bool>()).prop_map(|(xid, first_segment)| {
            (
                LogicalMessage::StreamStart(StreamStart { xid, first_segment }),
                false,
            )
        }),
        Just((LogicalMessage::StreamStop, true)),
        (any::<u32>(), any::<u8>(), lsn.clone(), lsn.clone(), ts.clone()).prop_map(
            |(xid, flags, c, e, t)| {
                (
                    LogicalMessage::StreamCommit(StreamCommit {
                        xid,
                        flags,
                        commit_lsn: c,
                        end_lsn: e,
                        commit_time: t,
                    }),
                    false,
                )
            }
        ),
        (any::<u32>(), any::<u32>(), proptest::option::of((lsn, ts))).prop_map(|(xid, subxid, tail)| {
            (
                LogicalMessage::StreamAbort(StreamAbort {
                    xid,
                    subxid,
                    abort_lsn: tail.map(|t| t.0),
                    abort_time: tail.map(|t| t.1),
                }),
                false,
            )
        }),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: std::env::var("PGOUTPUT_PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(2048),
        ..ProptestConfig::default()
    })]

    #[test]
    fn encode_then_decode_round_trips((msg, in_stream) in arb_message()) {
        let bytes = encode(&msg, in_stream);
        prop_assert_eq!(dec(&bytes, in_stream).unwrap(), msg);
    }

    #[test]
    fn every_truncation_is_an_error((msg, in_stream) in arb_message()) {
        let bytes = encode(&msg, in_stream);
        // StreamAbort's tail is optional: cutting exactly there is valid.
        let optional_cut = matches!(msg, LogicalMessage::StreamAbort(StreamAbort { abort_lsn: Some(_), .. }))
            .then_some(9);
        for cut in 0..bytes.len() {
            if Some(cut) == optional_cut {
                continue;
            }
            prop_assert!(dec(&bytes[..cut], in_stream).is_err(), "cut at {} of {:?}", cut, msg);
        }
    }

    #[test]
    fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..256), in_stream in any::<bool>()) {
        // Never a panic; and whatever does decode is read consistently.
        if let Ok(msg) = dec(&bytes, in_stream) {
            prop_assert_eq!(dec(&encode(&msg, in_stream), in_stream).unwrap(), msg);
        }
    }

    #[test]
    fn mutated_valid_messages_never_panic((msg, in_stream) in arb_message(), pos in any::<usize>(), byte in any::<u8>()) {
        let mut bytes = encode(&msg, in_stream);
        if !bytes.is_empty() {
            let i = pos % bytes.len();
            bytes[i] = byte;
        }
        if let Ok(decoded) = dec(&bytes, in_stream) {
            prop_assert_eq!(dec(&encode(&decoded, in_stream), in_stream).unwrap(), decoded);
        }
    }
}
