//! Which rows a replay publishes, in which order, read how.
//!
//! The table is read through the column map ([`crate::source::outbox`]):
//! `created_at` below is the timestamp column (a `timestamp` read as UTC,
//! a `bigint` as epoch milliseconds), `aggregate_type` the route column,
//! `aggregate_id` the key column and `id` the id column, whatever they are
//! named.
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
//! alone is used. A table without a timestamp column, replayed without
//! commit times, is replayed in `id` order, which keeps each aggregate's
//! order only where ids grow with time (a sequence, UUIDv7); `--since`
//! and `--until` are refused there (nothing to compare them with).
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

use crate::config::columns::{ColumnMap, Role};
use crate::config::ident::TableName;
use crate::postgres::admin::AdminError;
use crate::source::outbox::{Kind, OutboxColumns, OutboxRow};
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use tokio_postgres::types::ToSql;
use tokio_postgres::Client;

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
    /// Event ids, as text (a uuid, text or an integer id column).
    pub ids: Vec<String>,
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
    pub id: String,
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
    order_time: String,
    /// The commit-time expression (`NULL` when it cannot be known).
    commit_time: &'static str,
    /// The timestamp column as a `timestamptz` (`-infinity` for a row
    /// without one, so that order keys never hold NULL).
    created_at: String,
    /// The id column, its type for casts, the route and key columns.
    id: String,
    id_type: String,
    route: Option<String>,
    key: String,
    /// The column map, resolved again for each batch of rows.
    map: ColumnMap,
    table_name: TableName,
    /// How rows are ordered, for the operator.
    order: Order,
}

/// How a replay orders rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Order {
    /// Commit time (`track_commit_timestamp`), then the timestamp column,
    /// then id.
    CommitTime,
    /// The timestamp column, then id.
    Timestamp,
    /// The id alone: no timestamp column, no commit times.
    Id,
}

impl Order {
    /// With commit times (or not), on a table with a timestamp column (or
    /// not).
    pub fn of(commit_times: bool, timestamp: bool) -> Order {
        match (commit_times, timestamp) {
            (true, _) => Order::CommitTime,
            (false, true) => Order::Timestamp,
            (false, false) => Order::Id,
        }
    }

    /// Whether `--since` and `--until` have something to compare with.
    pub fn places_rows_in_time(self) -> bool {
        self != Order::Id
    }
}

impl std::fmt::Display for Order {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Order::CommitTime => "commit time (track_commit_timestamp), then created_at and id",
            Order::Timestamp => "created_at, then id",
            Order::Id => "id alone (the table has no timestamp column and track_commit_timestamp is off): each aggregate keeps its order only if ids grow with time (a sequence, UUIDv7)",
        })
    }
}

const COMMIT_TIME: &str = "pg_xact_commit_timestamp(o.xmin)";

fn quote(name: &str) -> String {
    format!("o.\"{}\"", name.replace('"', "\"\""))
}

impl Query {
    /// Sets the session up (ISO dates in UTC, as outboxd reads them),
    /// resolves the column map against the table, and decides whether
    /// commit times can be used: `track_commit_timestamp` on, and rows
    /// never updated (`by_commit_time` is false in polling mode).
    pub async fn prepare(
        client: &Client,
        table: &TableName,
        map: &ColumnMap,
        by_commit_time: bool,
    ) -> Result<Self, AdminError> {
        client
            .batch_execute("SET DateStyle = 'ISO'; SET TimeZone = 'UTC'")
            .await?;
        let catalog = crate::source::outbox::read_table(client, table).await?;
        let resolved = OutboxColumns::from_catalog(&table.to_string(), &catalog, map)
            .map_err(|e| AdminError::Row(e.to_string()))?;
        let tracked: String = client.query_one("SHOW track_commit_timestamp", &[]).await?.get(0);
        let commit = by_commit_time && tracked == "on";
        let created_at = match (resolved.role_column(Role::Timestamp), resolved.timestamp_kind()) {
            (Some(c), Some(Kind::Timestamp)) => format!("({} AT TIME ZONE 'UTC')", quote(c)),
            // Milliseconds beyond PostgreSQL's range read as none.
            (Some(c), Some(Kind::Int(_))) => format!(
                "CASE WHEN {c} BETWEEN -210866803200000 AND 9224318015999999 THEN to_timestamp({c} / 1000.0) END",
                c = quote(c)
            ),
            (Some(c), _) => quote(c),
            (None, _) => "NULL::timestamptz".to_owned(),
        };
        let order = Order::of(commit, resolved.role_column(Role::Timestamp).is_some());
        let created_at = format!("coalesce({created_at}, '-infinity'::timestamptz)");
        let id_name = resolved.role_column(Role::Id).unwrap_or("id").to_owned();
        let id_type = catalog
            .iter()
            .find(|c| c.name == id_name)
            .map_or_else(|| "text".to_owned(), |c| c.type_name.clone());
        Ok(Query {
            table: table.quoted().to_string(),
            order_time: if commit {
                format!("coalesce({COMMIT_TIME}, {created_at})")
            } else {
                created_at.clone()
            },
            commit_time: if commit { COMMIT_TIME } else { "NULL::timestamptz" },
            created_at,
            id: quote(&id_name),
            id_type,
            route: resolved.role_column(Role::Route).map(quote),
            key: quote(resolved.role_column(Role::Key).unwrap_or("aggregate_id")),
            map: map.clone(),
            table_name: table.clone(),
            order,
        })
    }

    /// How rows are ordered.
    pub fn order(&self) -> Order {
        self.order
    }

    /// Whether rows are ordered by commit time (else by `created_at`).
    pub fn by_commit_time(&self) -> bool {
        self.commit_time == COMMIT_TIME
    }

    /// `$p` as a value of the id column's type.
    fn as_id(&self, p: &str) -> String {
        format!("{p}::text::{}", self.id_type)
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
        let created_at = &self.created_at;
        if let Some(since) = sel.since {
            let p = param(Box::new(since));
            let slack = param(Box::new(sel.slack.as_secs_f64()));
            clauses.push(format!(
                "coalesce({ct} >= {p}, {created_at} >= {p} - make_interval(secs => {slack}))"
            ));
        }
        if let Some(until) = sel.until {
            let p = param(Box::new(until));
            clauses.push(format!("coalesce({ct} < {p}, {created_at} < {p})"));
        }
        if !sel.aggregate_types.is_empty() {
            let p = param(Box::new(sel.aggregate_types.clone()));
            clauses.push(match &self.route {
                Some(route) => format!("({route})::text = ANY({p})"),
                None => "false".to_owned(),
            });
        }
        if !sel.aggregate_ids.is_empty() {
            let p = param(Box::new(sel.aggregate_ids.clone()));
            clauses.push(format!("({})::text = ANY({p})", self.key));
        }
        if !sel.ids.is_empty() {
            let p = param(Box::new(sel.ids.clone()));
            clauses.push(format!("{} = ANY({p}::text[]::{}[])", self.id, self.id_type));
        }
        if let Some(k) = after {
            let t = param(Box::new(k.order_time.clone()));
            let c = param(Box::new(k.created_at.clone()));
            let i = param(Box::new(k.id.clone()));
            clauses.push(format!(
                "({}, {created_at}, {}) > ({t}::text::timestamptz, {c}::text::timestamptz, {})",
                self.order_time,
                self.id,
                self.as_id(&i)
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
    ) -> Result<Vec<String>, AdminError> {
        let (filter, params) = self.filter(sel, after);
        let sql = format!(
            "SELECT ({id})::text FROM {} o WHERE {filter} ORDER BY {}, {}, {id}",
            self.table,
            self.order_time,
            self.created_at,
            id = self.id
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
        let route = self
            .route
            .as_ref()
            .map_or_else(|| "''".to_owned(), |r| format!("({r})::text"));
        let sql = format!(
            "SELECT {route}, count(*), min({t})::text, max({t})::text
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
                aggregate_type: r.get::<_, Option<String>>(0).unwrap_or_default(),
                rows: r.get(1),
                first: r.get(2),
                last: r.get(3),
            })
            .collect())
    }

    /// The rows with these ids that still exist, by id. The column map is
    /// resolved again under a lock that keeps the table's columns as they
    /// are until the rows are read, so no value is read as a type its
    /// column no longer has.
    pub async fn rows(
        &self,
        client: &mut Client,
        ids: &[String],
    ) -> Result<HashMap<String, ReplayRow>, AdminError> {
        let tx = client.transaction().await?;
        tx.batch_execute(&format!("LOCK TABLE {} IN ACCESS SHARE MODE", self.table))
            .await?;
        let catalog = crate::source::outbox::read_table(&tx, &self.table_name).await?;
        let resolved = OutboxColumns::from_catalog(&self.table_name.to_string(), &catalog, &self.map)
            .map_err(|e| AdminError::Row(e.to_string()))?;
        let (list, columns) = resolved.select();
        let sql = format!(
            "SELECT {}, ({t})::text, (extract(epoch FROM {ct}) * 1000)::float8, ({c})::text
               FROM {} o WHERE {} = ANY($1::text[]::{}[])",
            list,
            self.table,
            self.id,
            self.id_type,
            t = self.order_time,
            ct = self.commit_time,
            c = self.created_at,
        );
        let rows = tx.query(&sql, &[&ids]).await?;
        tx.commit().await?;
        let at = columns.width();
        rows.iter()
            .map(|r| {
                let row = columns
                    .from_result(r)
                    .map_err(|e| AdminError::Row(e.to_string()))?;
                let replay = ReplayRow {
                    key: Key {
                        order_time: r.get(at),
                        created_at: r.get(at + 2),
                        id: row.id.clone(),
                    },
                    row,
                    commit_ms: r.get::<_, Option<f64>>(at + 1).map(|ms| ms as i64),
                };
                Ok((replay.row.id.clone(), replay))
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn without_a_timestamp_or_commit_times_rows_have_no_place_in_time() {
        assert_eq!(Order::of(true, false), Order::CommitTime);
        assert_eq!(Order::of(false, true), Order::Timestamp);
        assert_eq!(Order::of(false, false), Order::Id);
        assert!(!Order::Id.places_rows_in_time() && Order::Timestamp.places_rows_in_time());
        assert!(Order::Id.to_string().contains("ids grow with time"));
    }
}
