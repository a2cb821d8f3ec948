//! Errors of the replication connection.

use std::fmt;
use std::io;

use crate::config::conninfo::ConnInfoError;
use crate::config::ident::IdentError;
use crate::postgres::copy_both::CopyDataError;
use crate::postgres::pgoutput::DecodeError;
use crate::postgres::tls::TlsConfigError;

/// An `ErrorResponse` from the server, with its SQLSTATE kept.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServerError {
    pub severity: String,
    /// The five-character SQLSTATE, e.g. `28P01` for a wrong password.
    pub code: String,
    pub message: String,
    pub detail: Option<String>,
    pub hint: Option<String>,
}

impl fmt::Display for ServerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {} (SQLSTATE {})", self.severity, self.message, self.code)?;
        if let Some(d) = &self.detail {
            write!(f, "; detail: {d}")?;
        }
        if let Some(h) = &self.hint {
            write!(f, "; hint: {h}")?;
        }
        Ok(())
    }
}

/// Everything that can go wrong on a replication connection.
#[derive(Debug, thiserror::Error)]
pub enum PgError {
    #[error(transparent)]
    ConnInfo(#[from] ConnInfoError),
    #[error(transparent)]
    Ident(#[from] IdentError),
    #[error(
        "cannot connect to PostgreSQL at {target}: {source}; is the server running and reachable from here?"
    )]
    Connect { target: String, source: io::Error },
    #[error("timed out after {secs}s connecting to PostgreSQL at {target}; check the host, port and firewall, or raise connect_timeout")]
    ConnectTimeout { target: String, secs: u64 },
    #[error("connection to PostgreSQL lost: {0}")]
    Io(#[from] io::Error),
    #[error(transparent)]
    TlsConfig(#[from] TlsConfigError),
    #[error("TLS handshake with PostgreSQL failed: {0}")]
    TlsHandshake(io::Error),
    #[error("the server does not accept TLS connections but sslmode={0} requires TLS: enable ssl in postgresql.conf or use sslmode=prefer")]
    TlsRefused(&'static str),
    #[error("the server asks for a password ({method}) but the postgres url has none: use postgres://user:${{PGPASSWORD}}@host/db")]
    PasswordRequired { method: &'static str },
    #[error("the server asks for {0} authentication, which outboxd does not support: use scram-sha-256 (or md5) for this user in pg_hba.conf")]
    UnsupportedAuth(String),
    #[error("SCRAM-SHA-256 authentication failed: {0}")]
    Scram(io::Error),
    #[error("PostgreSQL at {target} is read-only (a standby, or default_transaction_read_only = on) and target_session_attrs=read-write asks for a server that can write; waiting for a primary among the listed hosts")]
    ReadOnly { target: String },
    #[error("PostgreSQL {0}")]
    Server(ServerError),
    #[error("unexpected message from PostgreSQL: {0}")]
    Protocol(String),
    #[error("undecodable pgoutput message at {lsn}: {source}")]
    Decode {
        lsn: crate::lsn::Lsn,
        source: DecodeError,
    },
    #[error(transparent)]
    CopyData(#[from] CopyDataError),
}

impl PgError {
    /// The SQLSTATE when the server answered with an error.
    pub fn sqlstate(&self) -> Option<&str> {
        match self {
            PgError::Server(e) => Some(&e.code),
            _ => None,
        }
    }

    /// The server rejected the credentials (SQLSTATE class 28).
    pub fn is_auth_failure(&self) -> bool {
        self.sqlstate().is_some_and(|c| c.starts_with("28"))
    }

    /// A retry with backoff may succeed: the network, a restarting server,
    /// too many connections, or a slot still held by a previous walsender.
    pub fn is_transient(&self) -> bool {
        match self {
            PgError::Connect { .. }
            | PgError::ConnectTimeout { .. }
            | PgError::Io(_)
            | PgError::TlsHandshake(_)
            // During a failover every listed server may be a standby for a
            // moment; the promotion makes one of them writable.
            | PgError::ReadOnly { .. } => true,
            PgError::Server(e) => {
                let c = e.code.as_str();
                c.starts_with("08") // connection exception
                    || c.starts_with("57P") // admin shutdown, crash shutdown, cannot connect now
                    || c == "53300" // too many connections
                    || c == "55006" // object in use: slot active for another PID
                    || c == "40001"
                    || c == "40P01"
            }
            _ => false,
        }
    }
}

/// Setting up the publication or slot failed.
#[derive(Debug, thiserror::Error)]
pub enum AdminError {
    #[error("cannot connect to PostgreSQL at {target}: {}", outbox_sdk::error::describe(.source))]
    Connect {
        target: String,
        source: tokio_postgres::Error,
    },
    #[error(transparent)]
    Tls(#[from] TlsConfigError),
    #[error("PostgreSQL query failed: {}", outbox_sdk::error::describe(.0))]
    Query(#[from] tokio_postgres::Error),
    #[error(transparent)]
    Replication(#[from] PgError),
    /// An outbox row that does not read back (its text, as the error says).
    #[error("an outbox row cannot be read: {0}")]
    Row(String),
    #[error(
        "outbox table {table} does not exist: run `outboxd migrate` or apply migrations/0001_outbox.sql"
    )]
    NoTable { table: String },
    #[error("publication {publication} exists but does not include {table}; run: ALTER PUBLICATION {publication_sql} ADD TABLE {table_sql};")]
    TableNotPublished {
        publication: String,
        table: String,
        publication_sql: String,
        table_sql: String,
    },
    #[error("publication {publication} does not publish INSERTs; run: ALTER PUBLICATION {publication_sql} SET (publish = '{publish}');")]
    InsertsNotPublished {
        publication: String,
        publication_sql: String,
        /// What it publishes now, with `insert` added.
        publish: String,
    },
    #[error("publication {publication} does not exist and postgres.create_publication is false; run: CREATE PUBLICATION {publication_sql} FOR TABLE {table_sql} WITH (publish = 'insert', publish_via_partition_root = true);")]
    NoPublication {
        publication: String,
        publication_sql: String,
        table_sql: String,
    },
    #[error("publication {publication} has {what}; outbox rows would be lost. Run: {fix}")]
    PublicationFilters {
        publication: String,
        what: String,
        fix: String,
    },
    #[error("outbox table {table} was renamed or replaced (it is now {now:?}); rename it back, or set postgres.table to the table the application writes and restart")]
    TableReplaced { table: String, now: String },
    #[error("outbox table {table} has no column {column:?}: it must follow migrations/0001_outbox.sql")]
    NoColumn { table: String, column: &'static str },
    #[error("outbox table {table} allows a NULL {column}: polling mode publishes rows in {column} order and never reads a row without one. Set the NULL ones (UPDATE {table} SET {column} = now() WHERE {column} IS NULL), then run ALTER TABLE {table} ALTER COLUMN {column} SET NOT NULL")]
    CreatedAtNullable { table: String, column: String },
    #[error("outbox table {table}'s {column} defaults to {default}, not clock_timestamp(): with a transaction's start time, a writer that waited for another one (a lock on the aggregate, a version check) can get the earlier {column}, and polling mode, which publishes in {column} order, would publish its event first. Run ALTER TABLE {table} ALTER COLUMN {column} SET DEFAULT clock_timestamp() (migration 0008 does it for the table named outbox)")]
    CreatedAtDefault {
        table: String,
        column: String,
        default: String,
    },
    #[error("outbox table {table} has no column {column:?} (polling.published_column): polling mode marks each published row there; add it (ALTER TABLE {table} ADD COLUMN {column} timestamptz) or name the column that holds it")]
    NoPublishedColumn { table: String, column: String },
    #[error("outbox table {table}'s column {column} is {found}: polling mode orders rows by its timestamp column (columns.timestamp) and marks them in polling.published_column, so each must be timestamptz or timestamp")]
    PollingTimestampType {
        table: String,
        column: String,
        found: String,
    },
    #[error("replication slot {slot} exists but {problem}; drop it with SELECT pg_drop_replication_slot('{slot}') or configure another slot name")]
    ForeignSlot { slot: String, problem: String },
    #[error("outbox table {table} is partitioned, and publication {publication} does not publish via the partition root: pgoutput would describe each row as its partition, and outboxd would never see it as an outbox row. Run: {fix}")]
    PartitionsNotViaRoot {
        publication: String,
        table: String,
        fix: String,
    },
    #[error("publication {publication} describes the rows of {table} as another table's (an ancestor partitioned table published with publish_via_partition_root{}), so outboxd would never see them as outbox rows: set postgres.table to the table the publication names, or publish {table} itself", if *.partition { "" } else { ", or a table it inherits from" })]
    PublishedAsAncestor {
        publication: String,
        table: String,
        partition: bool,
    },
    #[error("outbox table {table}, or a partition of it, is not written to the WAL: {relations}. Logical replication cannot send such rows, so their rows would never be published. Run ALTER TABLE … SET LOGGED on each unlogged one (move a foreign partition's rows into a local one), then re-publish the rows they hold with `outboxd replay`")]
    NotInWal { table: String, relations: String },
    #[error("this database is set up for the table-less outbox ({functions}), but {because}: every event written with outbox_emit would be lost. Set postgres.messages = true (on PostgreSQL 14 or later), or drop the function if nothing uses it. Changing postgres.messages or postgres.message_prefix applies to the WAL the slot has not yet confirmed: stop the writers of outbox_emit and wait for outboxd to confirm past their last event before turning messages off")]
    EmitNotReceived {
        functions: String,
        because: &'static str,
    },
    #[error("{function} writes logical decoding messages with another prefix than postgres.message_prefix = {prefix:?}: its events would be skipped as someone else's. Set postgres.message_prefix to the prefix it writes (the shipped outbox_emit writes \"outbox\")")]
    EmitPrefix { function: String, prefix: String },
    #[error("any role may call pg_logical_emit_message (PUBLIC has EXECUTE on it), so any role that can connect could write an outbox event for outboxd to publish. As a superuser, run: {revoke} and grant EXECUTE on it only to the owner of outbox_emit (migration 0008 does both when a superuser applies it). Where no role may change it (a managed service), and nothing uses the table-less outbox: DROP FUNCTION outbox_emit and set postgres.messages = false")]
    EmitOpen { revoke: String },
}
