//! The slot register: Kafka remembers which slots outboxd streamed, so
//! that a slot which disappears stops outboxd instead of being recreated.
//!
//! # Why
//!
//! A logical slot is outboxd's only position in at-least-once mode. If it
//! disappears (a promotion before the standby had a synced copy, a slot
//! dropped by hand or by a cleanup job), creating a new one starts at the
//! *current* WAL position, and every event committed in between is
//! skipped, silently. A restarted process cannot tell that apart from a
//! first start unless the position is remembered outside the database.
//!
//! # The flow
//!
//! 1. At every session start, before the slot is created, outboxd reads the
//!    record keyed `slot/<system id>/<slot>` from the progress topic (the
//!    same compacted topic as the exactly-once progress record; the system
//!    identifier is shared by a primary and its physical standbys, so the
//!    record follows a promotion).
//! 2. If the slot is missing and a record exists, the slot was lost: the
//!    session stops with [`SlotLost`], which names the last position seen
//!    and the recovery steps. `outboxd progress --reset` forgets the record
//!    once the gap is handled.
//! 3. Once the slot exists (found or created), the session writes the
//!    record at its first status tick, with the confirmed LSN, and again
//!    whenever the confirmed LSN moved and the last write is older than
//!    [`REFRESH`], in a task of its own so that streaming never waits for
//!    it. Writes are plain (not transactional) and wait for Kafka's
//!    acknowledgement; a failed one is logged, counted and tried again.
//!    Reads use `read_uncommitted`, so an open exactly-once transaction in
//!    the same topic never holds them up.
//!
//! The record's LSN is a lower bound of what consumers have: the recovery
//! re-publishes from its time, which can only duplicate, never skip.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::config::KafkaConfig;
use crate::lsn::Lsn;
use crate::relay::exactly_once::{read_latest, write_plain, Isolation, ProgressError};
use crate::relay::progress::LastCommit;

/// The record's format version.
pub const REGISTER_VERSION: u32 = 1;

/// How often the poller refreshes the record while the slot moves.
pub const REFRESH: Duration = Duration::from_secs(60);

/// The value of a slot register record.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SlotRecord {
    pub version: u32,
    pub slot: String,
    pub database: String,
    /// `IDENTIFY_SYSTEM`'s `systemid`: the same on a primary and its
    /// physical standbys.
    pub system_id: String,
    /// The server's timeline when the record was written.
    pub timeline: u32,
    /// The slot's `confirmed_flush_lsn` when the record was written.
    pub confirmed_lsn: String,
    /// When the record was written (RFC 3339, outboxd's clock). Events of
    /// transactions committed up to `confirmedLsn` are in Kafka; a
    /// transaction committed later started at most its own duration
    /// before this time, which bounds the rows to re-publish.
    pub seen_at: String,
    /// Which outboxd wrote it: `host/pid`.
    pub writer: String,
    /// The commit time (RFC 3339, PostgreSQL's clock) of the last
    /// transaction at or before `confirmedLsn`, when the session saw one:
    /// every transaction committed after `confirmedLsn` committed after
    /// it, so `outboxd replay --since` it closes a gap exactly. Absent in
    /// records of older versions and before a session confirmed anything.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub confirmed_commit_time: Option<String>,
    /// That transaction's commit record: where it starts and ends. With
    /// the commit time it identifies the transaction in the WAL, so that a
    /// session resuming behind it can tell a WAL history that was rewound
    /// (a restored disk snapshot) from the one outboxd streamed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub confirmed_commit_lsn: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub confirmed_commit_end: Option<String>,
    /// The fingerprint of the publication as the session that wrote the
    /// record proved it (`publication::Verified::fingerprint`): a session
    /// that finds the same one knows the publication did not change while
    /// no session streamed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub publication: Option<String>,
    /// When the session read logical decoding messages (the table-less
    /// outbox): their part of the proof (`Verified::messages_fingerprint`).
    /// A later session on the slot goes on reading them, and refuses to
    /// when who may write them changed in between.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub messages: Option<String>,
}

impl SlotRecord {
    pub fn new(slot: &str, database: &str, system_id: &str, timeline: u32, confirmed: Lsn) -> Self {
        SlotRecord {
            version: REGISTER_VERSION,
            slot: slot.to_owned(),
            database: database.to_owned(),
            system_id: system_id.to_owned(),
            timeline,
            confirmed_lsn: confirmed.to_string(),
            seen_at: chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Millis, true),
            writer: crate::relay::exactly_once::writer_name(),
            confirmed_commit_time: None,
            confirmed_commit_lsn: None,
            confirmed_commit_end: None,
            publication: None,
            messages: None,
        }
    }

    /// With the commit time (microseconds since the Unix epoch) of the
    /// last transaction at or before the confirmed LSN.
    pub fn with_commit_time(mut self, unix_micros: Option<i64>) -> Self {
        self.confirmed_commit_time = unix_micros
            .and_then(chrono::DateTime::from_timestamp_micros)
            .map(|t| t.to_rfc3339_opts(chrono::SecondsFormat::Micros, true));
        self
    }

    /// With the last transaction at or before the confirmed LSN: its
    /// commit time and commit record.
    pub fn with_last_commit(self, last: Option<LastCommit>) -> Self {
        let Some(c) = last else {
            return self;
        };
        let mut r = self.with_commit_time(Some(c.commit_time));
        r.confirmed_commit_lsn = Some(c.commit_lsn.to_string());
        r.confirmed_commit_end = Some(c.end_lsn.to_string());
        r
    }

    /// With the publication's fingerprint.
    pub fn with_publication(mut self, fingerprint: Option<String>) -> Self {
        self.publication = fingerprint;
        self
    }

    /// With the messages part of the proof (`None`: no messages read).
    pub fn with_messages(mut self, fingerprint: Option<String>) -> Self {
        self.messages = fingerprint;
        self
    }

    /// The last transaction at or before the confirmed LSN, when the
    /// record names it whole.
    pub fn last_commit(&self) -> Option<LastCommit> {
        let commit_time = chrono::DateTime::parse_from_rfc3339(self.confirmed_commit_time.as_deref()?)
            .ok()?
            .timestamp_micros();
        Some(LastCommit {
            commit_lsn: self.confirmed_commit_lsn.as_deref()?.parse().ok()?,
            end_lsn: self.confirmed_commit_end.as_deref()?.parse().ok()?,
            commit_time,
        })
    }

    /// The confirmed LSN it records.
    pub fn confirmed(&self) -> Option<Lsn> {
        self.confirmed_lsn.parse().ok()
    }
}

/// Commit timestamps and LSN order may disagree by the time two commits
/// take to reach the WAL; the gap command starts this much earlier.
const COMMIT_ORDER_MARGIN: chrono::Duration = chrono::Duration::seconds(1);

/// The `outboxd replay` command that re-publishes what a lost slot did not
/// deliver: every row committed after the record's confirmed LSN.
pub fn replay_command(config_args: &str, record: Option<&SlotRecord>) -> String {
    let since = record
        .and_then(|r| r.confirmed_commit_time.as_deref())
        .and_then(|t| chrono::DateTime::parse_from_rfc3339(t).ok())
        .map(|t| (t.to_utc() - COMMIT_ORDER_MARGIN).to_rfc3339_opts(chrono::SecondsFormat::Micros, true));
    match since {
        Some(since) => format!("outboxd replay {config_args} --since {since}"),
        None => format!(
            "outboxd replay {config_args} --since <commit time of the last event your consumers have>"
        ),
    }
}

/// What every slot register key starts with (exactly-once progress
/// records are keyed by the bare slot name, which cannot hold a `/`).
pub const KEY_PREFIX: &str = "slot/";

/// The record's key in the progress topic.
pub fn key(system_id: &str, slot: &str) -> String {
    format!("{KEY_PREFIX}{system_id}/{slot}")
}

/// The slot's record, if outboxd streamed it on this system before.
pub async fn read(
    cfg: &KafkaConfig,
    system_id: &str,
    slot: &str,
    timeout: Duration,
) -> Result<Option<SlotRecord>, ProgressError> {
    // Register records are written outside transactions: an open
    // exactly-once transaction (of a fenced zombie, say) must not hold the
    // read up.
    let isolation = Isolation::ReadUncommitted;
    let Some(value) = read_latest(
        cfg,
        cfg.progress_topic(),
        &key(system_id, slot),
        isolation,
        timeout,
    )
    .await?
    else {
        return Ok(None);
    };
    let record: SlotRecord =
        serde_json::from_slice(&value).map_err(|e| ProgressError::Malformed(e.to_string()))?;
    if record.version != REGISTER_VERSION {
        return Err(ProgressError::Malformed(format!(
            "slot register version {} (this outboxd writes {REGISTER_VERSION})",
            record.version
        )));
    }
    Ok(Some(record))
}

/// Writes the record and waits for Kafka's acknowledgement.
pub async fn write(cfg: &KafkaConfig, record: &SlotRecord, timeout: Duration) -> Result<(), ProgressError> {
    let value = serde_json::to_vec(record).map_err(|e| ProgressError::Malformed(e.to_string()))?;
    write_plain(
        cfg,
        cfg.progress_topic(),
        &key(&record.system_id, &record.slot),
        Some(value),
        timeout,
    )
    .await
}

/// Forgets the slot (a tombstone): the next start may create it anew.
pub async fn forget(
    cfg: &KafkaConfig,
    system_id: &str,
    slot: &str,
    timeout: Duration,
) -> Result<(), ProgressError> {
    write_plain(cfg, cfg.progress_topic(), &key(system_id, slot), None, timeout).await
}

/// The slot is missing, but outboxd streamed it on this system before.
#[derive(Debug, thiserror::Error)]
#[error(
    "replication slot {slot} does not exist, but outboxd streamed it on this PostgreSQL system (timeline {then_timeline}, now {now_timeline}) up to at least {confirmed} at {seen_at} (slot register in {topic}). \
     The slot was lost ({cause}); a new slot would start at the current WAL position and skip every event committed in between, so outboxd does not create one. \
     Recovery: 1. run `outboxd progress --reset --create-slot --config <file>` to acknowledge the gap and create the slot now; \
     2. re-publish the outbox rows of transactions committed after LSN {confirmed}: run `{replay}` (consumers deduplicate by id); \
     3. start outboxd: each aggregate's replayed events are then in Kafka before its newer ones. \
     Or bring back the server that held the slot. See docs/recovery.md"
)]
pub struct SlotLost {
    pub slot: String,
    /// The `outboxd replay` command that closes the gap.
    pub replay: String,
    pub confirmed: String,
    pub seen_at: String,
    pub then_timeline: u32,
    pub now_timeline: u32,
    pub topic: String,
    pub cause: &'static str,
}

impl SlotLost {
    pub fn new(record: &SlotRecord, now_timeline: u32, topic: &str, config_args: &str) -> Self {
        SlotLost {
            slot: record.slot.clone(),
            replay: replay_command(config_args, Some(record)),
            confirmed: record.confirmed_lsn.clone(),
            seen_at: record.seen_at.clone(),
            then_timeline: record.timeline,
            now_timeline,
            topic: topic.to_owned(),
            cause: if now_timeline > record.timeline {
                "the server was promoted since, and its copy of the slot was not synced: see `outboxd check`, line failover"
            } else {
                "it was dropped"
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn record_round_trips_and_lost_names_the_recovery() {
        let r = SlotRecord::new("s1", "app", "7300000000000000001", 1, Lsn(0x16B_3748));
        let back: SlotRecord = serde_json::from_slice(&serde_json::to_vec(&r).unwrap()).unwrap();
        assert_eq!(back, r);
        assert!(serde_json::to_string(&r)
            .unwrap()
            .contains("\"confirmedLsn\":\"0/16B3748\""));
        assert_eq!(key("73", "s1"), "slot/73/s1");

        let promoted = SlotLost::new(&r, 2, "outboxd.progress", "--config <config file>").to_string();
        assert!(
            promoted.contains("promoted") && promoted.contains("progress --reset"),
            "{promoted}"
        );
        assert!(
            promoted.contains(&r.seen_at) && promoted.contains("0/16B3748"),
            "{promoted}"
        );
        let dropped = SlotLost::new(&r, 1, "outboxd.progress", "--config <config file>").to_string();
        assert!(dropped.contains("dropped"), "{dropped}");
        assert!(
            dropped.contains("outboxd replay --config <config file> --since <commit time"),
            "{dropped}"
        );
        // 2026-12-01T10:00:00.5Z in microseconds: the command starts a
        // second earlier.
        let timed = r.clone().with_commit_time(Some(1_796_119_200_500_000));
        assert_eq!(
            timed.confirmed_commit_time.as_deref(),
            Some("2026-12-01T10:00:00.500000Z")
        );
        let back: SlotRecord = serde_json::from_slice(&serde_json::to_vec(&timed).unwrap()).unwrap();
        assert_eq!(back, timed);
        assert_eq!(timed.last_commit(), None, "the commit record is not known");
        let last = LastCommit {
            commit_lsn: Lsn(0x16B_3700),
            end_lsn: Lsn(0x16B_3748),
            commit_time: 1_796_119_200_500_001,
        };
        let whole = r
            .clone()
            .with_last_commit(Some(last))
            .with_publication(Some("fp".into()));
        let back: SlotRecord = serde_json::from_slice(&serde_json::to_vec(&whole).unwrap()).unwrap();
        assert_eq!(back.last_commit(), Some(last));
        assert_eq!(back.publication.as_deref(), Some("fp"));
        // Records of older outboxd versions read as before.
        let old = r#"{"version":1,"slot":"s1","database":"app","systemId":"73","timeline":1,"confirmedLsn":"0/1","seenAt":"x","writer":"h/1"}"#;
        let back: SlotRecord = serde_json::from_str(old).unwrap();
        assert_eq!((back.last_commit(), back.publication), (None, None));
        let lost = SlotLost::new(&timed, 1, "outboxd.progress", "--config '/etc/my outboxd.toml'");
        assert!(
            lost.to_string().contains(
                "run `outboxd replay --config '/etc/my outboxd.toml' --since 2026-12-01T09:59:59.500000Z`"
            ),
            "{lost}"
        );
    }
}
