//! What a session must show before it trusts where it resumes.
//!
//! A session resumes at the slot's `confirmed_flush_lsn`, `C`. Two things
//! happened, or may have, while no session streamed, and neither leaves a
//! trace in the stream itself:
//!
//! 1. **The publication changed.** pgoutput decides per WAL position, with
//!    the catalog as it was there, whether an outbox INSERT is sent. A
//!    table dropped from the publication and added back while outboxd was
//!    down drops the rows written in between without a trace. So before
//!    streaming, the session shows that the catalog rows deciding delivery
//!    were the same for all WAL from `C` on ([`publication_proof`]):
//!    either each row predates the slot's `catalog_xmin` (every
//!    transaction before it had ended at a position the slot has
//!    confirmed), or the slot register holds the fingerprint an earlier
//!    session proved, and it is the same row for row (`xmin`s included).
//!    Otherwise it stops with the replay command for the window.
//! 2. **The WAL history was rewound.** A disk snapshot restored, or a base
//!    backup recovered to its end, keeps the system identifier and the
//!    timeline, and the LSNs after its end are used again by new
//!    transactions. Kafka then holds events of transactions the server no
//!    longer has, and anything that trusts a remembered LSN (exactly-once
//!    skipping through the progress record; the slot register) would skip
//!    or misjudge new ones. The session remembers a [`Waypoint`]: the last
//!    transaction Kafka is known to hold, by commit record and commit time.
//!    A waypoint past the server's WAL end proves a rewind at once. A slot
//!    that resumes at or before it must stream that very transaction again
//!    (the same commit LSN and commit time) before any later one; until it
//!    has, nothing is confirmed past the slot's own position, so a rewind
//!    found later still confirms nothing it skipped.

use crate::lsn::Lsn;
use crate::postgres::publication::{self, Verified};
use crate::relay::progress::LastCommit;
use crate::relay::slot_register::SlotRecord;
use crate::source::stream::StreamEvent;

/// A transaction Kafka is known to hold, that a resuming slot must meet.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Waypoint {
    pub(super) commit: LastCommit,
    /// What remembers it, for the error: "the progress record", "the slot
    /// register".
    pub(super) source: &'static str,
}

/// How an event of the stream relates to the waypoint.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Passage {
    /// Before the waypoint: keep streaming (and keep confirmation back).
    Before,
    /// The waypoint itself, as remembered: the history is the one streamed.
    Met,
    /// Past the waypoint without meeting it, or another transaction in its
    /// place: the WAL history was rewound.
    Rewound(String),
}

impl Waypoint {
    pub(super) fn new(commit: LastCommit, source: &'static str) -> Self {
        Waypoint { commit, source }
    }

    /// Whether a slot resuming at `confirmed` will stream the waypoint's
    /// transaction again: pgoutput sends each transaction whose commit
    /// record starts at or after the position it resumes from.
    pub(super) fn ahead_of_slot(&self, confirmed: Lsn) -> bool {
        confirmed <= self.commit.commit_lsn
    }

    /// Why the waypoint cannot lie in the WAL of a server whose WAL ends at
    /// `wal_end` (`pg_current_wal_insert_lsn()`), if it cannot.
    pub(super) fn beyond_wal(&self, wal_end: Lsn) -> Option<String> {
        (self.commit.end_lsn > wal_end).then(|| {
            format!(
                "{} names a transaction committed at {} (ending at {}), but this server's WAL ends at {wal_end}",
                self.source, self.commit.commit_lsn, self.commit.end_lsn
            )
        })
    }

    /// Where `ev` stands with respect to the waypoint.
    pub(super) fn pass(&self, ev: &StreamEvent) -> Passage {
        let c = &self.commit;
        match ev {
            StreamEvent::Begin {
                final_lsn, commit_time, ..
            } => {
                if *final_lsn < c.commit_lsn {
                    Passage::Before
                } else if *final_lsn == c.commit_lsn && commit_time.unix_micros() == c.commit_time {
                    Passage::Met
                } else if *final_lsn == c.commit_lsn {
                    Passage::Rewound(format!(
                        "{} names the transaction committed at {final_lsn} at {}, but the one committed there now committed at {}",
                        self.source,
                        micros_text(c.commit_time),
                        micros_text(commit_time.unix_micros())
                    ))
                } else {
                    Passage::Rewound(format!(
                        "{} names a transaction committed at {}, but this server's WAL holds none there: the next one commits at {final_lsn}",
                        self.source, c.commit_lsn
                    ))
                }
            }
            // A keepalive reports how far decoding has read: past the
            // waypoint's commit record with no Begin for it, the
            // transaction is not in this WAL.
            StreamEvent::Keepalive { wal_end, .. } if *wal_end >= c.end_lsn => Passage::Rewound(format!(
                "{} names a transaction committed at {}, but the server decoded its WAL up to {wal_end} without sending it",
                self.source, c.commit_lsn
            )),
            _ => Passage::Before,
        }
    }
}

fn micros_text(unix_micros: i64) -> String {
    chrono::DateTime::from_timestamp_micros(unix_micros)
        .map(|t| t.to_rfc3339_opts(chrono::SecondsFormat::Micros, true))
        .unwrap_or_else(|| unix_micros.to_string())
}

/// The slot register's waypoint for an at-least-once session: the last
/// transaction the record says was confirmed, on the same timeline.
pub(super) fn register_waypoint(record: Option<&SlotRecord>, timeline: u32) -> Option<Waypoint> {
    let r = record.filter(|r| r.timeline == timeline)?;
    Some(Waypoint::new(r.last_commit()?, "the slot register"))
}

/// Why the slot register says this server went back in time, if it does:
/// it recorded a confirmed position past the end of the server's WAL, on
/// the same timeline.
pub(crate) fn register_beyond_wal(
    record: Option<&SlotRecord>,
    timeline: u32,
    wal_end: Lsn,
) -> Option<String> {
    let r = record.filter(|r| r.timeline == timeline)?;
    let confirmed = r.confirmed()?;
    (confirmed > wal_end).then(|| {
        format!(
            "the slot register says outboxd confirmed slot {} up to {confirmed} on timeline {}, but this server's WAL ends at {wal_end}",
            r.slot, r.timeline
        )
    })
}

/// How the publication was shown unchanged since the slot's position.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum PublicationProof {
    /// Every catalog row deciding delivery predates the slot's catalog_xmin.
    OlderThanSlot,
    /// The slot register holds the same fingerprint.
    SameAsRegistered,
    /// It may have changed, or the slot was streamed for another subject.
    Unproven(Unproven),
}

/// Why the publication cannot be shown unchanged.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Unproven {
    /// The register holds another fingerprint: the slot was last streamed
    /// with another publication or table (a second configuration on the
    /// same slot, or `postgres.table` changed), or they changed since.
    OtherFingerprint,
    /// The catalog rows are newer than the slot's catalog_xmin, and the
    /// register holds no fingerprint this version can compare.
    NoFingerprint,
    /// Messages are read, and who may write them changed since the
    /// session that recorded the register (a GRANT or REVOKE on
    /// pg_logical_emit_message), or the prefix did.
    MessagesChanged,
}

impl Unproven {
    /// The clause of the error that says why.
    pub(crate) fn because(self) -> &'static str {
        match self {
            Unproven::OtherFingerprint => "the slot register says the slot was last streamed with another publication or outbox table, or before the publication or the table changed (its fingerprint differs): a second configuration on this slot, a changed postgres.table, or a publication changed while no session streamed",
            Unproven::NoFingerprint => "the catalog rows that decide delivery were written after the slot's catalog_xmin, and the slot register holds no fingerprint this outboxd can compare (a record written by an older version)",
            Unproven::MessagesChanged => "the rights to write logical decoding messages (a GRANT or REVOKE on pg_logical_emit_message), or postgres.message_prefix, changed since the last session that read them: messages in that WAL may not be the table-less outbox's",
        }
    }
}

/// Whether the publication, as `verified` now, held for all WAL the slot
/// still streams, for this configuration (see the module doc). A
/// fingerprint in the register is compared first: when it differs, the
/// slot was streamed with another subject, however old the catalog rows.
pub(crate) fn publication_proof(
    verified: &Verified,
    catalog_xmin: Option<u32>,
    record: Option<&SlotRecord>,
) -> PublicationProof {
    if let (Some(before), Some(now)) = (
        record.and_then(|r| r.messages.as_deref()),
        verified.messages_fingerprint.as_deref(),
    ) {
        if publication::comparable(before) && before != now {
            return PublicationProof::Unproven(Unproven::MessagesChanged);
        }
    }
    let registered = record
        .and_then(|r| r.publication.as_deref())
        .filter(|f| publication::comparable(f));
    // A fingerprint without the schema dependency (an older version's)
    // holds only if the table was not moved out of its schema and back
    // since the slot's catalog_xmin.
    let dependency_older = verified
        .namespace_xmin
        .is_none_or(|x| catalog_xmin.is_some_and(|horizon| publication::xid_precedes(x, horizon)));
    match registered {
        Some(f) if f == verified.fingerprint => PublicationProof::SameAsRegistered,
        Some(f)
            if (f == verified.unsuffixed_fingerprint || f == verified.legacy_fingerprint)
                && dependency_older =>
        {
            PublicationProof::SameAsRegistered
        }
        Some(_) => PublicationProof::Unproven(Unproven::OtherFingerprint),
        None if publication::unchanged_since_slot(verified, catalog_xmin) => PublicationProof::OlderThanSlot,
        None => PublicationProof::Unproven(Unproven::NoFingerprint),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::postgres::pgoutput::PgTimestamp;

    fn commit(commit_lsn: u64, commit_time: i64) -> LastCommit {
        LastCommit {
            commit_lsn: Lsn(commit_lsn),
            end_lsn: Lsn(commit_lsn + 0x30),
            commit_time,
        }
    }

    fn begin(final_lsn: u64, unix_micros: i64) -> StreamEvent {
        // PostgreSQL's epoch is 2000-01-01: 946684800 s after the Unix one.
        StreamEvent::Begin {
            xid: 1,
            final_lsn: Lsn(final_lsn),
            commit_time: PgTimestamp(unix_micros - 946_684_800_000_000),
        }
    }

    #[test]
    fn a_resumed_slot_must_meet_the_waypoint_as_it_was() {
        let w = Waypoint::new(commit(0x1000, 1_800_000_000_000_000), "the progress record");
        assert!(w.ahead_of_slot(Lsn(0x1000)) && w.ahead_of_slot(Lsn(0x800)));
        assert!(!w.ahead_of_slot(Lsn(0x1030)), "resumes past it: nothing to meet");
        assert_eq!(w.beyond_wal(Lsn(0x1030)), None);
        assert!(w
            .beyond_wal(Lsn(0x102F))
            .is_some_and(|e| e.contains("WAL ends at 0/102F")));

        assert_eq!(w.pass(&begin(0x0F00, 1)), Passage::Before);
        assert_eq!(w.pass(&begin(0x1000, 1_800_000_000_000_000)), Passage::Met);
        // The same position, another transaction: restored and rewritten.
        assert!(
            matches!(w.pass(&begin(0x1000, 1_800_000_000_000_001)), Passage::Rewound(e) if e.contains("committed at"))
        );
        // Past it without meeting it.
        assert!(
            matches!(w.pass(&begin(0x1001, 1_800_000_000_000_000)), Passage::Rewound(e) if e.contains("holds none there"))
        );
        let keepalive = |wal_end| StreamEvent::Keepalive {
            wal_end: Lsn(wal_end),
            reply_requested: false,
        };
        assert_eq!(w.pass(&keepalive(0x102F)), Passage::Before);
        assert!(matches!(w.pass(&keepalive(0x1030)), Passage::Rewound(_)));
    }

    #[test]
    fn the_register_says_when_the_server_went_back() {
        let r = SlotRecord::new("s", "db", "73", 1, Lsn(0x5000)).with_last_commit(Some(commit(0x4000, 7)));
        assert!(register_beyond_wal(Some(&r), 1, Lsn(0x4FFF)).is_some());
        assert_eq!(register_beyond_wal(Some(&r), 1, Lsn(0x5000)), None);
        assert_eq!(
            register_beyond_wal(Some(&r), 2, Lsn(0x10)),
            None,
            "another timeline"
        );
        assert_eq!(
            register_waypoint(Some(&r), 1).map(|w| w.commit),
            Some(commit(0x4000, 7))
        );
        assert_eq!(register_waypoint(Some(&r), 2), None);
        assert_eq!(register_waypoint(None, 1), None);
    }

    #[test]
    fn the_publication_is_proven_by_the_register_first_then_by_age() {
        let v = Verified {
            table_oid: 7,
            fingerprint: "3:fp".into(),
            unsuffixed_fingerprint: "3:fp".into(),
            legacy_fingerprint: "2:fp".into(),
            namespace_xmin: None,
            xmins: vec![741],
            message_prefix: None,
            messages_fingerprint: None,
        };
        assert_eq!(
            publication_proof(&v, Some(800), None),
            PublicationProof::OlderThanSlot
        );
        let same = SlotRecord::new("s", "db", "73", 1, Lsn(1)).with_publication(Some("2:fp".into()));
        assert_eq!(
            publication_proof(&v, Some(700), Some(&same)),
            PublicationProof::SameAsRegistered
        );
        // Another subject streamed the slot: refused even though every
        // catalog row is older than the slot's catalog_xmin.
        let other = same.clone().with_publication(Some("2:other".into()));
        for horizon in [Some(700), Some(800)] {
            assert_eq!(
                publication_proof(&v, horizon, Some(&other)),
                PublicationProof::Unproven(Unproven::OtherFingerprint)
            );
        }
        // A fingerprint of an older layout proves nothing either way.
        let old = same.clone().with_publication(Some("Reading { .. }".into()));
        assert_eq!(
            publication_proof(&v, Some(800), Some(&old)),
            PublicationProof::OlderThanSlot
        );
        assert_eq!(
            publication_proof(&v, Some(700), Some(&old)),
            PublicationProof::Unproven(Unproven::NoFingerprint)
        );
        assert_eq!(
            publication_proof(&v, None, None),
            PublicationProof::Unproven(Unproven::NoFingerprint)
        );
    }

    #[test]
    fn a_table_published_through_its_schema_is_proven_with_its_schema_dependency() {
        let v = Verified {
            table_oid: 7,
            fingerprint: "3:fp;nsdep=760".into(),
            unsuffixed_fingerprint: "3:fp".into(),
            legacy_fingerprint: "2:fp".into(),
            namespace_xmin: Some(760),
            xmins: vec![741, 760],
            message_prefix: None,
            messages_fingerprint: None,
        };
        let record = |f: &str| SlotRecord::new("s", "db", "73", 1, Lsn(1)).with_publication(Some(f.into()));
        // Recorded with the dependency: equal, or moved since.
        assert_eq!(
            publication_proof(&v, Some(700), Some(&record("3:fp;nsdep=760"))),
            PublicationProof::SameAsRegistered
        );
        assert_eq!(
            publication_proof(&v, Some(900), Some(&record("3:fp;nsdep=750"))),
            PublicationProof::Unproven(Unproven::OtherFingerprint)
        );
        // Recorded by an older version, without it: proven only if the
        // dependency precedes the slot's catalog_xmin (not moved since).
        for old in ["3:fp", "2:fp"] {
            assert_eq!(
                publication_proof(&v, Some(800), Some(&record(old))),
                PublicationProof::SameAsRegistered
            );
            assert_eq!(
                publication_proof(&v, Some(755), Some(&record(old))),
                PublicationProof::Unproven(Unproven::OtherFingerprint)
            );
            assert_eq!(
                publication_proof(&v, None, Some(&record(old))),
                PublicationProof::Unproven(Unproven::OtherFingerprint)
            );
        }
        // Without a register record, its age counts with the others.
        assert_eq!(
            publication_proof(&v, Some(755), None),
            PublicationProof::Unproven(Unproven::NoFingerprint)
        );
        assert_eq!(
            publication_proof(&v, Some(800), None),
            PublicationProof::OlderThanSlot
        );
    }

    #[test]
    fn a_change_of_who_may_write_messages_is_unproven() {
        let reading = |m: Option<&str>| Verified {
            table_oid: 7,
            fingerprint: "3:fp".into(),
            unsuffixed_fingerprint: "3:fp".into(),
            legacy_fingerprint: "2:fp".into(),
            namespace_xmin: None,
            xmins: vec![741],
            message_prefix: m.map(|_| "outbox".into()),
            messages_fingerprint: m.map(str::to_owned),
        };
        let record = |m: Option<&str>| {
            SlotRecord::new("s", "db", "73", 1, Lsn(1))
                .with_publication(Some("2:fp".into()))
                .with_messages(m.map(str::to_owned))
        };
        let same = publication_proof(
            &reading(Some("2:\"outbox\" 900")),
            Some(800),
            Some(&record(Some("2:\"outbox\" 900"))),
        );
        assert_eq!(same, PublicationProof::SameAsRegistered);
        let granted = publication_proof(
            &reading(Some("2:\"outbox\" 950")),
            Some(800),
            Some(&record(Some("2:\"outbox\" 900"))),
        );
        assert_eq!(granted, PublicationProof::Unproven(Unproven::MessagesChanged));
        // Messages read for the first time on this slot: nothing to compare.
        let first = publication_proof(&reading(Some("2:\"outbox\" 950")), Some(800), Some(&record(None)));
        assert_eq!(first, PublicationProof::SameAsRegistered);
    }
}
