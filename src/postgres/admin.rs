//! Slot and publication management on an ordinary SQL connection.
//!
//! The publication must deliver every INSERT on the outbox table with every
//! column (`publication`). When it is missing outboxd creates it (`FOR
//! TABLE … WITH (publish = 'insert')`, unless `postgres.create_publication`
//! is false). When it exists but is wrong, outboxd does not alter it behind
//! the operator's back: it stops and prints the exact SQL to run.
//!
//! The slot is created on the replication connection (only there can a
//! logical slot be created without holding a snapshot), after checking here
//! whether it exists and belongs to this database and plugin.

use tokio_postgres::tls::{MakeTlsConnect, TlsConnect};
use tokio_postgres::{Client, NoTls, Socket};

use crate::config::conninfo::PgConnectConfig;
use crate::config::ident::{SlotName, TableName};
use crate::lsn::Lsn;
use crate::postgres::connection::ReplicationConnection;
use crate::postgres::error::PgError;
use crate::postgres::publication::{self, Verified};
use crate::postgres::tls;

pub use crate::postgres::error::AdminError;
pub use outbox_sdk::error::describe;

/// Connects an ordinary client with the same settings (and TLS rules) as
/// the replication connection. The connection task runs in the background.
pub async fn connect(cfg: &PgConnectConfig) -> Result<Client, AdminError> {
    let pg = cfg.to_tokio_postgres();
    match tls::client_config(cfg)? {
        Some(tls_cfg) => {
            let tls = tokio_postgres_rustls::MakeRustlsConnect::new((*tls_cfg).clone());
            connect_with(&pg, tls, cfg).await
        }
        None => connect_with(&pg, NoTls, cfg).await,
    }
}

async fn connect_with<T>(
    pg: &tokio_postgres::Config,
    tls: T,
    cfg: &PgConnectConfig,
) -> Result<Client, AdminError>
where
    T: MakeTlsConnect<Socket> + Send + 'static,
    T::Stream: Send + 'static,
    T::TlsConnect: Send,
    <T::TlsConnect as TlsConnect<Socket>>::Future: Send,
{
    let (client, conn) = pg.connect(tls).await.map_err(|source| AdminError::Connect {
        target: cfg.target(),
        source,
    })?;
    tokio::spawn(async move {
        if let Err(e) = conn.await {
            tracing::debug!(error = %e, "admin connection closed");
        }
    });
    Ok(client)
}

/// Whether the outbox table exists.
pub async fn table_exists(client: &Client, table: &TableName) -> Result<bool, AdminError> {
    let row = client
        .query_one(
            "SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_tables WHERE schemaname = $1 AND tablename = $2)",
            &[&table.schema, &table.name],
        )
        .await?;
    Ok(row.get(0))
}

/// One column of a table as the catalog describes it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CatalogColumn {
    pub name: String,
    /// The declared type's oid (a domain's own).
    pub type_oid: u32,
    /// The type's oid, a domain's base type's (through every level).
    pub base_type_oid: u32,
    /// The base type's `typtype` (`b` base, `e` enum, `c` composite, …).
    pub typtype: i8,
    /// The declared type, as `format_type` writes it (`character
    /// varying(255)`, a domain's name).
    pub type_name: String,
    pub not_null: bool,
    /// The default expression, if any.
    pub default: Option<String>,
}

/// The columns of `table`, in their order (dropped ones left out); empty
/// when the table does not exist.
pub async fn table_columns(
    client: &impl tokio_postgres::GenericClient,
    table: &TableName,
) -> Result<Vec<CatalogColumn>, AdminError> {
    let rows = client
        .query(
            "WITH RECURSIVE cols AS (
                 SELECT a.attnum, a.attname::text AS name, a.atttypid AS typid, a.attnotnull,
                        pg_catalog.format_type(a.atttypid, a.atttypmod) AS type_name,
                        pg_catalog.pg_get_expr(d.adbin, d.adrelid) AS dflt
                   FROM pg_catalog.pg_attribute a
                   LEFT JOIN pg_catalog.pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
                  WHERE a.attrelid = (SELECT c.oid FROM pg_catalog.pg_class c
                                        JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
                                       WHERE n.nspname = $1 AND c.relname = $2)
                    AND a.attnum > 0 AND NOT a.attisdropped),
             base AS (
                 SELECT cols.attnum, cols.typid AS oid, 0 AS depth FROM cols
                 UNION ALL
                 SELECT base.attnum, t.typbasetype, base.depth + 1
                   FROM base JOIN pg_catalog.pg_type t ON t.oid = base.oid
                  WHERE t.typtype = 'd' AND base.depth < 16)
             SELECT cols.name, b.oid, t.typtype, cols.type_name, cols.attnotnull, cols.dflt, cols.typid
               FROM cols
               JOIN LATERAL (SELECT oid FROM base WHERE base.attnum = cols.attnum ORDER BY depth DESC LIMIT 1) b ON true
               JOIN pg_catalog.pg_type t ON t.oid = b.oid
              ORDER BY cols.attnum",
            &[&table.schema, &table.name],
        )
        .await?;
    Ok(rows
        .iter()
        .map(|r| CatalogColumn {
            name: r.get(0),
            base_type_oid: r.get(1),
            typtype: r.get(2),
            type_name: r.get(3),
            not_null: r.get(4),
            default: r.get(5),
            type_oid: r.get(6),
        })
        .collect())
}

/// What polling mode needs of the outbox table: the column it marks rows
/// published in (`published`, `published_at` unless
/// `polling.published_column` names another), and a timestamp column
/// (`created_at` unless `columns.timestamp` names another) that every row
/// has and that is the insert time (`clock_timestamp()`), since rows are
/// published in its order.
pub async fn polling_table_problem(
    client: &Client,
    table: &TableName,
    timestamp: &str,
    published: &str,
) -> Result<(), AdminError> {
    let columns = table_columns(client, table).await?;
    if columns.is_empty() {
        return Err(AdminError::NoTable {
            table: table.to_string(),
        });
    }
    let column = |name: &str| columns.iter().find(|c| c.name == name);
    match column(published) {
        None => {
            return Err(AdminError::NoPublishedColumn {
                table: table.to_string(),
                column: published.to_owned(),
            })
        }
        Some(c) if c.base_type_oid != 1184 && c.base_type_oid != 1114 => {
            return Err(AdminError::PollingTimestampType {
                table: table.to_string(),
                column: published.to_owned(),
                found: c.type_name.clone(),
            })
        }
        Some(_) => {}
    }
    let Some(created_at) = column(timestamp) else {
        return Err(AdminError::NoColumn {
            table: table.to_string(),
            column: "created_at (columns.timestamp)",
        });
    };
    // timestamptz, or timestamp (read as UTC): rounds compare it with the
    // watermark's time.
    if ![1184, 1114].contains(&created_at.base_type_oid) {
        return Err(AdminError::PollingTimestampType {
            table: table.to_string(),
            column: timestamp.to_owned(),
            found: created_at.type_name.clone(),
        });
    }
    if !created_at.not_null {
        return Err(AdminError::CreatedAtNullable {
            table: table.to_string(),
            column: timestamp.to_owned(),
        });
    }
    if !created_at
        .default
        .as_deref()
        .is_some_and(|d| d.contains("clock_timestamp()"))
    {
        return Err(AdminError::CreatedAtDefault {
            table: table.to_string(),
            column: timestamp.to_owned(),
            default: created_at.default.clone().unwrap_or_else(|| "nothing".into()),
        });
    }
    Ok(())
}

/// Creates the publication if it is missing (`FOR TABLE … WITH (publish =
/// 'insert')`), then proves that it delivers every outbox INSERT (see
/// [`publication::inspect`]). An existing publication is never altered.
pub async fn ensure_publication(
    client: &Client,
    subject: &publication::Subject,
) -> Result<Verified, AdminError> {
    let (publication, table) = (&subject.publication, &subject.table);
    if !table_exists(client, table).await? {
        return Err(AdminError::NoTable {
            table: table.to_string(),
        });
    }
    let exists = client
        .query_opt(
            "SELECT 1 FROM pg_catalog.pg_publication WHERE pubname = $1",
            &[&publication.as_str()],
        )
        .await?
        .is_some();
    if !exists {
        // Via the partition root (PostgreSQL 13+), so that the rows of a
        // partitioned outbox arrive as the outbox's, whichever partition
        // holds them (a table that is not partitioned is unaffected).
        let via_root = if publication::server_version(client).await? >= 130_000 {
            ", publish_via_partition_root = true"
        } else {
            ""
        };
        let sql = format!(
            "CREATE PUBLICATION {} FOR TABLE {} WITH (publish = 'insert'{via_root})",
            publication.quoted(),
            table.quoted()
        );
        match client.batch_execute(&sql).await {
            Ok(()) => tracing::info!(publication = publication.as_str(), "created publication"),
            // Another process created it first: inspect what it made.
            Err(e) if e.code() == Some(&tokio_postgres::error::SqlState::DUPLICATE_OBJECT) => {}
            Err(e) => return Err(e.into()),
        }
    }
    publication::inspect(client, subject).await
}

/// A row of `pg_replication_slots`. Columns newer than PostgreSQL 13 are
/// `None` on servers that do not have them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SlotInfo {
    pub plugin: Option<String>,
    pub slot_type: String,
    pub database: Option<String>,
    pub active: bool,
    pub active_pid: Option<i32>,
    pub restart_lsn: Option<Lsn>,
    pub confirmed_flush_lsn: Option<Lsn>,
    /// `reserved`, `extended`, `unreserved` or `lost`.
    pub wal_status: Option<String>,
    /// PostgreSQL 16+: invalidated by a recovery conflict (on a standby).
    pub conflicting: Option<bool>,
    /// PostgreSQL 17+: `wal_removed`, `rows_removed`,
    /// `wal_level_insufficient`; 18 adds `idle_timeout`.
    pub invalidation_reason: Option<String>,
    /// PostgreSQL 17+: a failover slot, kept on standbys that sync slots.
    pub failover: Option<bool>,
    /// PostgreSQL 17+: a standby's copy of a primary's failover slot.
    pub synced: Option<bool>,
    pub temporary: bool,
    /// The oldest transaction whose catalog changes the slot may still
    /// decode with: every transaction before it had ended at a position
    /// the slot has confirmed.
    pub catalog_xmin: Option<u32>,
}

impl SlotInfo {
    /// Why the slot can no longer stream, if it cannot: PostgreSQL 17+
    /// names the reason; older servers show `wal_status = 'lost'` (WAL
    /// removed) or, on 16, `conflicting` (rows removed on a standby).
    pub fn invalidated(&self) -> Option<String> {
        if let Some(reason) = &self.invalidation_reason {
            return Some(reason.clone());
        }
        if self.conflicting == Some(true) {
            return Some("rows_removed".to_owned());
        }
        (self.wal_status.as_deref() == Some("lost")).then(|| "wal_removed".to_owned())
    }
}

/// What an invalidation reason of `pg_replication_slots` means, for the
/// operator.
pub fn explain_invalidation(reason: &str) -> &'static str {
    match reason {
        "wal_removed" => "PostgreSQL removed WAL it still needed (max_slot_wal_keep_size was exceeded)",
        "rows_removed" => "catalog rows it still needed were removed (a recovery conflict, as after a promotion without hot_standby_feedback)",
        "wal_level_insufficient" => "wal_level was lowered below logical",
        "idle_timeout" => "it stayed inactive longer than idle_replication_slot_timeout",
        _ => "PostgreSQL invalidated it",
    }
}

fn lsn_col(row: &tokio_postgres::Row, idx: usize) -> Option<Lsn> {
    row.get::<_, Option<String>>(idx).and_then(|s| s.parse().ok())
}

/// Reads the slot's row, if it exists. Columns that only newer servers have
/// are read through `to_jsonb`, so the query runs on every version.
pub async fn slot_info(client: &Client, slot: &SlotName) -> Result<Option<SlotInfo>, AdminError> {
    let row = client
        .query_opt(
            "SELECT plugin::text, slot_type, database::text, active, active_pid,
                    restart_lsn::text, confirmed_flush_lsn::text, wal_status,
                    (to_jsonb(s) ->> 'conflicting')::boolean,
                    to_jsonb(s) ->> 'invalidation_reason',
                    (to_jsonb(s) ->> 'failover')::boolean,
                    (to_jsonb(s) ->> 'synced')::boolean,
                    temporary, catalog_xmin::text
               FROM pg_catalog.pg_replication_slots s WHERE slot_name = $1",
            &[&slot.as_str()],
        )
        .await?;
    Ok(row.map(|r| SlotInfo {
        plugin: r.get(0),
        slot_type: r.get(1),
        database: r.get(2),
        active: r.get(3),
        active_pid: r.get(4),
        restart_lsn: lsn_col(&r, 5),
        confirmed_flush_lsn: lsn_col(&r, 6),
        wal_status: r.get(7),
        conflicting: r.get(8),
        invalidation_reason: r.get(9),
        failover: r.get(10),
        synced: r.get(11),
        temporary: r.get(12),
        catalog_xmin: r.get::<_, Option<String>>(13).and_then(|x| x.parse().ok()),
    }))
}

/// What [`ensure_slot`] found or did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SlotState {
    /// The slot was created; streaming starts at its consistent point.
    Created { consistent_point: Lsn },
    /// The slot exists and fits.
    Existing(SlotInfo),
}

/// Checks that an existing slot is a pgoutput slot of this database.
fn check_fits(info: &SlotInfo, slot: &SlotName, dbname: &str) -> Result<(), AdminError> {
    let problem = if info.slot_type != "logical" {
        Some(format!("is a {} slot, not a logical one", info.slot_type))
    } else if info.plugin.as_deref() != Some("pgoutput") {
        Some(format!(
            "uses plugin {:?}, not pgoutput",
            info.plugin.as_deref().unwrap_or("")
        ))
    } else if info.database.as_deref() != Some(dbname) {
        Some(format!(
            "belongs to database {:?}, not {dbname:?}",
            info.database.as_deref().unwrap_or("")
        ))
    } else {
        None
    };
    match problem {
        Some(problem) => Err(AdminError::ForeignSlot {
            slot: slot.as_str().to_owned(),
            problem,
        }),
        None => Ok(()),
    }
}

/// How long altering the slot may wait for another process to release it.
const ALTER_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

/// Creates the logical slot if it is missing; refuses a slot that belongs
/// to another database or plugin. With `failover` set (only on PostgreSQL
/// 17+) a new slot is a failover slot, and an existing one is altered to
/// match; `None` leaves it alone.
pub async fn ensure_slot(
    client: &Client,
    repl: &mut ReplicationConnection,
    slot: &SlotName,
    dbname: &str,
    failover: Option<bool>,
) -> Result<SlotState, AdminError> {
    if let Some(mut info) = slot_info(client, slot).await? {
        check_fits(&info, slot, dbname)?;
        if let (Some(want), Some(have)) = (failover, info.failover) {
            // A slot another process holds is left alone: ALTER would wait
            // for it, and starting it fails next anyway (and is retried);
            // a later session alters it once it is free.
            if want != have && info.invalidated().is_none() && !info.active {
                match tokio::time::timeout(ALTER_WAIT, repl.alter_slot_failover(slot, want)).await {
                    Ok(Ok(())) => {
                        tracing::info!(slot = slot.as_str(), failover = want, "altered the slot's failover setting");
                        info.failover = Some(want);
                    }
                    // Not fatal: the failover check reports a slot left as it was.
                    Ok(Err(e)) => tracing::warn!(
                        slot = slot.as_str(),
                        failover = want,
                        error = %e,
                        "cannot alter the slot's failover setting (postgres.failover_slot); going on with it as it is"
                    ),
                    // Taken by another process meanwhile: this connection is
                    // still waiting, so the session starts over.
                    Err(_) => {
                        return Err(AdminError::Replication(PgError::Io(std::io::Error::new(
                            std::io::ErrorKind::TimedOut,
                            format!(
                                "ALTER_REPLICATION_SLOT waited {ALTER_WAIT:?} for slot {}, which another process holds; retrying",
                                slot.as_str()
                            ),
                        ))))
                    }
                }
            }
        }
        return Ok(SlotState::Existing(info));
    }
    match repl.create_logical_slot(slot, failover == Some(true)).await {
        Ok(consistent_point) => Ok(SlotState::Created { consistent_point }),
        // Created concurrently by another process: use it.
        Err(e) if e.sqlstate() == Some("42710") => match slot_info(client, slot).await? {
            Some(info) => {
                check_fits(&info, slot, dbname)?;
                Ok(SlotState::Existing(info))
            }
            None => Err(e.into()),
        },
        Err(e) => Err(e.into()),
    }
}

/// Ends the walsender that holds `slot` when it serves an outboxd with
/// this `application_name` (the caller holds the leader lock, so that one
/// lost it), and waits up to 5 s for the slot to be released. A walsender
/// of anything else (a pg_recvlogical, say) is left alone: starting
/// replication then fails with "slot is active" and is retried.
pub async fn end_stale_walsender(
    client: &Client,
    slot: &SlotName,
    application_name: &str,
) -> Result<(), AdminError> {
    let ended = client
        .query_opt(
            "SELECT s.active_pid, pg_catalog.pg_terminate_backend(s.active_pid)
               FROM pg_catalog.pg_replication_slots s
               JOIN pg_catalog.pg_stat_activity a ON a.pid = s.active_pid
              WHERE s.slot_name = $1 AND s.active AND a.application_name = $2
                AND a.usename = current_user",
            &[&slot.as_str(), &application_name],
        )
        .await?;
    let Some(row) = ended else {
        return Ok(());
    };
    let pid: i32 = row.get(0);
    tracing::warn!(
        slot = slot.as_str(),
        pid,
        "ended the walsender of an outboxd that lost the leader lock (stopped or cut off)"
    );
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(5);
    while tokio::time::Instant::now() < deadline {
        if !slot_info(client, slot).await?.is_some_and(|i| i.active) {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    Ok(())
}

/// Where the server's WAL ends now (`pg_current_wal_insert_lsn()`).
pub async fn wal_insert_lsn(client: &Client) -> Result<Lsn, AdminError> {
    let s: String = client
        .query_one("SELECT pg_current_wal_insert_lsn()::text", &[])
        .await?
        .get(0);
    Ok(s.parse().unwrap_or(Lsn::ZERO))
}

/// The server's `wal_sender_timeout` (`None` when 0, that is disabled): a
/// walsender that hears nothing from outboxd for this long ends the session.
pub async fn wal_sender_timeout(client: &Client) -> Result<Option<std::time::Duration>, AdminError> {
    let row = client
        .query_one(
            "SELECT setting::bigint FROM pg_settings WHERE name = 'wal_sender_timeout'",
            &[],
        )
        .await?;
    let ms: i64 = row.get(0);
    Ok(u64::try_from(ms)
        .ok()
        .filter(|ms| *ms > 0)
        .map(std::time::Duration::from_millis))
}
