//! The messages carried inside CopyData during streaming replication.
//!
//! After `START_REPLICATION` the server answers CopyBothResponse and then
//! sends CopyData messages whose first byte says what they hold:
//!
//! * `w` XLogData: `wal_start`, `wal_end`, send time, then one pgoutput message;
//! * `k` primary keepalive: `wal_end`, send time and a reply-requested flag.
//!
//! The client sends `r` standby status updates carrying three positions:
//! written (received), flushed and applied. outboxd reports
//! write = received and flush = apply = the LSN whose events Kafka has
//! acknowledged (see `crate::relay::progress`). The server advances the slot's
//! `confirmed_flush_lsn` from the flush position only.

use std::time::{SystemTime, UNIX_EPOCH};

use bytes::{BufMut, Bytes, BytesMut};

use crate::lsn::Lsn;
use crate::postgres::pgoutput::{PgTimestamp, PG_EPOCH_OFFSET_MICROS};

/// A message from the server inside the CopyBoth stream.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ReplicationMessage {
    XLogData(XLogData),
    PrimaryKeepalive(PrimaryKeepalive),
}

/// 'w': a chunk of decoded WAL (one pgoutput message).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct XLogData {
    pub wal_start: Lsn,
    pub wal_end: Lsn,
    pub send_time: PgTimestamp,
    pub data: Bytes,
}

/// 'k': the server's heartbeat.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PrimaryKeepalive {
    /// The current end of WAL on the server.
    pub wal_end: Lsn,
    pub send_time: PgTimestamp,
    /// The server wants a status update now or it may time the connection out.
    pub reply_requested: bool,
}

/// The CopyData payload was not a replication message we understand.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum CopyDataError {
    #[error("replication CopyData message is {len} bytes, too short for a {kind} message")]
    Truncated { kind: &'static str, len: usize },
    #[error("unknown replication CopyData message type 0x{0:02x}")]
    UnknownKind(u8),
}

const XLOG_HEADER: usize = 1 + 8 + 8 + 8;
const KEEPALIVE_LEN: usize = 1 + 8 + 8 + 1;

fn be_u64(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_be_bytes(a)
}

impl ReplicationMessage {
    /// Parses a CopyData payload. The pgoutput bytes of an XLogData are a
    /// zero-copy slice of `payload`.
    pub fn parse(payload: Bytes) -> Result<Self, CopyDataError> {
        match payload.first() {
            Some(b'w') => {
                if payload.len() < XLOG_HEADER {
                    return Err(CopyDataError::Truncated {
                        kind: "XLogData",
                        len: payload.len(),
                    });
                }
                Ok(ReplicationMessage::XLogData(XLogData {
                    wal_start: Lsn(be_u64(&payload, 1)),
                    wal_end: Lsn(be_u64(&payload, 9)),
                    send_time: PgTimestamp(be_u64(&payload, 17) as i64),
                    data: payload.slice(XLOG_HEADER..),
                }))
            }
            Some(b'k') => {
                if payload.len() < KEEPALIVE_LEN {
                    return Err(CopyDataError::Truncated {
                        kind: "primary keepalive",
                        len: payload.len(),
                    });
                }
                Ok(ReplicationMessage::PrimaryKeepalive(PrimaryKeepalive {
                    wal_end: Lsn(be_u64(&payload, 1)),
                    send_time: PgTimestamp(be_u64(&payload, 9) as i64),
                    reply_requested: payload[17] == 1,
                }))
            }
            Some(&other) => Err(CopyDataError::UnknownKind(other)),
            None => Err(CopyDataError::Truncated {
                kind: "replication",
                len: 0,
            }),
        }
    }
}

/// 'r': the client's report of its progress.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StandbyStatusUpdate {
    /// Last WAL position received.
    pub write: Lsn,
    /// Last WAL position durably handled: the slot may release WAL before it.
    pub flush: Lsn,
    /// Last WAL position applied; outboxd reports the flushed position.
    pub apply: Lsn,
    pub client_time: PgTimestamp,
    /// Ask the server to answer at once with a keepalive.
    pub reply_requested: bool,
}

impl StandbyStatusUpdate {
    /// A status update stamped with the current time.
    pub fn now(write: Lsn, flush: Lsn) -> Self {
        StandbyStatusUpdate {
            write,
            flush,
            apply: flush,
            client_time: pg_now(),
            reply_requested: false,
        }
    }

    /// The CopyData payload (without the CopyData frame).
    pub fn encode(&self) -> Bytes {
        let mut b = BytesMut::with_capacity(34);
        b.put_u8(b'r');
        b.put_u64(self.write.0);
        b.put_u64(self.flush.0);
        b.put_u64(self.apply.0);
        b.put_i64(self.client_time.0);
        b.put_u8(u8::from(self.reply_requested));
        b.freeze()
    }
}

/// The current time as a PostgreSQL timestamp.
pub fn pg_now() -> PgTimestamp {
    let micros = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_micros()).unwrap_or(i64::MAX))
        .unwrap_or(0);
    PgTimestamp(micros - PG_EPOCH_OFFSET_MICROS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_xlogdata_and_keeps_payload() {
        let mut b = vec![b'w'];
        b.extend_from_slice(&0x10u64.to_be_bytes());
        b.extend_from_slice(&0x20u64.to_be_bytes());
        b.extend_from_slice(&7i64.to_be_bytes());
        b.extend_from_slice(b"B...");
        let m = ReplicationMessage::parse(Bytes::from(b)).unwrap();
        assert_eq!(
            m,
            ReplicationMessage::XLogData(XLogData {
                wal_start: Lsn(0x10),
                wal_end: Lsn(0x20),
                send_time: PgTimestamp(7),
                data: Bytes::from_static(b"B..."),
            })
        );
    }

    #[test]
    fn parses_keepalive() {
        let mut b = vec![b'k'];
        b.extend_from_slice(&0xABu64.to_be_bytes());
        b.extend_from_slice(&1i64.to_be_bytes());
        b.push(1);
        assert_eq!(
            ReplicationMessage::parse(Bytes::from(b)).unwrap(),
            ReplicationMessage::PrimaryKeepalive(PrimaryKeepalive {
                wal_end: Lsn(0xAB),
                send_time: PgTimestamp(1),
                reply_requested: true,
            })
        );
    }

    #[test]
    fn rejects_short_and_unknown() {
        assert!(matches!(
            ReplicationMessage::parse(Bytes::from_static(b"w123")),
            Err(CopyDataError::Truncated { kind: "XLogData", .. })
        ));
        assert!(matches!(
            ReplicationMessage::parse(Bytes::from_static(b"k")),
            Err(CopyDataError::Truncated { .. })
        ));
        assert_eq!(
            ReplicationMessage::parse(Bytes::from_static(b"q")),
            Err(CopyDataError::UnknownKind(b'q'))
        );
        assert!(ReplicationMessage::parse(Bytes::new()).is_err());
    }

    #[test]
    fn encodes_status_update_as_the_manual_lays_it_out() {
        let u = StandbyStatusUpdate {
            write: Lsn(0x0102),
            flush: Lsn(0x0304),
            apply: Lsn(0x0304),
            client_time: PgTimestamp(9),
            reply_requested: true,
        };
        let b = u.encode();
        assert_eq!(b.len(), 34);
        assert_eq!(b[0], b'r');
        assert_eq!(be_u64(&b, 1), 0x0102);
        assert_eq!(be_u64(&b, 9), 0x0304);
        assert_eq!(be_u64(&b, 17), 0x0304);
        assert_eq!(be_u64(&b, 25), 9);
        assert_eq!(b[33], 1);
        assert!(StandbyStatusUpdate::now(Lsn(1), Lsn(1)).client_time.0 > 0);
    }
}
