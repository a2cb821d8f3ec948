//! The replication stream seen as outbox transactions.
//!
//! [`OutboxStream`] wraps a [`ReplicationStream`]: it decodes each XLogData
//! with the pgoutput decoder, keeps the relation cache (relation id → column
//! positions of the outbox table), and yields only what the relay needs:
//!
//! * `Begin` / `Commit` of every transaction, with its commit LSNs;
//! * one `Insert` per row inserted into the outbox table;
//! * keepalives, with the server's WAL end.
//!
//! Everything else (UPDATE, DELETE, TRUNCATE, rows of other published
//! tables, origins, types, logical decoding messages) is consumed here and
//! never surfaces as an outbox insert. A transaction that touches no outbox
//! row still yields Begin and Commit, which lets the relay confirm past it.

use std::collections::HashMap;

use crate::config::columns::ColumnMap;
use crate::config::ident::TableName;
use crate::lsn::Lsn;
use crate::postgres::connection::ReplicationStream;
use crate::postgres::copy_both::{ReplicationMessage, StandbyStatusUpdate};
use crate::postgres::error::PgError;
use crate::postgres::pgoutput::{LogicalMessage, PgOutputDecoder, PgTimestamp};
use crate::source::outbox::{OutboxColumns, OutboxRow, RowError, TableColumn, UnreadableRow};

/// One step of the outbox stream.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StreamEvent {
    Begin {
        xid: u32,
        /// LSN of the transaction's commit record.
        final_lsn: Lsn,
        commit_time: PgTimestamp,
    },
    Insert {
        row: OutboxRow,
        /// WAL position of the INSERT.
        lsn: Lsn,
    },
    /// A row of the outbox table that cannot be read as an event; the relay
    /// applies `routing.on_poison` to it.
    Unreadable {
        row: UnreadableRow,
        lsn: Lsn,
    },
    Commit {
        commit_lsn: Lsn,
        /// The position to confirm once every event of this and earlier
        /// transactions is acknowledged.
        end_lsn: Lsn,
        commit_time: PgTimestamp,
    },
    Keepalive {
        wal_end: Lsn,
        reply_requested: bool,
    },
}

/// A row of the outbox table could not be read.
#[derive(Debug, thiserror::Error)]
pub enum StreamError {
    #[error(transparent)]
    Pg(#[from] PgError),
    #[error("outbox row at {lsn} is unreadable: {source}")]
    Row { lsn: Lsn, source: RowError },
    #[error("INSERT at {lsn} refers to relation {relation_id}, which was never described; the stream is out of sync")]
    UnknownRelation { lsn: Lsn, relation_id: u32 },
    #[error("the stream describes {found} where the outbox table {table} was (the table was renamed, or dropped and created again): rename it back, or set postgres.table and restart; outbox rows written meanwhile may need to be re-published")]
    TableChanged { lsn: Lsn, table: String, found: String },
}

impl StreamError {
    /// Transient failures are worth a reconnect.
    pub fn is_transient(&self) -> bool {
        match self {
            StreamError::Pg(e) => e.is_transient(),
            StreamError::UnknownRelation { .. } => true,
            StreamError::Row { .. } | StreamError::TableChanged { .. } => false,
        }
    }
}

/// Decoded outbox transactions from a replication stream.
#[derive(Debug)]
pub struct OutboxStream {
    stream: ReplicationStream,
    decoder: PgOutputDecoder,
    table: TableName,
    /// The outbox table's oid, as proven at start: rows are matched by it.
    table_oid: u32,
    /// Relation id → outbox column positions; `None` for other tables.
    relations: HashMap<u32, Option<OutboxColumns>>,
    /// Which column plays which role.
    columns: ColumnMap,
    /// The table's columns as the catalog described them at start: the
    /// kinds of columns whose type a `Relation` does not tell (domains,
    /// enums).
    catalog: Vec<TableColumn>,
    /// What the table's columns are, for events emitted as messages: a
    /// message's key is written as the key column's would be (the same
    /// bytes, so the same partition, under `key_format = "connect-json"`).
    facts: Option<std::sync::Arc<crate::source::outbox::ColumnFacts>>,
    /// The server's WAL end, from the latest XLogData or keepalive.
    server_wal_end: Lsn,
    /// The prefix of logical decoding messages that are outbox events
    /// (`None`: messages are not read).
    message_prefix: Option<String>,
    /// The commit time of the transaction being read, for messages
    /// without `createdAt`.
    commit_time: PgTimestamp,
}

impl OutboxStream {
    pub fn new(
        stream: ReplicationStream,
        table: TableName,
        table_oid: u32,
        columns: ColumnMap,
        catalog: Vec<TableColumn>,
    ) -> Self {
        // A message always has a type and an aggregate type, whatever the
        // table has.
        let facts = OutboxColumns::from_catalog(&table.to_string(), &catalog, &columns)
            .ok()
            .map(|c| {
                std::sync::Arc::new(crate::source::outbox::ColumnFacts {
                    has_route: true,
                    has_type: true,
                    ..c.facts()
                })
            });
        OutboxStream {
            stream,
            decoder: PgOutputDecoder::new(),
            table,
            table_oid,
            relations: HashMap::new(),
            columns,
            catalog,
            facts,
            server_wal_end: Lsn::ZERO,
            message_prefix: None,
            commit_time: PgTimestamp(0),
        }
    }

    /// Also yields transactional logical decoding messages with `prefix`
    /// as outbox inserts ([`crate::source::emitted`]); the stream must have been
    /// started with `messages 'true'`.
    pub fn with_messages(mut self, prefix: Option<String>) -> Self {
        self.message_prefix = prefix;
        self
    }

    /// The commit time of the transaction being read.
    fn commit_datetime(&self) -> chrono::DateTime<chrono::Utc> {
        chrono::DateTime::from_timestamp_micros(self.commit_time.unix_micros()).unwrap_or_default()
    }

    /// The server's WAL end as last reported on the stream.
    pub fn server_wal_end(&self) -> Lsn {
        self.server_wal_end
    }

    /// The next event; `None` when the server ended the stream. Cancel-safe.
    pub async fn next_event(&mut self) -> Result<Option<StreamEvent>, StreamError> {
        loop {
            let Some(msg) = self.stream.next_message().await? else {
                return Ok(None);
            };
            let xlog = match msg {
                ReplicationMessage::PrimaryKeepalive(k) => {
                    self.server_wal_end = self.server_wal_end.max(k.wal_end);
                    return Ok(Some(StreamEvent::Keepalive {
                        wal_end: k.wal_end,
                        reply_requested: k.reply_requested,
                    }));
                }
                ReplicationMessage::XLogData(x) => x,
            };
            let lsn = xlog.wal_start;
            self.server_wal_end = self.server_wal_end.max(xlog.wal_end);
            let decoded = self
                .decoder
                .decode(xlog.data)
                .map_err(|source| PgError::Decode { lsn, source })?;
            if let Some(event) = self.handle(decoded, lsn)? {
                return Ok(Some(event));
            }
        }
    }

    fn handle(&mut self, msg: LogicalMessage, lsn: Lsn) -> Result<Option<StreamEvent>, StreamError> {
        Ok(match msg {
            LogicalMessage::Begin(b) => {
                self.commit_time = b.commit_time;
                Some(StreamEvent::Begin {
                    xid: b.xid,
                    final_lsn: b.final_lsn,
                    commit_time: b.commit_time,
                })
            }
            // A transactional message with the outbox prefix is an outbox
            // event; others are not ours, and a non-transactional one would
            // outlive a rollback (see crate::source::emitted).
            LogicalMessage::Message(m)
                if m.flags & 1 == 1 && self.message_prefix.as_deref() == Some(m.prefix.as_str()) =>
            {
                match crate::source::emitted::read(&m.content, self.commit_datetime()) {
                    crate::source::emitted::Read::Event(mut row) => {
                        row.facts.clone_from(&self.facts);
                        Some(StreamEvent::Insert { row, lsn })
                    }
                    crate::source::emitted::Read::Unreadable(row) => {
                        Some(StreamEvent::Unreadable { row, lsn })
                    }
                }
            }
            LogicalMessage::Commit(c) => Some(StreamEvent::Commit {
                commit_lsn: c.commit_lsn,
                end_lsn: c.end_lsn,
                commit_time: c.commit_time,
            }),
            LogicalMessage::Relation(rel) => {
                let same_name = rel.namespace == self.table.schema && rel.name == self.table.name;
                let is_outbox = rel.id == self.table_oid;
                // A renamed outbox table would otherwise look like another
                // table, and its rows would be skipped without a trace.
                if is_outbox != same_name {
                    return Err(StreamError::TableChanged {
                        lsn,
                        table: self.table.to_string(),
                        found: format!("{}.{} (oid {})", rel.namespace, rel.name, rel.id),
                    });
                }
                let columns = if is_outbox {
                    Some(
                        OutboxColumns::from_relation(&rel, &self.columns, &self.catalog).map_err(|e| {
                            StreamError::Row {
                                lsn,
                                source: RowError::Mapping(Box::new(e)),
                            }
                        })?,
                    )
                } else {
                    None
                };
                self.relations.insert(rel.id, columns);
                None
            }
            LogicalMessage::Insert(ins) => match self.relations.get(&ins.relation_id) {
                Some(Some(columns)) => match columns.row(&ins.new, self.commit_datetime()) {
                    Ok(row) => Some(StreamEvent::Insert { row, lsn }),
                    // A tuple of another width: the stream is out of step
                    // with its relation, which no row-level handling fixes.
                    Err(source @ RowError::ColumnCount { .. }) => {
                        return Err(StreamError::Row { lsn, source })
                    }
                    Err(error) => Some(StreamEvent::Unreadable {
                        row: columns.unreadable(&ins.new, error),
                        lsn,
                    }),
                },
                Some(None) => None,
                None => {
                    return Err(StreamError::UnknownRelation {
                        lsn,
                        relation_id: ins.relation_id,
                    })
                }
            },
            LogicalMessage::Origin(_)
            | LogicalMessage::Type(_)
            | LogicalMessage::Update(_)
            | LogicalMessage::Delete(_)
            | LogicalMessage::Truncate(_)
            | LogicalMessage::Message(_)
            | LogicalMessage::StreamStart(_)
            | LogicalMessage::StreamStop
            | LogicalMessage::StreamCommit(_)
            | LogicalMessage::StreamAbort(_) => None,
        })
    }

    /// Reports progress to the server.
    pub async fn send_status(
        &mut self,
        received: Lsn,
        flushed: Lsn,
        reply_requested: bool,
    ) -> Result<(), PgError> {
        let mut update = StandbyStatusUpdate::now(received, flushed);
        update.reply_requested = reply_requested;
        self.stream.send_status(&update).await
    }

    /// Awaits `wait` while sending a status update (`received`, `flushed`)
    /// every `every`. A step that waits on something else (a full Kafka
    /// queue, a topic being created, the leader check) must not go quiet
    /// for longer than the server's `wal_sender_timeout`, which would end
    /// the session. The values are those from before the wait: reporting
    /// less progress than was made is always safe.
    pub async fn keep_alive_while<T>(
        &mut self,
        received: Lsn,
        flushed: Lsn,
        every: std::time::Duration,
        wait: impl std::future::Future<Output = T>,
    ) -> Result<T, PgError> {
        tokio::pin!(wait);
        let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                biased;
                out = &mut wait => return Ok(out),
                _ = tick.tick() => {
                    tracing::debug!(%flushed, "still waiting; status update sent to keep the session");
                    self.send_status(received, flushed, false).await?;
                }
            }
        }
    }

    /// The walsender's PID.
    pub fn backend_pid(&self) -> i32 {
        self.stream.backend_pid()
    }

    /// Ends streaming cleanly.
    pub async fn stop(self, wait: std::time::Duration) -> Result<(), PgError> {
        self.stream.stop(wait).await
    }
}
