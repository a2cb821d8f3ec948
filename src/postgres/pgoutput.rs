//! Decoder for the `pgoutput` logical replication message format.
//!
//! Pure functions over bytes: no I/O, no allocation beyond the decoded
//! values, and every malformed or truncated input returns a
//! [`DecodeError`] instead of panicking. Byte payloads (tuple columns,
//! logical decoding message contents) are zero-copy slices of the input.
//!
//! The format is documented in the PostgreSQL manual, "Logical Replication
//! Message Formats". Protocol version 1 messages are Begin, Commit, Origin,
//! Relation, Type, Insert, Update, Delete, Truncate and Message. Protocol
//! version 2 adds streaming of in-progress transactions: Stream Start / Stop
//! / Commit / Abort, and a leading transaction id on the data messages sent
//! between a Stream Start and its Stream Stop. [`PgOutputDecoder`] tracks that
//! one bit of state; [`decode`] is the stateless form.

use bytes::Bytes;

use crate::lsn::Lsn;

/// Microseconds between the Unix epoch and PostgreSQL's epoch (2000-01-01).
pub const PG_EPOCH_OFFSET_MICROS: i64 = 946_684_800_000_000;

/// A PostgreSQL timestamp: microseconds since 2000-01-01 00:00:00 UTC.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct PgTimestamp(pub i64);

impl PgTimestamp {
    /// Microseconds since the Unix epoch.
    pub fn unix_micros(self) -> i64 {
        self.0.saturating_add(PG_EPOCH_OFFSET_MICROS)
    }
}

/// Why a pgoutput message could not be decoded.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum DecodeError {
    #[error("pgoutput message is empty")]
    Empty,
    #[error("pgoutput message truncated: needed {needed} more byte(s) for {field} at offset {offset}")]
    Truncated {
        field: &'static str,
        offset: usize,
        needed: usize,
    },
    #[error("unknown pgoutput message type 0x{0:02x}; is the slot using the pgoutput plugin with proto_version 1 or 2?")]
    UnknownMessage(u8),
    #[error("unknown tuple column kind {kind:?} at offset {offset}", kind = char::from(*kind))]
    UnknownColumnKind { kind: u8, offset: usize },
    #[error("unexpected tuple marker {found:?} in {message} at offset {offset}", found = char::from(*found))]
    UnexpectedTupleMarker {
        message: &'static str,
        found: u8,
        offset: usize,
    },
    #[error("negative {field} ({value}) at offset {offset}")]
    Negative {
        field: &'static str,
        value: i64,
        offset: usize,
    },
    #[error("{field} at offset {offset} is not valid UTF-8")]
    InvalidUtf8 { field: &'static str, offset: usize },
}

/// One column value in a tuple.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TupleValue {
    /// SQL NULL.
    Null,
    /// A TOASTed value that did not change (UPDATE only); the value is not sent.
    UnchangedToast,
    /// The value in text format.
    Text(Bytes),
    /// The value in binary format (only with the `binary` option).
    Binary(Bytes),
}

impl TupleValue {
    /// The text form, when the value was sent as valid UTF-8 text.
    pub fn as_text(&self) -> Option<&str> {
        match self {
            TupleValue::Text(b) => simdutf8::basic::from_utf8(b).ok(),
            _ => None,
        }
    }
}

/// The columns of a row, in relation column order.
pub type Tuple = Vec<TupleValue>;

/// 'B': start of a transaction.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Begin {
    /// LSN of the commit record (the transaction's final LSN).
    pub final_lsn: Lsn,
    pub commit_time: PgTimestamp,
    pub xid: u32,
}

/// 'C': end of a transaction.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Commit {
    pub flags: u8,
    /// LSN of the commit record.
    pub commit_lsn: Lsn,
    /// End of the commit record: the position to confirm once the
    /// transaction is durably handled.
    pub end_lsn: Lsn,
    pub commit_time: PgTimestamp,
}

/// 'O': the transaction came from another replication origin.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Origin {
    pub commit_lsn: Lsn,
    pub name: String,
}

/// One column of a [`Relation`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RelationColumn {
    /// Bit 1: the column is part of the replica identity key.
    pub flags: u8,
    pub name: String,
    pub type_oid: u32,
    pub type_modifier: i32,
}

/// 'R': describes a table before its first row in the session.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Relation {
    pub xid: Option<u32>,
    pub id: u32,
    pub namespace: String,
    pub name: String,
    pub replica_identity: u8,
    pub columns: Vec<RelationColumn>,
}

/// 'Y': describes a non-builtin data type.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TypeInfo {
    pub xid: Option<u32>,
    pub id: u32,
    pub namespace: String,
    pub name: String,
}

/// 'I': a new row.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Insert {
    pub xid: Option<u32>,
    pub relation_id: u32,
    pub new: Tuple,
}

/// The old row sent with an UPDATE or DELETE.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum OldTuple {
    /// 'K': only the replica identity key columns.
    Key(Tuple),
    /// 'O': the whole old row (REPLICA IDENTITY FULL).
    Full(Tuple),
}

/// 'U': a changed row.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Update {
    pub xid: Option<u32>,
    pub relation_id: u32,
    pub old: Option<OldTuple>,
    pub new: Tuple,
}

/// 'D': a deleted row.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Delete {
    pub xid: Option<u32>,
    pub relation_id: u32,
    pub old: OldTuple,
}

/// 'T': one or more tables were truncated.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Truncate {
    pub xid: Option<u32>,
    /// Bit 1: CASCADE; bit 2: RESTART IDENTITY.
    pub options: u8,
    pub relation_ids: Vec<u32>,
}

/// 'M': a logical decoding message (`pg_logical_emit_message`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LogicalDecodingMessage {
    pub xid: Option<u32>,
    /// Bit 1: the message is transactional.
    pub flags: u8,
    pub lsn: Lsn,
    pub prefix: String,
    pub content: Bytes,
}

/// 'S': start of a block of a streamed in-progress transaction.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StreamStart {
    pub xid: u32,
    pub first_segment: bool,
}

/// 'c': a streamed transaction committed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StreamCommit {
    pub xid: u32,
    pub flags: u8,
    pub commit_lsn: Lsn,
    pub end_lsn: Lsn,
    pub commit_time: PgTimestamp,
}

/// 'A': a streamed (sub)transaction aborted.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StreamAbort {
    pub xid: u32,
    pub subxid: u32,
    /// Present from protocol version 4 (parallel apply) on.
    pub abort_lsn: Option<Lsn>,
    pub abort_time: Option<PgTimestamp>,
}

/// One decoded pgoutput message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LogicalMessage {
    Begin(Begin),
    Commit(Commit),
    Origin(Origin),
    Relation(Relation),
    Type(TypeInfo),
    Insert(Insert),
    Update(Update),
    Delete(Delete),
    Truncate(Truncate),
    Message(LogicalDecodingMessage),
    StreamStart(StreamStart),
    StreamStop,
    StreamCommit(StreamCommit),
    StreamAbort(StreamAbort),
}

/// Decodes a stream of pgoutput messages, remembering whether it is inside a
/// Stream Start / Stream Stop block (where data messages carry a leading xid).
#[derive(Debug, Default)]
pub struct PgOutputDecoder {
    in_stream: bool,
}

impl PgOutputDecoder {
    pub fn new() -> Self {
        Self::default()
    }

    /// Decodes one message and updates the streaming state.
    pub fn decode(&mut self, data: Bytes) -> Result<LogicalMessage, DecodeError> {
        let msg = decode(data, self.in_stream)?;
        match msg {
            LogicalMessage::StreamStart(_) => self.in_stream = true,
            LogicalMessage::StreamStop => self.in_stream = false,
            _ => {}
        }
        Ok(msg)
    }
}

/// Decodes one pgoutput message. `in_stream` says whether the message was
/// sent between a Stream Start and a Stream Stop.
pub fn decode(data: Bytes, in_stream: bool) -> Result<LogicalMessage, DecodeError> {
    let mut r = Reader::new(data);
    let tag = r.u8("message type").map_err(|_| DecodeError::Empty)?;
    let stream_xid = |r: &mut Reader| -> Result<Option<u32>, DecodeError> {
        if in_stream {
            Ok(Some(r.u32("xid")?))
        } else {
            Ok(None)
        }
    };
    let msg = match tag {
        b'B' => LogicalMessage::Begin(Begin {
            final_lsn: r.lsn("final LSN")?,
            commit_time: r.timestamp("commit timestamp")?,
            xid: r.u32("xid")?,
        }),
        b'C' => LogicalMessage::Commit(Commit {
            flags: r.u8("commit flags")?,
            commit_lsn: r.lsn("commit LSN")?,
            end_lsn: r.lsn("end LSN")?,
            commit_time: r.timestamp("commit timestamp")?,
        }),
        b'O' => LogicalMessage::Origin(Origin {
            commit_lsn: r.lsn("origin commit LSN")?,
            name: r.cstr("origin name")?,
        }),
        b'R' => {
            let xid = stream_xid(&mut r)?;
            let id = r.u32("relation id")?;
            let namespace = r.cstr("relation namespace")?;
            let name = r.cstr("relation name")?;
            let replica_identity = r.u8("replica identity")?;
            let count = r.count16("relation column count")?;
            let mut columns = Vec::with_capacity(count);
            for _ in 0..count {
                columns.push(RelationColumn {
                    flags: r.u8("column flags")?,
                    name: r.cstr("column name")?,
                    type_oid: r.u32("column type oid")?,
                    type_modifier: r.i32("column type modifier")?,
                });
            }
            LogicalMessage::Relation(Relation {
                xid,
                id,
                namespace,
                name,
                replica_identity,
                columns,
            })
        }
        b'Y' => LogicalMessage::Type(TypeInfo {
            xid: stream_xid(&mut r)?,
            id: r.u32("type oid")?,
            namespace: r.cstr("type namespace")?,
            name: r.cstr("type name")?,
        }),
        b'I' => {
            let xid = stream_xid(&mut r)?;
            let relation_id = r.u32("relation id")?;
            r.expect_marker(b'N', "INSERT")?;
            LogicalMessage::Insert(Insert {
                xid,
                relation_id,
                new: r.tuple()?,
            })
        }
        b'U' => {
            let xid = stream_xid(&mut r)?;
            let relation_id = r.u32("relation id")?;
            let offset = r.pos;
            let old = match r.u8("tuple marker")? {
                b'K' => Some(OldTuple::Key(r.tuple()?)),
                b'O' => Some(OldTuple::Full(r.tuple()?)),
                b'N' => None,
                found => {
                    return Err(DecodeError::UnexpectedTupleMarker {
                        message: "UPDATE",
                        found,
                        offset,
                    })
                }
            };
            if old.is_some() {
                r.expect_marker(b'N', "UPDATE")?;
            }
            LogicalMessage::Update(Update {
                xid,
                relation_id,
                old,
                new: r.tuple()?,
            })
        }
        b'D' => {
            let xid = stream_xid(&mut r)?;
            let relation_id = r.u32("relation id")?;
            let offset = r.pos;
            let old = match r.u8("tuple marker")? {
                b'K' => OldTuple::Key(r.tuple()?),
                b'O' => OldTuple::Full(r.tuple()?),
                found => {
                    return Err(DecodeError::UnexpectedTupleMarker {
                        message: "DELETE",
                        found,
                        offset,
                    })
                }
            };
            LogicalMessage::Delete(Delete {
                xid,
                relation_id,
                old,
            })
        }
        b'T' => {
            let xid = stream_xid(&mut r)?;
            let count = r.count32("truncated relation count")?;
            let options = r.u8("truncate options")?;
            // Each id is four bytes: check before allocating for a hostile count.
            r.ensure(count.saturating_mul(4), "truncated relation ids")?;
            let mut relation_ids = Vec::with_capacity(count);
            for _ in 0..count {
                relation_ids.push(r.u32("truncated relation id")?);
            }
            LogicalMessage::Truncate(Truncate {
                xid,
                options,
                relation_ids,
            })
        }
        b'M' => {
            let xid = stream_xid(&mut r)?;
            let flags = r.u8("message flags")?;
            let lsn = r.lsn("message LSN")?;
            let prefix = r.cstr("message prefix")?;
            let len = r.count32("message length")?;
            LogicalMessage::Message(LogicalDecodingMessage {
                xid,
                flags,
                lsn,
                prefix,
                content: r.bytes(len, "message content")?,
            })
        }
        b'S' => LogicalMessage::StreamStart(StreamStart {
            xid: r.u32("xid")?,
            first_segment: r.u8("first segment flag")? == 1,
        }),
        b'E' => LogicalMessage::StreamStop,
        b'c' => LogicalMessage::StreamCommit(StreamCommit {
            xid: r.u32("xid")?,
            flags: r.u8("commit flags")?,
            commit_lsn: r.lsn("commit LSN")?,
            end_lsn: r.lsn("end LSN")?,
            commit_time: r.timestamp("commit timestamp")?,
        }),
        b'A' => {
            let xid = r.u32("xid")?;
            let subxid = r.u32("subtransaction xid")?;
            let (abort_lsn, abort_time) = if r.remaining() > 0 {
                (Some(r.lsn("abort LSN")?), Some(r.timestamp("abort timestamp")?))
            } else {
                (None, None)
            };
            LogicalMessage::StreamAbort(StreamAbort {
                xid,
                subxid,
                abort_lsn,
                abort_time,
            })
        }
        other => return Err(DecodeError::UnknownMessage(other)),
    };
    Ok(msg)
}

/// A bounds-checked big-endian reader over a message.
struct Reader {
    data: Bytes,
    pos: usize,
}

impl Reader {
    fn new(data: Bytes) -> Self {
        Reader { data, pos: 0 }
    }

    fn remaining(&self) -> usize {
        self.data.len() - self.pos
    }

    fn ensure(&self, n: usize, field: &'static str) -> Result<(), DecodeError> {
        if self.remaining() < n {
            return Err(DecodeError::Truncated {
                field,
                offset: self.pos,
                needed: n - self.remaining(),
            });
        }
        Ok(())
    }

    fn array<const N: usize>(&mut self, field: &'static str) -> Result<[u8; N], DecodeError> {
        self.ensure(N, field)?;
        let mut out = [0u8; N];
        out.copy_from_slice(&self.data[self.pos..self.pos + N]);
        self.pos += N;
        Ok(out)
    }

    fn u8(&mut self, field: &'static str) -> Result<u8, DecodeError> {
        Ok(self.array::<1>(field)?[0])
    }

    fn u32(&mut self, field: &'static str) -> Result<u32, DecodeError> {
        Ok(u32::from_be_bytes(self.array(field)?))
    }

    fn i32(&mut self, field: &'static str) -> Result<i32, DecodeError> {
        Ok(i32::from_be_bytes(self.array(field)?))
    }

    fn lsn(&mut self, field: &'static str) -> Result<Lsn, DecodeError> {
        Ok(Lsn(u64::from_be_bytes(self.array(field)?)))
    }

    fn timestamp(&mut self, field: &'static str) -> Result<PgTimestamp, DecodeError> {
        Ok(PgTimestamp(i64::from_be_bytes(self.array(field)?)))
    }

    fn count16(&mut self, field: &'static str) -> Result<usize, DecodeError> {
        let offset = self.pos;
        let v = i16::from_be_bytes(self.array(field)?);
        usize::try_from(v).map_err(|_| DecodeError::Negative {
            field,
            value: v.into(),
            offset,
        })
    }

    fn count32(&mut self, field: &'static str) -> Result<usize, DecodeError> {
        let offset = self.pos;
        let v = self.i32(field)?;
        usize::try_from(v).map_err(|_| DecodeError::Negative {
            field,
            value: v.into(),
            offset,
        })
    }

    fn bytes(&mut self, n: usize, field: &'static str) -> Result<Bytes, DecodeError> {
        self.ensure(n, field)?;
        let out = self.data.slice(self.pos..self.pos + n);
        self.pos += n;
        Ok(out)
    }

    fn cstr(&mut self, field: &'static str) -> Result<String, DecodeError> {
        let start = self.pos;
        let rest = &self.data[start..];
        let Some(nul) = rest.iter().position(|&b| b == 0) else {
            return Err(DecodeError::Truncated {
                field,
                offset: start,
                needed: 1,
            });
        };
        let s = std::str::from_utf8(&rest[..nul])
            .map_err(|_| DecodeError::InvalidUtf8 { field, offset: start })?
            .to_owned();
        self.pos += nul + 1;
        Ok(s)
    }

    fn expect_marker(&mut self, want: u8, message: &'static str) -> Result<(), DecodeError> {
        let offset = self.pos;
        let found = self.u8("tuple marker")?;
        if found != want {
            return Err(DecodeError::UnexpectedTupleMarker {
                message,
                found,
                offset,
            });
        }
        Ok(())
    }

    fn tuple(&mut self) -> Result<Tuple, DecodeError> {
        let count = self.count16("tuple column count")?;
        // Every column takes at least one byte: refuse hostile counts early.
        self.ensure(count, "tuple columns")?;
        let mut values = Vec::with_capacity(count);
        for _ in 0..count {
            let offset = self.pos;
            let value = match self.u8("column kind")? {
                b'n' => TupleValue::Null,
                b'u' => TupleValue::UnchangedToast,
                b't' => {
                    let len = self.count32("column length")?;
                    TupleValue::Text(self.bytes(len, "column value")?)
                }
                b'b' => {
                    let len = self.count32("column length")?;
                    TupleValue::Binary(self.bytes(len, "column value")?)
                }
                kind => return Err(DecodeError::UnknownColumnKind { kind, offset }),
            };
            values.push(value);
        }
        Ok(values)
    }
}

#[cfg(test)]
mod tests;
