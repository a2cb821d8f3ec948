//! An event store on PostgreSQL (seed 004), with its events published
//! through the outbox.
//!
//! An aggregate's history is keyed by [`AggregateKey`]: its type *and* its
//! id, so `Account 42` and `Customer 42` are two histories.
//!
//! [`EventStore::append`] writes an aggregate's new events to `events`
//! (the caller's headers kept as each event's `metadata`) and one outbox
//! row per event, whose headers add the event's `version` and
//! `occurredAt`, in the caller's transaction. Optimistic
//! concurrency: the append succeeds only if the aggregate is still at
//! `expected_version`. A writer that loaded a stale version gets
//! [`EventStoreError::ConcurrencyConflict`]. The check is an `INSERT … WHERE
//! max(version) = expected`, and `UNIQUE (aggregate_type, aggregate_id,
//! version)` settles the race between two writers that both saw the same
//! version.
//!
//! ## Time travel
//!
//! `occurred_at` is the moment of the insert (`clock_timestamp()`), which
//! is before the commit. The events that had occurred by a moment `at` are
//! therefore not always a prefix of the versions: a writer whose transaction
//! started earlier can still append the next version after a quicker one
//! committed, and rows written before migration 0004 carry the start of
//! their transaction. So reads by time never filter rows by time. They take
//! [`EventStore::version_at`]: the versions *before the first one that
//! occurred after `at`*. An event that occurred after `at` had not
//! committed at `at`, and neither had any later version (each commits after
//! the one before it), so that prefix is always a state the aggregate
//! really passed through, and never includes an event recorded after `at`.

use chrono::{DateTime, Utc};
use serde_json::Value;
use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::{GenericClient, Row, Transaction};
use uuid::Uuid;

use crate::error::SdkError;
use crate::outbox::{append, Headers, OutboxEvent};

/// Header carrying an event's aggregate version on its outbox row.
pub const VERSION_HEADER: &str = "version";
/// Header carrying the moment the event was stored (`occurred_at`, RFC 3339
/// in microseconds, UTC) on its outbox row. The envelope's `occurredAt` is
/// the outbox row's `created_at`, the start of the writing transaction.
pub const OCCURRED_AT_HEADER: &str = "occurredAt";

/// Which history: an aggregate's type and id together.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct AggregateKey<'a> {
    pub aggregate_type: &'a str,
    pub aggregate_id: &'a str,
}

impl<'a> AggregateKey<'a> {
    pub fn new(aggregate_type: &'a str, aggregate_id: &'a str) -> Self {
        AggregateKey {
            aggregate_type,
            aggregate_id,
        }
    }
}

impl std::fmt::Display for AggregateKey<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}", self.aggregate_type, self.aggregate_id)
    }
}

/// An event to append.
#[derive(Clone, Debug, PartialEq)]
pub struct NewEvent {
    pub event_type: String,
    pub payload: Value,
}

/// An event as stored.
#[derive(Clone, Debug, PartialEq)]
pub struct RecordedEvent {
    /// Also the id of its outbox row and Kafka record.
    pub event_id: Uuid,
    pub aggregate_type: String,
    pub aggregate_id: String,
    pub version: i64,
    pub event_type: String,
    pub payload: Value,
    pub occurred_at: DateTime<Utc>,
    /// The headers the event was appended with (correlation id, trace
    /// context, …), as a JSON object.
    pub metadata: Value,
}

impl RecordedEvent {
    fn from_row(row: &Row) -> Self {
        RecordedEvent {
            event_id: row.get("event_id"),
            aggregate_type: row.get("aggregate_type"),
            aggregate_id: row.get("aggregate_id"),
            version: row.get("version"),
            event_type: row.get("type"),
            payload: row.get("payload"),
            occurred_at: row.get("occurred_at"),
            metadata: row.get("metadata"),
        }
    }
}

/// Appending or reading failed.
#[derive(Debug, thiserror::Error)]
pub enum EventStoreError {
    #[error("concurrency conflict on {aggregate_type} {aggregate_id}: it is no longer at version {expected_version}; reload it and retry the command")]
    ConcurrencyConflict {
        aggregate_type: String,
        aggregate_id: String,
        expected_version: i64,
    },
    #[error(transparent)]
    Sdk(#[from] SdkError),
}

impl From<tokio_postgres::Error> for EventStoreError {
    fn from(e: tokio_postgres::Error) -> Self {
        EventStoreError::Sdk(SdkError::Db(e))
    }
}

const COLUMNS: &str = "event_id, aggregate_type, aggregate_id, version, type, payload, occurred_at, metadata";

/// The last version of the consistent prefix at moment `$3` of the history
/// `($1, $2)`, or 0 (see the module doc). `>` makes an event that occurred
/// exactly at `$3` part of the prefix.
///
/// `OFFSET 0` keeps the planner from answering `min(version)` by walking
/// the version index from version 1 until an event after `$3` turns up:
/// that walk costs the moment's position in the history (18 ms at version
/// 9,000 of 10,000). Instead it reads the events after `$3` from the time
/// index, which carries the version (migration 0006): an index-only scan
/// whose cost is the number of events after the moment.
const VERSION_AT: &str = "coalesce(
    (SELECT min(version) - 1 FROM (
        SELECT version FROM events WHERE aggregate_type = $1 AND aggregate_id = $2 AND occurred_at > $3 OFFSET 0
    ) AS later),
    (SELECT max(version) FROM events WHERE aggregate_type = $1 AND aggregate_id = $2),
    0)";

/// The event store; `snapshot_every` is how many versions apart snapshots are.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EventStore {
    snapshot_every: i64,
}

impl Default for EventStore {
    fn default() -> Self {
        EventStore { snapshot_every: 100 }
    }
}

impl EventStore {
    /// Snapshots every `n` versions (at least 1).
    pub fn with_snapshot_every(n: i64) -> Self {
        EventStore {
            snapshot_every: n.max(1),
        }
    }

    pub fn snapshot_every(&self) -> i64 {
        self.snapshot_every
    }

    /// Whether moving from version `from` to `to` crosses a snapshot point.
    pub fn crosses_snapshot(&self, from: i64, to: i64) -> bool {
        to / self.snapshot_every > from / self.snapshot_every
    }

    /// Appends events at `expected_version + 1 …` and their outbox rows.
    pub async fn append(
        &self,
        tx: &Transaction<'_>,
        key: AggregateKey<'_>,
        expected_version: i64,
        events: &[NewEvent],
        headers: &Headers,
    ) -> Result<Vec<RecordedEvent>, EventStoreError> {
        if events.is_empty() {
            return Ok(Vec::new());
        }
        let ids: Vec<Uuid> = events.iter().map(|_| Uuid::now_v7()).collect();
        let versions: Vec<i64> = (1..=events.len() as i64).map(|i| expected_version + i).collect();
        let types: Vec<&str> = events.iter().map(|e| e.event_type.as_str()).collect();
        let payloads: Vec<&Value> = events.iter().map(|e| &e.payload).collect();
        // occurred_at is set here, not left to the column default, so that
        // tables created before migration 0004 get the insert time too.
        let sql = format!(
            "INSERT INTO events (event_id, aggregate_type, aggregate_id, version, type, payload, occurred_at, metadata)
             SELECT e.event_id, $2, $3, e.version, e.type, e.payload, clock_timestamp(), $8
               FROM unnest($4, $5, $6, $7) AS e(event_id, version, type, payload)
              WHERE (SELECT coalesce(max(version), 0) FROM events
                      WHERE aggregate_type = $2 AND aggregate_id = $3) = $1
             RETURNING {COLUMNS}"
        );
        let metadata = headers.to_json();
        let params: [(&(dyn ToSql + Sync), Type); 8] = [
            (&expected_version, Type::INT8),
            (&key.aggregate_type, Type::TEXT),
            (&key.aggregate_id, Type::TEXT),
            (&ids, Type::UUID_ARRAY),
            (&versions, Type::INT8_ARRAY),
            (&types, Type::TEXT_ARRAY),
            (&payloads, Type::JSONB_ARRAY),
            (&metadata, Type::JSONB),
        ];
        let conflict = || EventStoreError::ConcurrencyConflict {
            aggregate_type: key.aggregate_type.to_owned(),
            aggregate_id: key.aggregate_id.to_owned(),
            expected_version,
        };
        let rows = match tx.query_typed(&sql, &params).await {
            Ok(rows) => rows,
            Err(e) if e.code() == Some(&tokio_postgres::error::SqlState::UNIQUE_VIOLATION) => {
                return Err(conflict())
            }
            Err(e) => return Err(e.into()),
        };
        if rows.len() != events.len() {
            return Err(conflict());
        }
        let mut recorded: Vec<RecordedEvent> = rows.iter().map(RecordedEvent::from_row).collect();
        recorded.sort_by_key(|e| e.version);
        let outbox: Vec<OutboxEvent> = recorded
            .iter()
            .map(|e| {
                let mut h = headers.clone();
                h.insert(VERSION_HEADER, e.version.to_string());
                h.insert(
                    OCCURRED_AT_HEADER,
                    e.occurred_at.to_rfc3339_opts(chrono::SecondsFormat::Micros, true),
                );
                OutboxEvent {
                    id: Some(e.event_id),
                    aggregate_type: key.aggregate_type.to_owned(),
                    aggregate_id: key.aggregate_id.to_owned(),
                    event_type: e.event_type.clone(),
                    payload: e.payload.clone(),
                    headers: h,
                }
            })
            .collect();
        append(tx, &outbox).await?;
        Ok(recorded)
    }

    /// The aggregate's events after `after_version`, in order.
    pub async fn read<C: GenericClient>(
        &self,
        client: &C,
        key: AggregateKey<'_>,
        after_version: i64,
    ) -> Result<Vec<RecordedEvent>, EventStoreError> {
        self.read_range(client, key, after_version, i64::MAX).await
    }

    /// The aggregate's events with `after_version < version <= up_to`, in order.
    pub async fn read_range<C: GenericClient>(
        &self,
        client: &C,
        key: AggregateKey<'_>,
        after_version: i64,
        up_to: i64,
    ) -> Result<Vec<RecordedEvent>, EventStoreError> {
        let sql = format!(
            "SELECT {COLUMNS} FROM events
              WHERE aggregate_type = $1 AND aggregate_id = $2 AND version > $3 AND version <= $4
              ORDER BY version"
        );
        let rows = client
            .query(
                &sql,
                &[&key.aggregate_type, &key.aggregate_id, &after_version, &up_to],
            )
            .await?;
        Ok(rows.iter().map(RecordedEvent::from_row).collect())
    }

    /// The aggregate's version at moment `at` (0: it did not exist yet): the
    /// last version before the first event that occurred after `at`. See
    /// the module doc for why this, and not a filter on `occurred_at`.
    pub async fn version_at<C: GenericClient>(
        &self,
        client: &C,
        key: AggregateKey<'_>,
        at: DateTime<Utc>,
    ) -> Result<i64, EventStoreError> {
        let row = client
            .query_one(
                &format!("SELECT {VERSION_AT}"),
                &[&key.aggregate_type, &key.aggregate_id, &at],
            )
            .await?;
        Ok(row.get(0))
    }

    /// The aggregate's events up to its version at `at`, in order: always
    /// a prefix of its history.
    pub async fn read_at<C: GenericClient>(
        &self,
        client: &C,
        key: AggregateKey<'_>,
        at: DateTime<Utc>,
    ) -> Result<Vec<RecordedEvent>, EventStoreError> {
        let up_to = self.version_at(client, key, at).await?;
        self.read_range(client, key, 0, up_to).await
    }

    /// The events that took the aggregate from its state just before `from`
    /// to its state at `to`, in order (both ends inclusive): a contiguous
    /// run of versions.
    pub async fn events_between<C: GenericClient>(
        &self,
        client: &C,
        key: AggregateKey<'_>,
        from: DateTime<Utc>,
        to: DateTime<Utc>,
    ) -> Result<Vec<RecordedEvent>, EventStoreError> {
        // Just before `from`: the versions before the first one that
        // occurred at or after it.
        let before: i64 = client
            .query_one(
                "SELECT coalesce(
                    (SELECT min(version) - 1 FROM events
                      WHERE aggregate_type = $1 AND aggregate_id = $2 AND occurred_at >= $3),
                    (SELECT max(version) FROM events WHERE aggregate_type = $1 AND aggregate_id = $2),
                    0)",
                &[&key.aggregate_type, &key.aggregate_id, &from],
            )
            .await?
            .get(0);
        let up_to = self.version_at(client, key, to).await?;
        self.read_range(client, key, before, up_to).await
    }

    /// The latest snapshot at or below version `up_to`: its version and state.
    pub async fn latest_snapshot<C: GenericClient>(
        &self,
        client: &C,
        key: AggregateKey<'_>,
        up_to: i64,
    ) -> Result<Option<(i64, Value)>, EventStoreError> {
        let row = client
            .query_opt(
                "SELECT version, state FROM snapshots
                  WHERE aggregate_type = $1 AND aggregate_id = $2 AND version <= $3
                  ORDER BY version DESC LIMIT 1",
                &[&key.aggregate_type, &key.aggregate_id, &up_to],
            )
            .await?;
        Ok(row.map(|r| (r.get(0), r.get(1))))
    }

    /// Stores a snapshot of the state at `version`.
    pub async fn save_snapshot(
        &self,
        tx: &Transaction<'_>,
        key: AggregateKey<'_>,
        version: i64,
        state: &Value,
    ) -> Result<(), EventStoreError> {
        tx.execute(
            "INSERT INTO snapshots (aggregate_type, aggregate_id, version, state) VALUES ($1, $2, $3, $4)
             ON CONFLICT (aggregate_type, aggregate_id, version) DO NOTHING",
            &[&key.aggregate_type, &key.aggregate_id, &version, state],
        )
        .await?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn snapshot_points() {
        let s = EventStore::default();
        assert!(s.crosses_snapshot(99, 100));
        assert!(s.crosses_snapshot(98, 102));
        assert!(!s.crosses_snapshot(100, 199));
        assert!(s.crosses_snapshot(199, 200));
        assert_eq!(EventStore::with_snapshot_every(0).snapshot_every(), 1);
    }
}
