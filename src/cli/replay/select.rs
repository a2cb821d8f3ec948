//! Which rows a replay publishes, in which order, read how.
//!
//! # Order
//!
//! The relay publishes in commit order. A replay reconstructs it as far as
//! the table can tell: each row's **order time** is the commit time of the
//! transaction that inserted it (`pg_xact_commit_timestamp(xmin)`) when
//! `track_commit_timestamp` is on and PostgreSQL still has it, else its
//! `created_at`. Rows are replayed by order time, then `created_at`, then
//! `id` (the SDK's ids are UUIDv7, so within one transaction that is the
//! order of the writes). In polling mode rows are updated once published,
//! so `xmin` is no longer the inserting transaction's and `created_at`
//! alone is used.
//!
//! # Time ranges
//!
//! `since` and `until` compare with the commit time where it is known.
//! Where it is not, `created_at` (usually the inserting transaction's
//! start) stands in, and `since` is widened by `slack`: a transaction that
//! committed after `since` may have begun before it. Widening only adds
//! rows consumers already have, and they deduplicate by id.
//!
//! # Reading
//!
//! One statement lists the ids of the selection in order (16 bytes a row in
//! memory, one scan of the table). The rows are then read by primary key,
//! a batch at a time, so no statement holds a snapshot for the length of a
//! throttled replay. A row deleted in between (retention) is counted as
//! gone, not published.

use std::collections::HashMap;
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use tokio_postgres::types::ToSql;
use tokio_postgres::Client;
use uuid::Uuid;

use crate::config::ident::TableName;
use crate::postgres::admin::AdminError;
use crate::source::outbox::{OutboxRow, TABLE_COLUMNS, TABLE_COLUMN_COUNT};

/// The rows to replay. Serialized into the state file, so that `--resume`
/// continues exactly this selection.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Selection {
    pub since: Option<DateTime<Utc>>,
    pub until: Option<DateTime<Utc>>,
    /// How far before `since` to select by `created_at` where the commit
    /// time is unknown.
    #[serde(with = "secs")]
    pub slack: Duration,
    pub aggregate_types: Vec<String>,
    pub aggregate_ids: Vec<String>,
    pub ids: Vec<Uuid>,
}

/// `Duration` as whole seconds in the state file.
mod secs {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u64(d.as_secs())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        u64::deserialize(d).map(Duration::from_secs)
    }
}

impl Selection {
    /// Whether it selects anything narrower than the whole table.
    pub fn is_narrowed(&self) -> bool {
        self.since.is_some()
            || self.until.is_some()
            || !self.aggregate_types.is_empty()
            || !self.aggregate_ids.is_empty()
            || !self.ids.is_empty()
    }
}

/// Where a replay stands: the order key of the last row Kafka
/// acknowledged, as PostgreSQL's text (order time, `created_at`, id).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Key {
    pub order_time: String,
    pub created_at: String,
    pub id: Uuid,
}

/// A row read for replay: the row, its order key and its commit time.
#[derive(Clone, Debug)]
pub struct ReplayRow {
    pub row: OutboxRow,
    pub key: Key,
    /// The commit time in milliseconds since the Unix epoch, when known.
    pub commit_ms: Option<i64>,
}

/// One line of a dry run: rows of an aggregate type and their order times.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Count {
    pub aggregate_type: String,
    pub rows: i64,
    pub first: String,
    pub last: String,
}

/// Builds and runs the statements of one selection on one table.
#[derive(Debug)]
pub struct Query {
    table: String,
    /// The order-time expression over the row alias `o`.
    order_time: &'static str,
    /// The commit-time expression (`NULL` when it cannot be known).
    commit_time: &'static str,
}

const COMMIT_TIME: &str = "pg_xact_commit_timestamp(o.xmin)";
const ORDER_TIME_BY_COMMIT: &str = "coalesce(pg_xact_commit_timestamp(o.xmin), o.created_at)";

impl Query {
    /// Sets the session up (ISO dates in UTC, as outboxd reads them) and
    /// decides whether commit times can be used: `track_commit_timestamp`
    /// on, and rows never updated (`by_commit_time` is false in polling
    /// mode).
    pub async fn prepare(
        client: &Client,
        table: &TableName,
        by_commit_time: bool,
    ) -> Result<Self, AdminError> {
        client
            .batch_execute("SET DateStyle = 'ISO'; SET TimeZone = 'UTC'")
            .await?;
        let tracked: String = client.query_one("SHOW track_commit_timestamp", &[]).await?.get(0);
        let commit = by_commit_time && tracked == "on";
        Ok(Query {
            table: table.quoted().to_string(),
            order_time: if commit {
                ORDER_TIME_BY_COMMIT
            } else {
                "o.created_at"
            },
            commit_time: if commit { COMMIT_TIME } else { "NULL::timestamptz" },
        })
    }

    /// Whether rows are ordered by commit time (else by `created_at`).
    pub fn by_commit_time(&self) -> bool {
        self.commit_time == COMMIT_TIME
    }

    /// The `WHERE` clause and its parameters for `sel`, after `after`.
    fn filter(&self, sel: &Selection, after: Option<&Key>) -> (String, Vec<Box<dyn ToSql + Sync + Send>>) {
        let mut clauses: Vec<String> = Vec::new();
        let mut params: Vec<Box<dyn ToSql + Sync + Send>> = Vec::new();
        let mut param = |v: Box<dyn ToSql + Sync + Send>| {
            params.push(v);
            format!("${}", params.len())
        };
        let ct = self.commit_time;
        if let Some(since) = sel.since {
            let p = param(Box::new(since));
            let slack = param(Box::new(sel.slack.as_secs_f64()));
            clauses.push(format!(
                "coalesce({ct} >= {p}, o.created_at >= {p} - make_interval(secs => {slack}))"
            ));
        }
        if let Some(until) = sel.until {
            let p = param(Box::new(until));
            clauses.push(format!("coalesce({ct} < {p}, o.created_at < {p})"));
        }
        if !sel.aggregate_types.is_empty() {
            let p = param(Box::new(sel.aggregate_types.clone()));
            clauses.push(format!("o.aggregate_type = ANY({p})"));
        }
        if !sel.aggregate_ids.is_empty() {
            let p = param(Box::new(sel.aggregate_ids.clone()));
            clauses.push(format!("o.aggregate_id = ANY({p})"));
        }
        if !sel.ids.is_empty() {
            let p = param(Box::new(sel.ids.clone()));
            clauses.push(format!("o.id = ANY({p})"));
        }
        if let Some(k) = after {
            let t = param(Box::new(k.order_time.clone()));
            let c = param(Box::new(k.created_at.clone()));
            let i = param(Box::new(k.id));
            clauses.push(format!(
                "({}, o.created_at, o.id) > ({t}::text::timestamptz, {c}::text::timestamptz, {i})",
                self.order_time
            ));
        }
        let filter = if clauses.is_empty() {
            "true".to_owned()
        } else {
            clauses.join(" AND ")
        };
        (filter, params)
    }

    /// The ids of the selection after `after`, in replay order.
    pub async fn ids(
        &self,
        client: &Client,
        sel: &Selection,
        after: Option<&Key>,
    ) -> Result<Vec<Uuid>, AdminError> {
        let (filter, params) = self.filter(sel, after);
        let sql = format!(
            "SELECT o.id FROM {} o WHERE {filter} ORDER BY {}, o.created_at, o.id",
            self.table, self.order_time
        );
        let refs: Vec<&(dyn ToSql + Sync)> =
            params.iter().map(|p| p.as_ref() as &(dyn ToSql + Sync)).collect();
        let rows = client.query(&sql, &refs).await?;
        Ok(rows.iter().map(|r| r.get(0)).collect())
    }

    /// Rows per aggregate type with their first and last order time.
    pub async fn counts(
        &self,
        client: &Client,
        sel: &Selection,
        after: Option<&Key>,
    ) -> Result<Vec<Count>, AdminError> {
        let (filter, params) = self.filter(sel, after);
        let sql = format!(
            "SELECT o.aggregate_type, count(*), min({t})::text, max({t})::text
               FROM {} o WHERE {filter} GROUP BY 1 ORDER BY 1",
            self.table,
            t = self.order_time
        );
        let refs: Vec<&(dyn ToSql + Sync)> =
            params.iter().map(|p| p.as_ref() as &(dyn ToSql + Sync)).collect();
        let rows = client.query(&sql, &refs).await?;
        Ok(rows
            .iter()
            .map(|r| Count {
                aggregate_type: r.get(0),
                rows: r.get(1),
                first: r.get(2),
                last: r.get(3),
            })
            .collect())
    }

    /// The rows with these ids that still exist, by id.
    pub async fn rows(&self, client: &Client, ids: &[Uuid]) -> Result<HashMap<Uuid, ReplayRow>, AdminError> {
        let sql = format!(
            "SELECT {TABLE_COLUMNS}, ({t})::text,
                    (extract(epoch FROM {ct}) * 1000)::float8
               FROM {} o WHERE o.id = ANY($1)",
            self.table,
            t = self.order_time,
            ct = self.commit_time
        );
        let rows = client.query(&sql, &[&ids]).await?;
        rows.iter()
            .map(|r| {
                let row = OutboxRow::from_table(r).map_err(|e| AdminError::Row(e.to_string()))?;
                let replay = ReplayRow {
                    key: Key {
                        order_time: r.get(TABLE_COLUMN_COUNT),
                        created_at: r.get(6),
                        id: row.id,
                    },
                    row,
                    commit_ms: r
                        .get::<_, Option<f64>>(TABLE_COLUMN_COUNT + 1)
                        .map(|ms| ms as i64),
                };
                Ok((replay.row.id, replay))
            })
            .collect()
    }
}
