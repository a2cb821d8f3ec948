//! The parked-event tables (migration `0009_outboxd_parked.sql`) and the
//! statements the relay and `outboxd parked` run on them, on an ordinary
//! SQL connection (never the replication one).

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use tokio_postgres::Client;

use crate::config::conninfo::PgConnectConfig;
use crate::config::ident::TableName;
use crate::lsn::Lsn;
use crate::lsn::RowPos;
use crate::postgres::admin::{self, AdminError};
use crate::source::outbox::{CreatedAt, Extra, OutboxRow, Payload};

/// The key of a sequence's advisory lock, of `$1` (the slot), `$2` (the
/// topic) and `$3` (the key).
macro_rules! sequence_lock {
    () => {
        "hashtextextended('outboxd_parked/' || $1 || '/' || $2 || '/' || $3, 0)"
    };
}

/// Why the parked-event tables could not be used.
#[derive(Debug, thiserror::Error)]
pub enum ParkError {
    #[error(transparent)]
    Admin(#[from] AdminError),
    #[error("PostgreSQL refused a parked-event statement: {}", outbox_sdk::error::describe(.0))]
    Query(#[from] tokio_postgres::Error),
    #[error("routing.on_poison = \"park\" needs the tables {schema}.outboxd_parked and {schema}.outboxd_parked_sequences: run `outboxd migrate` or apply migrations/0009_outboxd_parked.sql in schema {schema}")]
    NoTables { schema: String },
    #[error("outboxd may not {privilege} {schema}.{table}: grant SELECT, INSERT, UPDATE and DELETE on outboxd_parked and outboxd_parked_sequences (see deploy/least-privilege.sql)")]
    NoPrivilege {
        privilege: &'static str,
        schema: String,
        table: &'static str,
    },
    #[error("the slot is no longer streamed by this relay's walsender (another outboxd took it over): nothing parked")]
    Fenced,
    #[error("a parked row cannot be read back: {0}")]
    Unreadable(String),
    #[error("the parked sequence of topic {topic:?} key {key:?} would now go to topic {now:?} (routing.topic or routing.lowercase_aggregate_type changed while it was parked): its later events would overtake it. Redrive it first with the new configuration while outboxd is stopped (`outboxd parked redrive --key {key}` publishes to {now:?}), or restore the old setting")]
    Renamed { topic: String, key: String, now: String },
}

impl ParkError {
    /// Whether trying again may succeed (a lost connection, a server
    /// restart), as opposed to a missing table or privilege.
    pub fn is_transient(&self) -> bool {
        match self {
            ParkError::Admin(AdminError::Connect { .. } | AdminError::Query(_)) | ParkError::Fenced => true,
            ParkError::Query(e) => e.as_db_error().is_none_or(|db| {
                let code = db.code().code();
                // Connection failures, serialization failures, deadlocks,
                // operator intervention, insufficient resources, a lock not
                // granted within lock_timeout.
                ["08", "40", "57", "53"]
                    .iter()
                    .any(|class| code.starts_with(class))
                    || code == "55P03"
            }),
            _ => false,
        }
    }
}

/// What a parked event holds of its outbox row.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ParkedRow {
    /// The row as outboxd read it: a redrive builds its record anew.
    Row(OutboxRow),
    /// A row that could not be read as an event: its id's text, its
    /// aggregate id's text, and every column as JSON text.
    Unreadable {
        id: String,
        aggregate_id: String,
        columns_json: String,
    },
}

/// One parked event.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParkedEvent {
    pub pos: RowPos,
    pub topic: String,
    pub key: String,
    pub row: ParkedRow,
    pub reason: String,
    pub error: String,
    /// How often publishing it failed (1 when it was parked).
    pub attempts: i32,
}

impl ParkedEvent {
    /// The event's id as text.
    pub fn id(&self) -> String {
        match &self.row {
            ParkedRow::Row(r) => r.id.clone(),
            ParkedRow::Unreadable { id, .. } => id.clone(),
        }
    }

    /// What it takes in the table, roughly: its payload, headers and
    /// columns (the bound `routing.park.max_bytes` counts).
    pub fn bytes(&self) -> usize {
        let body = match &self.row {
            ParkedRow::Row(r) => r.payload.as_bytes().len() + r.headers.len() + r.event_type.len(),
            ParkedRow::Unreadable { columns_json, .. } => columns_json.len(),
        };
        body + self.topic.len() + self.key.len() + self.error.len()
    }
}

/// A parked sequence: its head, and what is parked behind it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SequenceHead {
    pub topic: String,
    pub key: String,
    pub head: RowPos,
    pub head_id: String,
    pub head_reason: String,
    pub parked_at: DateTime<Utc>,
    /// Parked events of the sequence, the head included, and their bytes.
    pub events: i64,
    pub bytes: i64,
    /// A redrive caught up with what the slot had durably passed and
    /// handed the rest to the relay, which publishes it ahead of the
    /// sequence's later events (see [`crate::relay`]'s parking).
    pub handback: bool,
}

/// `created_at` as text PostgreSQL and [`CreatedAt::parse`] read back
/// (`None`: absent).
fn created_at_text(c: &CreatedAt) -> Option<String> {
    match c {
        CreatedAt::At(t) => Some(t.format("%Y-%m-%d %H:%M:%S%.6f+00").to_string()),
        CreatedAt::Unrepresentable(s) => Some(s.clone()),
        CreatedAt::Absent => None,
    }
}

/// What the `columns` column holds for a row that was read (its own
/// columns cannot say it): a payload that is text or NULL rather than
/// JSON or bytes, and the additional columns' values. NULL when neither
/// (every row parked before column maps existed reads back so).
#[derive(Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
struct RowShape {
    /// `"text"` or `"null"`; absent: JSON or bytes (`payload_bytea`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    payload: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    extra: Vec<ParkedExtra>,
}

/// An additional column's value as parked.
#[derive(Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(tag = "k", content = "v", rename_all = "lowercase")]
enum ParkedExtra {
    Missing,
    Null,
    Text(String),
    Number(String),
    Bool(bool),
    Json(String),
}

impl From<&Extra> for ParkedExtra {
    fn from(e: &Extra) -> Self {
        match e {
            Extra::Missing => ParkedExtra::Missing,
            Extra::Null => ParkedExtra::Null,
            Extra::Text(s) => ParkedExtra::Text(s.clone()),
            Extra::Number(s) => ParkedExtra::Number(s.clone()),
            Extra::Bool(b) => ParkedExtra::Bool(*b),
            Extra::Json(s) => ParkedExtra::Json(s.clone()),
        }
    }
}

impl From<ParkedExtra> for Extra {
    fn from(e: ParkedExtra) -> Self {
        match e {
            ParkedExtra::Missing => Extra::Missing,
            ParkedExtra::Null => Extra::Null,
            ParkedExtra::Text(s) => Extra::Text(s),
            ParkedExtra::Number(s) => Extra::Number(s),
            ParkedExtra::Bool(b) => Extra::Bool(b),
            ParkedExtra::Json(s) => Extra::Json(s),
        }
    }
}

impl RowShape {
    fn of(r: &OutboxRow) -> Option<String> {
        let shape = RowShape {
            payload: match r.payload {
                Payload::Text(_) => Some("text".into()),
                Payload::Null => Some("null".into()),
                Payload::Json(_) | Payload::Bytes(_) => None,
            },
            extra: r.extra.iter().map(ParkedExtra::from).collect(),
        };
        (shape != RowShape::default()).then(|| serde_json::to_string(&shape).unwrap_or_default())
    }
}

/// The parked-event tables of one slot.
pub struct ParkStore {
    client: Client,
    /// The quoted schema, with a trailing dot.
    schema: String,
    slot: String,
    /// The relay's walsender: parking needs it to hold the slot still (a
    /// leader frozen while another took the slot over parks nothing).
    fenced_by: Option<i32>,
    /// The quoted name of the sequences table, for the catalog.
    sequences: String,
}

impl std::fmt::Debug for ParkStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ParkStore").field("slot", &self.slot).finish()
    }
}

/// The columns [`ParkStore::row_from`] reads, in order.
const EVENT_COLUMNS: &str =
    "commit_lsn::text, position, topic, key, event_id, aggregate_type, aggregate_id, \
     type, payload, payload_bytea, headers, created_at, columns, reason, error, attempts";

impl ParkStore {
    /// Connects, and checks that the tables exist and may be written.
    pub async fn connect(pg: &PgConnectConfig, table: &TableName, slot: &str) -> Result<Self, ParkError> {
        let client = admin::connect(pg).await?;
        Self::on(client, table, slot).await
    }

    /// Uses `client`, after the same checks as [`ParkStore::connect`].
    pub async fn on(client: Client, table: &TableName, slot: &str) -> Result<Self, ParkError> {
        let schema_name = table.schema.clone();
        let found = client
            .query_one(
                "SELECT to_regclass(quote_ident($1) || '.outboxd_parked') IS NOT NULL \
                    AND to_regclass(quote_ident($1) || '.outboxd_parked_sequences') IS NOT NULL",
                &[&schema_name],
            )
            .await?;
        if !found.get::<_, bool>(0) {
            return Err(ParkError::NoTables { schema: schema_name });
        }
        for t in ["outboxd_parked", "outboxd_parked_sequences"] {
            for privilege in ["SELECT", "INSERT", "UPDATE", "DELETE"] {
                let ok: bool = client
                    .query_one(
                        "SELECT has_table_privilege(quote_ident($1) || '.' || $2, $3)",
                        &[&schema_name, &t, &privilege],
                    )
                    .await?
                    .get(0);
                if !ok {
                    return Err(ParkError::NoPrivilege {
                        privilege: match privilege {
                            "SELECT" => "read",
                            "INSERT" => "insert into",
                            "UPDATE" => "update",
                            _ => "delete from",
                        },
                        schema: schema_name.clone(),
                        table: if t == "outboxd_parked" {
                            "outboxd_parked"
                        } else {
                            "outboxd_parked_sequences"
                        },
                    });
                }
            }
        }
        // A lock held by a stalled `outboxd parked` must not hold up the
        // relay for good: waiting is an error, and the session tries again.
        client.batch_execute("SET lock_timeout = '10s'").await?;
        let schema = format!("\"{}\".", schema_name.replace('"', "\"\""));
        let sequences = format!("{schema}outboxd_parked_sequences");
        Ok(ParkStore {
            client,
            schema,
            slot: slot.to_owned(),
            fenced_by: None,
            sequences,
        })
    }

    /// The number of `slot`'s parked sequences, for a relay that does not
    /// park (`routing.on_poison` changed away from `"park"`), which must
    /// still hold their later events back. `None` without the tables. Tables
    /// outboxd may not read count as empty only while they have never held
    /// a row (`pg_relation_size`, which needs no privilege and, unlike the
    /// statistics, survives a crash and a reset), else they are an error
    /// naming the grant.
    pub async fn waiting(client: &Client, table: &TableName, slot: &str) -> Result<Option<i64>, ParkError> {
        let row = client
            .query_one(
                "SELECT t IS NOT NULL, coalesce(has_table_privilege(t, 'SELECT'), false), coalesce(pg_relation_size(t), 0) \
                   FROM (SELECT to_regclass(quote_ident($1) || '.outboxd_parked_sequences') AS t) r",
                &[&table.schema],
            )
            .await?;
        let (exists, readable, bytes): (bool, bool, i64) = (row.get(0), row.get(1), row.get(2));
        if !exists {
            return Ok(None);
        }
        if !readable {
            if bytes > 0 {
                return Err(ParkError::NoPrivilege {
                    privilege: "read",
                    schema: table.schema.clone(),
                    table: "outboxd_parked_sequences",
                });
            }
            return Ok(None);
        }
        let schema = format!("\"{}\".", table.schema.replace('"', "\"\""));
        let sequences: i64 = client
            .query_one(
                &format!("SELECT count(*) FROM {schema}outboxd_parked_sequences WHERE slot = $1"),
                &[&slot],
            )
            .await?
            .get(0);
        Ok(Some(sequences))
    }

    /// Parks only while the walsender `pid` streams the slot.
    pub fn fence(&mut self, pid: i32) {
        self.fenced_by = Some(pid);
    }

    /// Names this connection as the relay's of its slot
    /// (`application_name`), so that a relay that takes the slot over can
    /// tell its predecessor's sequence locks ([`ParkStore::break_stale_lock`]).
    pub async fn name_relay(&self) -> Result<(), ParkError> {
        self.client
            .execute(
                "SELECT set_config('application_name', $1, false)",
                &[&relay_name(&self.slot)],
            )
            .await?;
        Ok(())
    }

    /// A sequence's lock held by another relay of this slot (a leader that
    /// froze or vanished mid-handback, whose connection lives on): while
    /// this relay's walsender streams the slot, that relay is a zombie, and
    /// its connection is ended. Whether one was.
    pub async fn break_stale_lock(&self, topic: &str, key: &str) -> Result<bool, ParkError> {
        let Some(pid) = self.fenced_by else {
            return Ok(false);
        };
        let row = self
            .client
            .query_one(
                concat!(
                    "SELECT count(pg_terminate_backend(l.pid)) \
                   FROM pg_catalog.pg_locks l JOIN pg_catalog.pg_stat_activity a ON a.pid = l.pid \
                  WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1 \
                    AND ((l.classid::bigint << 32) | l.objid::bigint) = ",
                    sequence_lock!(),
                    " AND a.application_name = $4 AND l.pid <> pg_backend_pid() \
                    AND EXISTS (SELECT 1 FROM pg_catalog.pg_replication_slots \
                                 WHERE slot_name = $1 AND active_pid = $5)"
                ),
                &[&self.slot, &topic, &key, &relay_name(&self.slot), &pid],
            )
            .await?;
        Ok(row.get::<_, i64>(0) > 0)
    }

    /// The slot whose events these are.
    pub fn slot(&self) -> &str {
        &self.slot
    }

    /// Whether the connection is gone (the next statement would fail).
    pub fn is_closed(&self) -> bool {
        self.client.is_closed()
    }

    /// Whether migration 0010 is applied (read each time: it may be
    /// applied while outboxd runs). Without it, a redrive waits for a busy
    /// sequence's writes to pause, as before.
    async fn hands_back(&self) -> Result<bool, ParkError> {
        Ok(self
            .client
            .query_one(
                "SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_attribute \
                  WHERE attrelid = $1::text::regclass AND attname = 'handback' AND NOT attisdropped)",
                &[&self.sequences],
            )
            .await?
            .get(0))
    }

    /// Takes the lock of a sequence's publisher (a redrive, or the relay
    /// handing it back), without waiting: whether it was free. Held by this
    /// connection until [`ParkStore::unlock_sequences`] or its end.
    pub async fn lock_sequence(&self, topic: &str, key: &str) -> Result<bool, ParkError> {
        Ok(self
            .client
            .query_one(
                concat!("SELECT pg_try_advisory_lock(", sequence_lock!(), ")"),
                &[&self.slot, &topic, &key],
            )
            .await?
            .get(0))
    }

    /// Lets go of every sequence lock this connection holds.
    pub async fn unlock_sequences(&self) -> Result<(), ParkError> {
        self.client
            .batch_execute("SELECT pg_advisory_unlock_all()")
            .await?;
        Ok(())
    }

    /// Hands a sequence back to the relay: it publishes the events left
    /// ahead of the sequence's later ones. Whether the header was there
    /// (and migration 0010 applied).
    pub async fn hand_back(&self, topic: &str, key: &str) -> Result<bool, ParkError> {
        if !self.hands_back().await? {
            return Ok(false);
        }
        let sql = format!(
            "UPDATE {}outboxd_parked_sequences SET handback = true WHERE (slot, topic, key) = ($1, $2, $3)",
            self.schema
        );
        Ok(self.client.execute(&sql, &[&self.slot, &topic, &key]).await? == 1)
    }

    /// Every parked sequence of the slot, oldest first, with its counts.
    pub async fn heads(&self) -> Result<Vec<SequenceHead>, ParkError> {
        self.read_heads(None).await
    }

    /// One sequence's header, as [`ParkStore::heads`] reads it.
    pub async fn head(&self, topic: &str, key: &str) -> Result<Option<SequenceHead>, ParkError> {
        Ok(self.read_heads(Some((topic, key))).await?.pop())
    }

    /// The headers of the slot's sequences, or of one.
    async fn read_heads(&self, one: Option<(&str, &str)>) -> Result<Vec<SequenceHead>, ParkError> {
        let (topic, key) = one.unzip();
        let handback = if self.hands_back().await? {
            "s.handback"
        } else {
            "false"
        };
        let sql = format!(
            "SELECT s.topic, s.key, s.head_lsn::text, s.head_index, s.head_id, s.head_reason, s.parked_at, \
                    count(p.position), coalesce(sum(p.bytes), 0)::bigint, {handback} \
               FROM {0}outboxd_parked_sequences s \
               LEFT JOIN {0}outboxd_parked p ON (p.slot, p.topic, p.key) = (s.slot, s.topic, s.key) \
              WHERE s.slot = $1 AND ($2::text IS NULL OR (s.topic, s.key) = ($2, $3)) \
              GROUP BY s.slot, s.topic, s.key \
              ORDER BY s.parked_at, s.topic, s.key",
            self.schema
        );
        let rows = self.client.query(&sql, &[&self.slot, &topic, &key]).await?;
        rows.iter()
            .map(|r| {
                Ok(SequenceHead {
                    topic: r.get(0),
                    key: r.get(1),
                    head: RowPos {
                        commit_lsn: lsn(r.get(2))?,
                        index: index(r.get(3))?,
                    },
                    head_id: r.get(4),
                    head_reason: r.get(5),
                    parked_at: r.get(6),
                    events: r.get(7),
                    bytes: r.get(8),
                    handback: r.get(9),
                })
            })
            .collect()
    }

    /// Parks the first event of a sequence: opens its header (unless a
    /// replay finds it open) and writes the event. Returns the sequence's
    /// head, and whether the event was new to the table.
    pub async fn open(&mut self, ev: &ParkedEvent) -> Result<(RowPos, bool), ParkError> {
        let tx = self.client.transaction().await?;
        let sql = format!(
            "INSERT INTO {}outboxd_parked_sequences (slot, topic, key, head_lsn, head_index, head_id, head_reason) \
             VALUES ($1, $2, $3, $4::text::pg_lsn, $5, $6, $7) ON CONFLICT DO NOTHING",
            self.schema
        );
        let index = i32::try_from(ev.pos.index).unwrap_or(i32::MAX);
        let at = ev.pos.commit_lsn.to_string();
        tx.execute(
            &sql,
            &[&self.slot, &ev.topic, &ev.key, &at, &index, &ev.id(), &ev.reason],
        )
        .await?;
        let joined = join(&tx, &self.schema, &self.slot, self.fenced_by, ev).await?;
        tx.commit().await?;
        joined
            .ok_or_else(|| ParkError::Unreadable("the sequence's header vanished while it was opened".into()))
    }

    /// Parks an event of a parked sequence: `None` when the sequence was
    /// released (redriven or discarded) meanwhile, and the event is the
    /// relay's to publish; else the sequence's head and whether the event
    /// was new. An event before the head (a predecessor replayed after a
    /// crash, which fails today) becomes the head.
    pub async fn append(&mut self, ev: &ParkedEvent) -> Result<Option<(RowPos, bool)>, ParkError> {
        let tx = self.client.transaction().await?;
        let joined = join(&tx, &self.schema, &self.slot, self.fenced_by, ev).await?;
        if joined.is_some() {
            tx.commit().await?;
        }
        Ok(joined)
    }

    /// Whether the event at `pos` is parked already (a replay parks it
    /// again without adding anything).
    pub async fn contains(&self, pos: RowPos) -> Result<bool, ParkError> {
        let sql = format!(
            "SELECT 1 FROM {}outboxd_parked WHERE (slot, commit_lsn, position) = ($1, $2::text::pg_lsn, $3)",
            self.schema
        );
        let i = i32::try_from(pos.index).unwrap_or(i32::MAX);
        let at = pos.commit_lsn.to_string();
        Ok(self
            .client
            .query_opt(&sql, &[&self.slot, &at, &i])
            .await?
            .is_some())
    }

    /// The event at `pos`, if it is parked.
    pub async fn at(&self, pos: RowPos) -> Result<Option<ParkedEvent>, ParkError> {
        let sql = format!(
            "SELECT {EVENT_COLUMNS} FROM {}outboxd_parked WHERE (slot, commit_lsn, position) = ($1, $2::text::pg_lsn, $3)",
            self.schema
        );
        let i = i32::try_from(pos.index).unwrap_or(i32::MAX);
        let at = pos.commit_lsn.to_string();
        let row = self.client.query_opt(&sql, &[&self.slot, &at, &i]).await?;
        row.as_ref().map(row_from).transpose()
    }

    /// The commit LSN of a sequence's last parked event.
    pub async fn last_lsn(&self, topic: &str, key: &str) -> Result<Option<Lsn>, ParkError> {
        let sql = format!(
            "SELECT max(commit_lsn)::text FROM {}outboxd_parked WHERE (slot, topic, key) = ($1, $2, $3)",
            self.schema
        );
        let row = self.client.query_one(&sql, &[&self.slot, &topic, &key]).await?;
        row.get::<_, Option<String>>(0).map(lsn).transpose()
    }

    /// The first parked event of every sequence, for the check that the
    /// sequences are still named as the configuration names them.
    pub async fn first_events(&self) -> Result<Vec<ParkedEvent>, ParkError> {
        let sql = format!(
            "SELECT DISTINCT ON (topic, key) {EVENT_COLUMNS} FROM {}outboxd_parked WHERE slot = $1 \
              ORDER BY topic, key, commit_lsn, position",
            self.schema
        );
        let rows = self.client.query(&sql, &[&self.slot]).await?;
        rows.iter().map(row_from).collect()
    }

    /// Up to `limit` parked events of a sequence after `after`, in order.
    pub async fn events(
        &self,
        topic: &str,
        key: &str,
        after: Option<RowPos>,
        limit: i64,
    ) -> Result<Vec<ParkedEvent>, ParkError> {
        let (lsn_text, index) = match after {
            Some(p) => (p.commit_lsn.to_string(), i64::from(p.index)),
            None => ("0/0".to_owned(), -1),
        };
        let sql = format!(
            "SELECT {EVENT_COLUMNS} FROM {}outboxd_parked \
              WHERE (slot, topic, key) = ($1, $2, $3) AND (commit_lsn, position) > ($4::text::pg_lsn, $5::bigint) \
              ORDER BY commit_lsn, position LIMIT $6",
            self.schema
        );
        let rows = self
            .client
            .query(&sql, &[&self.slot, &topic, &key, &lsn_text, &index, &limit])
            .await?;
        rows.iter().map(row_from).collect()
    }

    /// One parked event by its id, with its sequence.
    /// Ids need not be unique (an unreadable row's may be empty): one that
    /// heads its sequence comes first.
    pub async fn by_id(&self, id: &str) -> Result<Option<ParkedEvent>, ParkError> {
        let sql = format!(
            "SELECT {EVENT_COLUMNS} FROM {0}outboxd_parked p WHERE slot = $1 AND event_id = $2 \
              ORDER BY EXISTS (SELECT 1 FROM {0}outboxd_parked q \
                                WHERE (q.slot, q.topic, q.key) = (p.slot, p.topic, p.key) \
                                  AND (q.commit_lsn, q.position) < (p.commit_lsn, p.position)), \
                       commit_lsn, position LIMIT 1",
            self.schema
        );
        let row = self.client.query_opt(&sql, &[&self.slot, &id]).await?;
        row.as_ref().map(row_from).transpose()
    }

    /// Deletes one parked event (after Kafka acknowledged it, or its dead
    /// letter).
    pub async fn delete(&self, ev: &ParkedEvent) -> Result<(), ParkError> {
        let sql = format!(
            "DELETE FROM {}outboxd_parked WHERE (slot, commit_lsn, position) = ($1, $2::text::pg_lsn, $3)",
            self.schema
        );
        let index = i32::try_from(ev.pos.index).unwrap_or(i32::MAX);
        self.client
            .execute(&sql, &[&self.slot, &ev.pos.commit_lsn.to_string(), &index])
            .await?;
        Ok(())
    }

    /// Names a sequence's first parked event as its head (after its head
    /// went to the dead-letter topic).
    pub async fn advance_head(&self, topic: &str, key: &str) -> Result<(), ParkError> {
        let sql = format!(
            "UPDATE {0}outboxd_parked_sequences s \
                SET head_lsn = p.commit_lsn, head_index = p.position, head_id = p.event_id, head_reason = p.reason \
               FROM (SELECT commit_lsn, position, event_id, reason FROM {0}outboxd_parked \
                      WHERE (slot, topic, key) = ($1, $2, $3) ORDER BY commit_lsn, position LIMIT 1) p \
              WHERE (s.slot, s.topic, s.key) = ($1, $2, $3)",
            self.schema
        );
        self.client.execute(&sql, &[&self.slot, &topic, &key]).await?;
        Ok(())
    }

    /// Deletes a sequence's events at or before `through` (redriven in a
    /// Kafka transaction that committed); returns how many.
    pub async fn delete_through(&self, topic: &str, key: &str, through: RowPos) -> Result<u64, ParkError> {
        let sql = format!(
            "DELETE FROM {}outboxd_parked WHERE (slot, topic, key) = ($1, $2, $3) \
                AND (commit_lsn, position) <= ($4::text::pg_lsn, $5::bigint)",
            self.schema
        );
        Ok(self
            .client
            .execute(
                &sql,
                &[
                    &self.slot,
                    &topic,
                    &key,
                    &through.commit_lsn.to_string(),
                    &i64::from(through.index),
                ],
            )
            .await?)
    }

    /// Records a failed attempt at an event, which becomes its sequence's
    /// head (with the reason of today).
    pub async fn failed(&mut self, ev: &ParkedEvent, reason: &str, error: &str) -> Result<(), ParkError> {
        // A head that fails ends a handback: the sequence waits for the
        // operator again.
        let handback = if self.hands_back().await? {
            ", handback = false"
        } else {
            ""
        };
        let tx = self.client.transaction().await?;
        let index = i32::try_from(ev.pos.index).unwrap_or(i32::MAX);
        let lsn_text = ev.pos.commit_lsn.to_string();
        let sql = format!(
            "UPDATE {}outboxd_parked SET attempts = attempts + 1, last_attempt = clock_timestamp(), \
                    reason = $4, error = $5 \
              WHERE (slot, commit_lsn, position) = ($1, $2::text::pg_lsn, $3)",
            self.schema
        );
        tx.execute(&sql, &[&self.slot, &lsn_text, &index, &reason, &error])
            .await?;
        let sql = format!(
            "UPDATE {}outboxd_parked_sequences SET head_lsn = $4::text::pg_lsn, head_index = $5, \
                    head_id = $6, head_reason = $7{handback} \
              WHERE (slot, topic, key) = ($1, $2, $3)",
            self.schema
        );
        tx.execute(
            &sql,
            &[
                &self.slot,
                &ev.topic,
                &ev.key,
                &lsn_text,
                &index,
                &ev.id(),
                &reason,
            ],
        )
        .await?;
        tx.commit().await?;
        Ok(())
    }

    /// Releases a sequence whose events are all gone: deletes its header
    /// under `FOR UPDATE`, unless the relay parked another event first.
    /// Returns whether it was released (or was already).
    pub async fn release(&mut self, topic: &str, key: &str) -> Result<bool, ParkError> {
        let tx = self.client.transaction().await?;
        let lock = format!(
            "SELECT 1 FROM {}outboxd_parked_sequences WHERE (slot, topic, key) = ($1, $2, $3) FOR UPDATE",
            self.schema
        );
        if tx.query_opt(&lock, &[&self.slot, &topic, &key]).await?.is_none() {
            return Ok(true);
        }
        let left = format!(
            "SELECT 1 FROM {}outboxd_parked WHERE (slot, topic, key) = ($1, $2, $3) LIMIT 1",
            self.schema
        );
        if tx.query_opt(&left, &[&self.slot, &topic, &key]).await?.is_some() {
            return Ok(false);
        }
        let delete = format!(
            "DELETE FROM {}outboxd_parked_sequences WHERE (slot, topic, key) = ($1, $2, $3)",
            self.schema
        );
        tx.execute(&delete, &[&self.slot, &topic, &key]).await?;
        tx.commit().await?;
        Ok(true)
    }

    /// Deletes a sequence's events committed at or before `through`, and
    /// its header if none is left (events parked meanwhile stay, and keep
    /// it). Returns the events deleted, and whether the header went.
    pub async fn discard_through(
        &mut self,
        topic: &str,
        key: &str,
        through: Lsn,
    ) -> Result<(u64, bool), ParkError> {
        let tx = self.client.transaction().await?;
        let lock = format!(
            "SELECT 1 FROM {}outboxd_parked_sequences WHERE (slot, topic, key) = ($1, $2, $3) FOR UPDATE",
            self.schema
        );
        if tx.query_opt(&lock, &[&self.slot, &topic, &key]).await?.is_none() {
            return Ok((0, true));
        }
        let events = format!(
            "DELETE FROM {}outboxd_parked WHERE (slot, topic, key) = ($1, $2, $3) AND commit_lsn <= $4::text::pg_lsn",
            self.schema
        );
        let n = tx
            .execute(&events, &[&self.slot, &topic, &key, &through.to_string()])
            .await?;
        let left = format!(
            "SELECT 1 FROM {}outboxd_parked WHERE (slot, topic, key) = ($1, $2, $3) LIMIT 1",
            self.schema
        );
        let released = tx.query_opt(&left, &[&self.slot, &topic, &key]).await?.is_none();
        if released {
            let header = format!(
                "DELETE FROM {}outboxd_parked_sequences WHERE (slot, topic, key) = ($1, $2, $3)",
                self.schema
            );
            tx.execute(&header, &[&self.slot, &topic, &key]).await?;
        }
        tx.commit().await?;
        Ok((n, released))
    }

    /// The walsender streaming the slot, if any.
    pub async fn active_pid(&self) -> Result<Option<i32>, ParkError> {
        let row = self
            .client
            .query_opt(
                "SELECT active_pid FROM pg_catalog.pg_replication_slots WHERE slot_name = $1",
                &[&self.slot],
            )
            .await?;
        Ok(row.and_then(|r| r.get::<_, Option<i32>>(0)))
    }

    /// How far the slot has durably passed (`None`: no such slot, or an
    /// invalidated one): its `restart_lsn`. A parked event whose
    /// transaction committed before it is never streamed again, not even
    /// after a crash of PostgreSQL: a moved `restart_lsn` is written to disk
    /// at once, with a `confirmed_flush_lsn` at least as far, while a moved
    /// `confirmed_flush_lsn` alone waits for the next checkpoint.
    pub async fn durably_passed(&self) -> Result<Option<Lsn>, ParkError> {
        let row = self
            .client
            .query_opt(
                "SELECT restart_lsn::text FROM pg_catalog.pg_replication_slots WHERE slot_name = $1",
                &[&self.slot],
            )
            .await?;
        match row.and_then(|r| r.get::<_, Option<String>>(0)) {
            Some(s) => Ok(Some(lsn(s)?)),
            None => Ok(None),
        }
    }
}

/// Inside a parking transaction: writes `ev` behind its sequence's header
/// (held `FOR SHARE`), moving the head back if `ev` comes before it.
/// `None` when there is no header.
async fn join(
    tx: &tokio_postgres::Transaction<'_>,
    schema: &str,
    slot: &str,
    fenced_by: Option<i32>,
    ev: &ParkedEvent,
) -> Result<Option<(RowPos, bool)>, ParkError> {
    let sql = format!(
        "SELECT head_lsn::text, head_index FROM {schema}outboxd_parked_sequences \
          WHERE (slot, topic, key) = ($1, $2, $3) FOR SHARE"
    );
    let Some(row) = tx.query_opt(&sql, &[&slot, &ev.topic, &ev.key]).await? else {
        return Ok(None);
    };
    let mut head = RowPos {
        commit_lsn: lsn(row.get(0))?,
        index: index(row.get(1))?,
    };
    if ev.pos < head {
        let sql = format!(
            "UPDATE {schema}outboxd_parked_sequences SET head_lsn = $4::text::pg_lsn, head_index = $5, \
                    head_id = $6, head_reason = $7 \
              WHERE (slot, topic, key) = ($1, $2, $3)"
        );
        let i = i32::try_from(ev.pos.index).unwrap_or(i32::MAX);
        let at = ev.pos.commit_lsn.to_string();
        tx.execute(&sql, &[&slot, &ev.topic, &ev.key, &at, &i, &ev.id(), &ev.reason])
            .await?;
        head = ev.pos;
    }
    check_fence(tx, slot, fenced_by).await?;
    let inserted = insert_event(tx, schema, slot, ev).await?;
    Ok(Some((head, inserted)))
}

/// Inside a parking transaction: the slot is still streamed by `pid`.
async fn check_fence(
    tx: &tokio_postgres::Transaction<'_>,
    slot: &str,
    pid: Option<i32>,
) -> Result<(), ParkError> {
    let Some(pid) = pid else { return Ok(()) };
    let held = tx
        .query_opt(
            "SELECT 1 FROM pg_catalog.pg_replication_slots WHERE slot_name = $1 AND active_pid = $2",
            &[&slot, &pid],
        )
        .await?;
    held.map(|_| ()).ok_or(ParkError::Fenced)
}

async fn insert_event(
    tx: &tokio_postgres::Transaction<'_>,
    schema: &str,
    slot: &str,
    ev: &ParkedEvent,
) -> Result<bool, ParkError> {
    let sql = format!(
        "INSERT INTO {schema}outboxd_parked (slot, commit_lsn, position, topic, key, event_id, aggregate_type, \
             aggregate_id, type, payload, payload_bytea, headers, created_at, columns, reason, error, bytes) \
         VALUES ($1, $2::text::pg_lsn, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17) \
         ON CONFLICT DO NOTHING"
    );
    let index = i32::try_from(ev.pos.index).unwrap_or(i32::MAX);
    let bytes = i64::try_from(ev.bytes()).unwrap_or(i64::MAX);
    let id = ev.id();
    let (aggregate_type, aggregate_id, event_type, payload, payload_bytea, headers, created_at, columns) =
        match &ev.row {
            ParkedRow::Row(r) => (
                Some(r.aggregate_type.as_str()),
                Some(r.aggregate_id.as_str()),
                Some(r.event_type.as_str()),
                (r.payload != Payload::Null).then(|| r.payload.as_bytes()),
                Some(matches!(r.payload, Payload::Bytes(_))),
                Some(r.headers.as_str()),
                created_at_text(&r.created_at),
                RowShape::of(r),
            ),
            ParkedRow::Unreadable {
                aggregate_id,
                columns_json,
                ..
            } => (
                None,
                Some(aggregate_id.as_str()),
                None,
                None,
                None,
                None,
                None,
                Some(columns_json.clone()),
            ),
        };
    let n = tx
        .execute(
            &sql,
            &[
                &slot,
                &ev.pos.commit_lsn.to_string(),
                &index,
                &ev.topic,
                &ev.key,
                &id,
                &aggregate_type,
                &aggregate_id,
                &event_type,
                &payload,
                &payload_bytea,
                &headers,
                &created_at,
                &columns,
                &ev.reason,
                &ev.error,
                &bytes,
            ],
        )
        .await?;
    Ok(n == 1)
}

/// The `application_name` of a relay's parked-event connection.
fn relay_name(slot: &str) -> String {
    format!("outboxd relay parking {slot}")
}

fn lsn(s: String) -> Result<Lsn, ParkError> {
    s.parse()
        .map_err(|_| ParkError::Unreadable(format!("{s:?} is no LSN")))
}

fn index(i: i32) -> Result<u32, ParkError> {
    u32::try_from(i).map_err(|_| ParkError::Unreadable(format!("{i} is no position")))
}

/// Reads a row of [`EVENT_COLUMNS`].
fn row_from(r: &tokio_postgres::Row) -> Result<ParkedEvent, ParkError> {
    let pos = RowPos {
        commit_lsn: lsn(r.get(0))?,
        index: index(r.get(1))?,
    };
    let id: String = r.get(4);
    let columns: Option<String> = r.get(12);
    let row = match (r.get::<_, Option<String>>(5), columns) {
        (Some(aggregate_type), shape) => {
            let shape: RowShape = match shape {
                Some(text) => serde_json::from_str(&text)
                    .map_err(|e| ParkError::Unreadable(format!("event {id}: its columns {text:?}: {e}")))?,
                None => RowShape::default(),
            };
            let bytes: Option<Vec<u8>> = r.get(8);
            let text = |b: Vec<u8>| {
                String::from_utf8(b)
                    .map_err(|_| ParkError::Unreadable(format!("event {id}: its payload is not UTF-8")))
            };
            let payload = match (shape.payload.as_deref(), bytes) {
                (Some("null"), _) | (_, None) => Payload::Null,
                (Some("text"), Some(b)) => Payload::Text(text(b)?),
                (_, Some(b)) if r.get::<_, Option<bool>>(9).unwrap_or(false) => Payload::Bytes(b),
                (_, Some(b)) => Payload::Json(text(b)?),
            };
            ParkedRow::Row(OutboxRow {
                id: id.clone(),
                aggregate_type,
                aggregate_id: r.get::<_, Option<String>>(6).unwrap_or_default(),
                event_type: r.get::<_, Option<String>>(7).unwrap_or_default(),
                payload,
                headers: r.get::<_, Option<String>>(10).unwrap_or_else(|| "{}".into()),
                created_at: r
                    .get::<_, Option<String>>(11)
                    .map_or(CreatedAt::Absent, |t| CreatedAt::parse(&t)),
                extra: shape.extra.into_iter().map(Extra::from).collect(),
                facts: None,
            })
        }
        (None, columns) => ParkedRow::Unreadable {
            id: id.clone(),
            aggregate_id: r.get::<_, Option<String>>(6).unwrap_or_default(),
            columns_json: columns.unwrap_or_else(|| "{}".into()),
        },
    };
    Ok(ParkedEvent {
        pos,
        topic: r.get(2),
        key: r.get(3),
        row,
        reason: r.get(13),
        error: r.get(14),
        attempts: r.get(15),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::TimeZone;

    #[test]
    fn created_at_text_reads_back() {
        for t in [
            Utc.with_ymd_and_hms(2026, 12, 3, 12, 0, 0).unwrap() + chrono::Duration::microseconds(123_456),
            Utc.with_ymd_and_hms(1, 1, 1, 0, 0, 0).unwrap(),
            Utc.with_ymd_and_hms(9999, 12, 31, 23, 59, 59).unwrap(),
        ] {
            let c = CreatedAt::At(t);
            assert_eq!(CreatedAt::parse(&created_at_text(&c).unwrap()), c, "{t}");
        }
        let c = CreatedAt::Unrepresentable("infinity".into());
        assert_eq!(CreatedAt::parse(&created_at_text(&c).unwrap()), c);
        assert_eq!(created_at_text(&CreatedAt::Absent), None);
    }
}
