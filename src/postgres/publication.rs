//! Proving that the publication delivers every outbox INSERT.
//!
//! pgoutput sends a row only if, at the row's place in the WAL, the
//! publication includes the table, publishes INSERTs, has no row filter
//! for it and no column list that leaves out a column outboxd reads. A row
//! it does not send leaves no trace in the stream: keepalives then move the
//! slot past it and the event is lost for good. So outboxd proves delivery
//! instead of assuming it:
//!
//! * **At start** (and in `outboxd check`), [`inspect`] reads the catalog
//!   and refuses a publication that would not deliver every INSERT with
//!   every column, naming the exact statement to run. The result includes
//!   a fingerprint of everything that decides delivery: the publication
//!   row (its `xmin` changes on `SET (publish = …)`), the table's membership
//!   row (a new oid when the table was dropped from the publication and
//!   added back, with its row filter and column list), a schema-level
//!   membership, the table's oid and name, and the numbers of the columns
//!   outboxd reads (a column dropped and added back gets a new one).
//!   Adding or removing *other* tables changes none of it.
//! * **While streaming**, [`spawn_guard`] repeats the reading every
//!   [`GUARD_INTERVAL`]: first `pg_current_wal_lsn()`, then the
//!   fingerprint. When the fingerprint is unchanged, every commit written
//!   before the WAL position read one round *earlier* had a full interval to
//!   become visible to this round's snapshot, so the publication was as
//!   verified for all WAL up to that position. That position is the
//!   guard's verified LSN, and the relay never reports a flush LSN past
//!   it, keepalives included. The cost is confirmation lag of at most two
//!   intervals.
//! * **Any change** of the fingerprint stops the relay at the last proven
//!   position. outboxd cannot tell whether outbox rows were written while
//!   the publication did not carry them, and restarting would stream that
//!   WAL with the same historic catalog, skipping them again: the operator
//!   must decide, and the error says how.
//!
//! What remains unproven: a publication change whose commit takes longer
//! than one interval to become visible after its WAL is written (a commit
//! stalled on a flush for that long).

use std::time::Duration;

use tokio::sync::watch;
use tokio_postgres::Client;

use crate::config::ident::{PublicationName, TableName};
use crate::lsn::Lsn;
use crate::postgres::error::AdminError;

pub use outbox_sdk::schema::column;

/// Why a session that reads messages stopped when who may write them
/// changed.
pub const EMIT_RIGHTS_CHANGED: &str = "the rights to write logical decoding messages changed (a GRANT or REVOKE on pg_logical_emit_message): a role that may call it can write an event outboxd would publish";

/// How often the guard re-reads the catalog.
pub const GUARD_INTERVAL: Duration = Duration::from_millis(250);

/// A publication proven to deliver the table's INSERTs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Verified {
    /// The table's oid: the stream matches its rows by it.
    pub table_oid: u32,
    /// Everything that decides delivery, as text. Two equal fingerprints
    /// mean that no catalog row deciding delivery was written in between:
    /// it holds the rows' `xmin`s, which every change renews. The columns
    /// outboxd reads are not in it: renaming one, or changing `[columns]`,
    /// changes no delivery (a column list's coverage is checked on every
    /// reading instead).
    pub fingerprint: String,
    /// The fingerprint without the schema dependency, as versions before
    /// it wrote theirs (equal to `fingerprint` unless the table is
    /// published through its schema).
    pub unsuffixed_fingerprint: String,
    /// The fingerprint as versions before `[columns]` wrote it (with the
    /// default columns' numbers), to compare a slot register record of
    /// theirs with.
    pub legacy_fingerprint: String,
    /// When the table is published through its schema, the `xmin` of its
    /// dependency on that schema: a fingerprint without it (an older
    /// version's) proves the publication only if this precedes the slot's
    /// `catalog_xmin`, that is, the table was not moved out and back since.
    pub namespace_xmin: Option<u32>,
    /// The `xmin`s of the catalog rows that decide delivery (the
    /// publication, the table's membership, the schema's membership): if
    /// each precedes the slot's `catalog_xmin`, the publication was as it
    /// is now for all WAL the slot still streams (see [`unchanged_since_slot`]).
    pub xmins: Vec<u32>,
    /// The prefix of the logical decoding messages to read (`None`: none).
    pub message_prefix: Option<String>,
    /// When messages are read: the prefix and the `xmin`s of
    /// `pg_logical_emit_message`'s catalog rows, which every GRANT or
    /// REVOKE on it renews. Two equal ones mean that nobody gained or lost
    /// the right to write messages in between (see [`emit_fingerprint`]).
    pub messages_fingerprint: Option<String>,
}

/// Marks fingerprints of this layout; one of another layout (an older
/// outboxd's) is not compared, only the catalog's age can prove then.
const FINGERPRINT_SCHEME: &str = "3:";

/// The layout before `[columns]`: the outbox columns' numbers were part
/// of it. Still compared, through [`Verified::legacy_fingerprint`].
const LEGACY_SCHEME: &str = "2:";

/// Whether a recorded fingerprint can be compared with the ones this
/// version makes.
pub fn comparable(fingerprint: &str) -> bool {
    fingerprint.starts_with(FINGERPRINT_SCHEME) || fingerprint.starts_with(LEGACY_SCHEME)
}

pub use crate::config::postgres::Messages;

/// What the session reads besides rows.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Receiving {
    pub messages: Messages,
    /// The prefix of the messages that are outbox events.
    pub prefix: String,
    /// The server sends messages to pgoutput (PostgreSQL 14+).
    pub server_sends: bool,
    /// An earlier session on this slot read messages (the slot register
    /// says so, or this process did): `auto` goes on reading them even
    /// with `outbox_emit` dropped, since events it wrote may still be in
    /// the WAL the slot has not confirmed.
    pub read_before: bool,
}

impl Default for Receiving {
    fn default() -> Self {
        Receiving {
            messages: Messages::Auto,
            prefix: crate::config::postgres::DEFAULT_MESSAGE_PREFIX.to_owned(),
            server_sends: true,
            read_before: false,
        }
    }
}

impl Receiving {
    /// The prefix of the messages to read, given what the database is set
    /// up to emit (`None`: none are read).
    fn decide(&self, emit: &EmitSetup) -> Option<String> {
        let wanted = match self.messages {
            Messages::On => true,
            Messages::Off => false,
            Messages::Auto => !emit.functions.is_empty() || self.read_before,
        };
        (wanted && self.server_sends).then(|| self.prefix.clone())
    }

    /// Why messages are not read, for the error that names what to change.
    fn off_because(&self) -> &'static str {
        if !self.server_sends && self.messages != Messages::Off {
            "this PostgreSQL sends no logical decoding messages to pgoutput (14 or later does)"
        } else {
            "postgres.messages is false"
        }
    }
}

/// What the catalog says about the publication and the table.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct Reading {
    pub_oid: u32,
    pub_xmin: String,
    /// `publish_via_partition_root` (PostgreSQL 13+).
    via_root: Option<bool>,
    /// The table is partitioned (`relkind = 'p'`), or is itself a partition.
    partitioned: bool,
    is_partition: bool,
    /// The table is listed by `pg_publication_tables` under its own name:
    /// pgoutput describes its rows as this table, not as a partition or
    /// an ancestor.
    published_as_itself: bool,
    membership_xmin: Option<String>,
    schema_membership_xmin: Option<String>,
    inserts: bool,
    publish: Vec<&'static str>,
    all_tables: bool,
    /// `schema.name` of the table's oid now (None: dropped).
    table_now: Option<String>,
    /// The oid the configured name resolves to now.
    name_oid: Option<u32>,
    membership: Option<String>,
    row_filter: Option<String>,
    /// Column numbers the column list publishes (`None`: all).
    column_list: Option<Vec<i16>>,
    schema_membership: Option<String>,
    /// `name=attnum` of the outbox columns the table has.
    columns: Vec<(String, i16)>,
    /// The table and partitions whose rows never reach this WAL: unlogged
    /// ones and foreign tables, as `schema.name (unlogged)`.
    not_in_wal: Option<String>,
    /// What the database is set up to emit (not part of the fingerprint:
    /// checked on every reading instead).
    emit: EmitSetup,
    /// The `xmin` of the table's dependency row on its schema
    /// (`pg_depend`), which `ALTER TABLE … SET SCHEMA` rewrites and nothing
    /// else does (`ADD COLUMN`, a rename or `VACUUM FULL` rewrite only
    /// `pg_class`). It decides delivery only when the table is published
    /// through its schema (`FOR TABLES IN SCHEMA`): a table moved out of
    /// the schema and back has the same name, oid and publication rows,
    /// and PostgreSQL decoded none of its rows while it was away.
    /// Must stay the last field (see [`Reading::fingerprint`]).
    namespace_dep_xmin: Option<String>,
}

/// The table-less outbox in this database: who may write logical decoding
/// messages, and whether `outbox_emit` (migration 0007) is installed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct EmitSetup {
    /// `schema.outbox_emit` functions, and whether each writes the
    /// configured message prefix.
    functions: Vec<(String, bool)>,
    /// PUBLIC may execute a `pg_logical_emit_message` function: any role
    /// can write a message with any prefix.
    public_can_emit: bool,
    /// The `pg_logical_emit_message` signatures, for the REVOKE statements.
    emit_signatures: Vec<String>,
    /// The `xmin`s of their catalog rows: a GRANT or REVOKE renews them.
    emit_xmins: String,
}

/// The messages part of a proof: the prefix read and who may write
/// messages. `pg_logical_emit_message`'s rows are the only catalog rows
/// that decide who can write an event outboxd would publish; dropping or
/// replacing `outbox_emit` does not (its prefix is checked on every
/// reading instead).
fn emit_fingerprint(prefix: &str, emit: &EmitSetup) -> String {
    format!("{FINGERPRINT_SCHEME}{prefix:?} {}", emit.emit_xmins)
}

/// The columns of a reading that say what the database is set up to emit
/// (the outbox table is parameters `$3`.`$4`, the prefix `$6`): the
/// `outbox_emit` functions and whether each writes the prefix, whether
/// PUBLIC may call `pg_logical_emit_message`, and its signatures.
///
/// An `outbox_emit` counts only when it could write an event: its owner is
/// a superuser, owns its schema or the outbox table, or was granted
/// `pg_logical_emit_message` while PUBLIC was not. Any role may create a
/// `pg_temp.outbox_emit`, and on PostgreSQL before 15 one in `public`; such
/// a function cannot write a message, and counting it would let any role
/// stop outboxd (a prefix it does not write, or messages not read).
const EMIT_SETUP: &str = "
    (SELECT string_agg(n.nspname || '.' || f.proname || '=' || (position(quote_literal($6::text) in f.prosrc) > 0)::text, ','
                       ORDER BY n.nspname)
       FROM pg_catalog.pg_proc f JOIN pg_catalog.pg_namespace n ON n.oid = f.pronamespace
      WHERE f.proname = 'outbox_emit'
        AND n.nspname NOT LIKE 'pg\\_temp\\_%' AND n.nspname NOT LIKE 'pg\\_toast\\_temp\\_%'
        AND (EXISTS (SELECT 1 FROM pg_catalog.pg_roles r WHERE r.oid = f.proowner AND r.rolsuper)
             OR f.proowner = n.nspowner
             OR f.proowner = (SELECT c.relowner FROM pg_catalog.pg_class c
                                JOIN pg_catalog.pg_namespace tn ON tn.oid = c.relnamespace
                               WHERE tn.nspname = $3 AND c.relname = $4)
             OR (EXISTS (SELECT 1 FROM pg_catalog.pg_proc e
                          WHERE e.proname = 'pg_logical_emit_message' AND e.pronamespace = 'pg_catalog'::regnamespace
                            AND pg_catalog.has_function_privilege(f.proowner, e.oid, 'EXECUTE'))
                 AND NOT EXISTS (SELECT 1 FROM pg_catalog.pg_proc e
                          WHERE e.proname = 'pg_logical_emit_message' AND e.pronamespace = 'pg_catalog'::regnamespace
                            AND pg_catalog.has_function_privilege('public', e.oid, 'EXECUTE'))))),
    (SELECT coalesce(bool_or(pg_catalog.has_function_privilege('public', f.oid, 'EXECUTE')), false)
       FROM pg_catalog.pg_proc f WHERE f.proname = 'pg_logical_emit_message'
        AND f.pronamespace = 'pg_catalog'::regnamespace),
    (SELECT string_agg(f.oid::regprocedure::text, ';' ORDER BY f.oid)
       FROM pg_catalog.pg_proc f WHERE f.proname = 'pg_logical_emit_message'
        AND f.pronamespace = 'pg_catalog'::regnamespace),
    (SELECT string_agg(f.xmin::text, ',' ORDER BY f.oid)
       FROM pg_catalog.pg_proc f WHERE f.proname = 'pg_logical_emit_message'
        AND f.pronamespace = 'pg_catalog'::regnamespace)";

impl EmitSetup {
    /// Reads the four [`EMIT_SETUP`] columns starting at `first`.
    fn from_row(r: &tokio_postgres::Row, first: usize) -> Self {
        EmitSetup {
            functions: r
                .get::<_, Option<String>>(first)
                .unwrap_or_default()
                .split(',')
                .filter_map(|f| {
                    let (name, writes) = f.split_once('=')?;
                    Some((name.to_owned(), writes == "true"))
                })
                .collect(),
            public_can_emit: r.get(first + 1),
            emit_signatures: r
                .get::<_, Option<String>>(first + 2)
                .unwrap_or_default()
                .split(';')
                .filter(|s| !s.is_empty())
                .map(str::to_owned)
                .collect(),
            emit_xmins: r.get::<_, Option<String>>(first + 3).unwrap_or_default(),
        }
    }
}

/// What `outboxd check` says about the table-less outbox, whether or not
/// the publication exists yet: the prefix of the messages read (`None`:
/// none), or the problem.
pub async fn messages(client: &Client, subject: &Subject) -> Result<Option<String>, AdminError> {
    let receiving = &subject.receiving;
    // $1, $2 and $5 are the reading's; unused here.
    let sql = format!(
        "SELECT {EMIT_SETUP} FROM (SELECT $1::text, $2::text, $3::text, $4::text, $5::text) AS unused"
    );
    let (schema, name) = (subject.table.schema.as_str(), subject.table.name.as_str());
    let row = client
        .query_one(&sql, &[&"", &"", &schema, &name, &"", &receiving.prefix.as_str()])
        .await?;
    let emit = EmitSetup::from_row(&row, 0);
    match emit_problem(&emit, receiving) {
        Some(e) => Err(e),
        None => Ok(receiving.decide(&emit)),
    }
}

impl Reading {
    /// Everything that decides delivery (see [`Verified::fingerprint`]):
    /// [`Reading::unsuffixed`], and the schema dependency's `xmin` when the
    /// table is published through its schema.
    fn fingerprint(&self) -> String {
        match self.schema_dependency() {
            Some(xmin) => format!("{};nsdep={xmin}", self.unsuffixed()),
            None => self.unsuffixed(),
        }
    }

    /// The fingerprint as versions before the schema dependency made it
    /// (byte for byte: a register record of theirs compares equal).
    fn unsuffixed(&self) -> String {
        let mut r = self.clone();
        r.emit = EmitSetup::default();
        r.columns = Vec::new();
        without_namespace_dep(format!("{FINGERPRINT_SCHEME}{r:?}"))
    }

    /// [`Reading::unsuffixed`] as versions before `[columns]` made it.
    fn legacy_fingerprint(&self) -> String {
        let mut r = self.clone();
        r.emit = EmitSetup::default();
        without_namespace_dep(format!("{LEGACY_SCHEME}{r:?}"))
    }

    /// The schema dependency's `xmin`, when only the table's schema
    /// publishes it (not a `FOR TABLE` membership, not `FOR ALL TABLES`).
    fn schema_dependency(&self) -> Option<&str> {
        let through_schema =
            self.schema_membership.is_some() && self.membership.is_none() && !self.all_tables;
        self.namespace_dep_xmin.as_deref().filter(|_| through_schema)
    }

    fn xmins(&self) -> Vec<u32> {
        [
            Some(&self.pub_xmin),
            self.membership_xmin.as_ref(),
            self.schema_membership_xmin.as_ref(),
        ]
        .into_iter()
        .flatten()
        .map(String::as_str)
        .chain(self.schema_dependency())
        .filter_map(|x| x.parse().ok())
        .collect()
    }
}

/// A reading's `Debug` text without its last field, the schema
/// dependency, which fingerprints carry as a suffix instead.
fn without_namespace_dep(debug: String) -> String {
    match debug.rfind(", namespace_dep_xmin: ") {
        Some(at) => format!("{} }}", &debug[..at]),
        None => debug,
    }
}

/// Whether transaction id `a` precedes `b` (PostgreSQL's
/// `TransactionIdPrecedes`: modulo 2^32, special ids before all others).
pub fn xid_precedes(a: u32, b: u32) -> bool {
    const FIRST_NORMAL: u32 = 3;
    if a < FIRST_NORMAL || b < FIRST_NORMAL {
        return a < b;
    }
    (a.wrapping_sub(b) as i32) < 0
}

/// Whether the catalog rows that decide delivery were all written before
/// the WAL the slot still streams: each row's `xmin` precedes the slot's
/// `catalog_xmin`. Every transaction before `catalog_xmin` had ended at a
/// WAL position the slot has confirmed, so the row, still current now,
/// was in place for all WAL from the slot's position on.
pub fn unchanged_since_slot(verified: &Verified, catalog_xmin: Option<u32>) -> bool {
    let Some(horizon) = catalog_xmin else {
        return false;
    };
    !verified.xmins.is_empty() && verified.xmins.iter().all(|x| xid_precedes(*x, horizon))
}

/// The server's version number (`server_version_num`).
pub async fn server_version(client: &Client) -> Result<i32, AdminError> {
    let v: String = client
        .query_one("SELECT current_setting('server_version_num')", &[])
        .await?
        .get(0);
    Ok(v.parse().unwrap_or(0))
}

/// The table's oid, if the name resolves to a table.
async fn table_oid(client: &Client, table: &TableName) -> Result<Option<u32>, AdminError> {
    let row = client
        .query_opt(
            "SELECT c.oid FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
              WHERE n.nspname = $1 AND c.relname = $2 AND c.relkind IN ('r', 'p')",
            &[&table.schema, &table.name],
        )
        .await?;
    Ok(row.map(|r| r.get(0)))
}

/// What a proof is about: the publication, the outbox table, and what the
/// session asks pgoutput for.
#[derive(Clone, Debug)]
pub struct Subject {
    pub publication: PublicationName,
    pub table: TableName,
    pub receiving: Receiving,
    /// The columns outboxd reads when the table has them (`[columns]`):
    /// a column list must publish every one of them that exists. Whether
    /// they exist and fit is `crate::source::outbox`'s to prove.
    pub columns: Vec<String>,
}

impl Subject {
    /// What a session proves for `config` on a server of `server_version`
    /// (`server_version_num`).
    pub fn new(config: &crate::config::Config, v: &crate::config::Validated, server_version: i32) -> Self {
        Subject {
            publication: v.publication.clone(),
            table: v.table.clone(),
            receiving: Receiving {
                messages: config.postgres.messages,
                prefix: config.postgres.message_prefix.clone(),
                server_sends: server_version >= 140_000,
                read_before: false,
            },
            columns: v
                .columns
                .read_columns()
                .into_iter()
                .map(|c| c.as_str().to_owned())
                .collect(),
        }
    }
}

/// One consistent reading (a single statement, so a single snapshot).
async fn read(
    client: &Client,
    version: i32,
    subject: &Subject,
    oid: u32,
) -> Result<Option<Reading>, AdminError> {
    let (publication, table, receiving) = (&subject.publication, &subject.table, &subject.receiving);
    // Row filters, column lists and schema publications exist from 15 on.
    let (filter, list, schema, schema_xmin) = if version >= 150_000 {
        (
            "pg_catalog.pg_get_expr(pr.prqual, pr.prrelid)",
            "pr.prattrs::text",
            "(SELECT pn.oid::text FROM pg_catalog.pg_publication_namespace pn JOIN pg_catalog.pg_class c
                ON c.relnamespace = pn.pnnspid WHERE pn.pnpubid = p.oid AND c.oid = $2)",
            "(SELECT pn.xmin::text FROM pg_catalog.pg_publication_namespace pn JOIN pg_catalog.pg_class c
                ON c.relnamespace = pn.pnnspid WHERE pn.pnpubid = p.oid AND c.oid = $2)",
        )
    } else {
        ("NULL::text", "NULL::text", "NULL::text", "NULL::text")
    };
    let sql = format!(
        "SELECT p.xmin::text, p.pubinsert, p.pubupdate, p.pubdelete, p.pubtruncate, p.puballtables,
                (SELECT n.nspname || '.' || c.relname FROM pg_catalog.pg_class c
                   JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace WHERE c.oid = $2),
                (SELECT c.oid FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
                  WHERE n.nspname = $3 AND c.relname = $4 AND c.relkind IN ('r', 'p')),
                pr.oid::text, {filter}, {list}, {schema},
                (SELECT json_agg(json_build_array(a.attname, a.attnum) ORDER BY a.attname)::text
                   FROM pg_catalog.pg_attribute a
                  WHERE a.attrelid = $2 AND a.attnum > 0 AND NOT a.attisdropped AND a.attname = ANY($5)),
                p.oid, (to_jsonb(p) ->> 'pubviaroot')::boolean,
                (SELECT c.relkind = 'p' FROM pg_catalog.pg_class c WHERE c.oid = $2),
                (SELECT c.relispartition FROM pg_catalog.pg_class c WHERE c.oid = $2),
                EXISTS (SELECT 1 FROM pg_catalog.pg_publication_tables pt
                         WHERE pt.pubname = $1 AND pt.schemaname = $3 AND pt.tablename = $4),
                pr.xmin::text, {schema_xmin},
                {EMIT_SETUP},
                (WITH RECURSIVE tree(oid) AS (
                     SELECT $2::oid
                     UNION ALL
                     SELECT i.inhrelid FROM pg_catalog.pg_inherits i JOIN tree t ON i.inhparent = t.oid
                 )
                 SELECT string_agg(n.nspname || '.' || c.relname || CASE WHEN c.relkind = 'f' THEN ' (foreign)' ELSE ' (unlogged)' END,
                                   ', ' ORDER BY n.nspname, c.relname)
                   FROM tree JOIN pg_catalog.pg_class c ON c.oid = tree.oid
                   JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
                  WHERE (c.oid = $2 OR c.relispartition) AND (c.relpersistence <> 'p' OR c.relkind = 'f')),
                (SELECT d.xmin::text FROM pg_catalog.pg_depend d
                  WHERE d.classid = 'pg_catalog.pg_class'::regclass AND d.objid = $2 AND d.objsubid = 0
                    AND d.refclassid = 'pg_catalog.pg_namespace'::regclass AND d.deptype = 'n')
           FROM pg_catalog.pg_publication p
           LEFT JOIN pg_catalog.pg_publication_rel pr ON pr.prpubid = p.oid AND pr.prrelid = $2
          WHERE p.pubname = $1"
    );
    let names: Vec<&str> = subject.columns.iter().map(String::as_str).collect();
    let prefix = receiving.prefix.as_str();
    let row = client
        .query_opt(
            &sql,
            &[
                &publication.as_str(),
                &oid,
                &table.schema,
                &table.name,
                &names,
                &prefix,
            ],
        )
        .await?;
    let Some(r) = row else {
        return Ok(None);
    };
    let publish: Vec<&'static str> = [(1, "insert"), (2, "update"), (3, "delete"), (4, "truncate")]
        .into_iter()
        .filter(|(i, _)| r.get::<_, bool>(*i))
        .map(|(_, name)| name)
        .collect();
    // [[name, attnum], …]: any column name reads back, commas and all.
    let columns = r
        .get::<_, Option<String>>(12)
        .and_then(|text| serde_json::from_str::<Vec<(String, i16)>>(&text).ok())
        .unwrap_or_default();
    let emit = EmitSetup::from_row(&r, 20);
    let not_in_wal = r.get(24);
    Ok(Some(Reading {
        pub_oid: r.get(13),
        via_root: r.get(14),
        partitioned: r.get::<_, Option<bool>>(15).unwrap_or(false),
        is_partition: r.get::<_, Option<bool>>(16).unwrap_or(false),
        published_as_itself: r.get(17),
        membership_xmin: r.get(18),
        schema_membership_xmin: r.get(19),
        emit,
        pub_xmin: r.get(0),
        inserts: r.get(1),
        publish,
        all_tables: r.get(5),
        table_now: r.get(6),
        name_oid: r.get(7),
        membership: r.get(8),
        row_filter: r.get(9),
        column_list: r
            .get::<_, Option<String>>(10)
            .map(|l| l.split_whitespace().filter_map(|n| n.parse().ok()).collect()),
        schema_membership: r.get(11),
        columns,
        not_in_wal,
        namespace_dep_xmin: r.get(25),
    }))
}

/// Why a reading does not prove delivery, with the statement that fixes it.
fn problem(reading: &Reading, subject: &Subject, oid: u32) -> Option<AdminError> {
    let (publication, table) = (&subject.publication, &subject.table);
    let (p, t) = (publication.quoted().to_string(), table.quoted().to_string());
    let name = publication.as_str().to_owned();
    let re_add =
        format!("BEGIN; ALTER PUBLICATION {p} DROP TABLE {t}; ALTER PUBLICATION {p} ADD TABLE {t}; COMMIT;");
    let found_as = reading.table_now.as_deref();
    if found_as.is_none() {
        return Some(AdminError::NoTable {
            table: table.to_string(),
        });
    }
    if found_as != Some(table.to_string().as_str()) || reading.name_oid != Some(oid) {
        return Some(AdminError::TableReplaced {
            table: table.to_string(),
            now: found_as.unwrap_or_default().to_owned(),
        });
    }
    if !reading.inserts {
        let mut publish = reading.publish.clone();
        publish.insert(0, "insert");
        return Some(AdminError::InsertsNotPublished {
            publication: name,
            publication_sql: p,
            publish: publish.join(", "),
        });
    }
    if !reading.all_tables && reading.membership.is_none() && reading.schema_membership.is_none() {
        return Some(AdminError::TableNotPublished {
            publication: name,
            table: table.to_string(),
            publication_sql: p,
            table_sql: t,
        });
    }
    if let Some(filter) = &reading.row_filter {
        return Some(AdminError::PublicationFilters {
            publication: name,
            what: format!("a row filter WHERE {filter}, so rows it rejects are never sent"),
            fix: re_add,
        });
    }
    if let Some(list) = &reading.column_list {
        let left_out: Vec<&str> = reading
            .columns
            .iter()
            .filter(|(_, num)| !list.contains(num))
            .map(|(n, _)| n.as_str())
            .collect();
        if !left_out.is_empty() {
            return Some(AdminError::PublicationFilters {
                publication: name,
                what: format!("a column list without {}", left_out.join(", ")),
                fix: re_add,
            });
        }
    }
    // Rows of an unlogged table or partition, or of a foreign partition,
    // are never written to this WAL: no publication can send them.
    if let Some(relations) = &reading.not_in_wal {
        return Some(AdminError::NotInWal {
            table: table.to_string(),
            relations: relations.clone(),
        });
    }
    // pgoutput describes a partitioned table's rows as their leaf
    // partitions unless the publication publishes via the partition root,
    // and a partition's rows as its ancestor's when that is published via
    // the root: the stream would not know them as outbox rows.
    if !reading.published_as_itself {
        return Some(if reading.partitioned {
            AdminError::PartitionsNotViaRoot {
                publication: name,
                table: table.to_string(),
                fix: format!("ALTER PUBLICATION {p} SET (publish_via_partition_root = true);"),
            }
        } else {
            AdminError::PublishedAsAncestor {
                publication: name,
                table: table.to_string(),
                partition: reading.is_partition,
            }
        });
    }
    emit_problem(&reading.emit, &subject.receiving)
}

/// Whether the session can receive what the database is set up to emit,
/// and whether only the roles meant to may emit it.
fn emit_problem(emit: &EmitSetup, receiving: &Receiving) -> Option<AdminError> {
    let installed = || {
        emit.functions
            .iter()
            .map(|(f, _)| f.as_str())
            .collect::<Vec<_>>()
            .join(", ")
    };
    match &receiving.decide(emit) {
        None if !emit.functions.is_empty() => Some(AdminError::EmitNotReceived {
            functions: installed(),
            because: receiving.off_because(),
        }),
        None => None,
        Some(prefix) => {
            if let Some((f, _)) = emit.functions.iter().find(|(_, writes_prefix)| !writes_prefix) {
                return Some(AdminError::EmitPrefix {
                    function: f.clone(),
                    prefix: prefix.clone(),
                });
            }
            if emit.public_can_emit {
                let revoke = emit
                    .emit_signatures
                    .iter()
                    .map(|sig| format!("REVOKE EXECUTE ON FUNCTION {sig} FROM PUBLIC;"))
                    .collect::<Vec<_>>()
                    .join(" ");
                return Some(AdminError::EmitOpen { revoke });
            }
            None
        }
    }
}

/// Proves that `publication` delivers every INSERT on `table` with every
/// column outboxd reads; the error names the statement that fixes it.
pub async fn inspect(client: &Client, subject: &Subject) -> Result<Verified, AdminError> {
    let (publication, table) = (&subject.publication, &subject.table);
    let version = server_version(client).await?;
    let oid = table_oid(client, table)
        .await?
        .ok_or_else(|| AdminError::NoTable {
            table: table.to_string(),
        })?;
    let reading = read(client, version, subject, oid)
        .await?
        .ok_or_else(|| AdminError::NoPublication {
            publication: publication.as_str().to_owned(),
            publication_sql: publication.quoted().to_string(),
            table_sql: table.quoted().to_string(),
        })?;
    if let Some(e) = problem(&reading, subject, oid) {
        return Err(e);
    }
    let message_prefix = subject.receiving.decide(&reading.emit);
    Ok(Verified {
        table_oid: oid,
        fingerprint: reading.fingerprint(),
        unsuffixed_fingerprint: reading.unsuffixed(),
        legacy_fingerprint: reading.legacy_fingerprint(),
        namespace_xmin: reading.schema_dependency().and_then(|x| x.parse().ok()),
        xmins: reading.xmins(),
        messages_fingerprint: message_prefix
            .as_deref()
            .map(|p| emit_fingerprint(p, &reading.emit)),
        message_prefix,
    })
}

/// What the guard knows.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum GuardState {
    /// WAL up to here was written while the publication was as verified.
    Verified(Lsn),
    /// The publication or the table changed: stop at the last proven LSN.
    Changed { verified: Lsn, reason: String },
    /// The catalog could not be read; a new session will try again.
    Failed { verified: Lsn, reason: String },
    /// The table-less outbox was installed while messages were not read
    /// (`postgres.messages = "auto"`): a new session reads them, from the
    /// last proven position on.
    Restart { verified: Lsn, reason: String },
}

impl GuardState {
    /// The highest LSN that may be confirmed.
    pub fn verified(&self) -> Lsn {
        match self {
            GuardState::Verified(l)
            | GuardState::Changed { verified: l, .. }
            | GuardState::Failed { verified: l, .. }
            | GuardState::Restart { verified: l, .. } => *l,
        }
    }
}

async fn wal_lsn(client: &Client) -> Result<Lsn, AdminError> {
    let s: String = client
        .query_one("SELECT pg_current_wal_lsn()::text", &[])
        .await?
        .get(0);
    Ok(s.parse().unwrap_or(Lsn::ZERO))
}

/// What is wrong, once the guard saw a change in `first`. A reading that
/// straddles the commit of the change may mix two catalog states
/// (`pg_publication_tables` reads the catalog with a snapshot of its own,
/// newer than the statement's): a table set unlogged looks unpublished
/// while `pg_class` still says logged. So a second reading, after the
/// commit, names the problem when it sees one; the first names it when
/// the second does not (the verdict, a change, stands either way).
async fn described(
    client: &Client,
    version: i32,
    subject: &Subject,
    oid: u32,
    first: &Reading,
) -> Option<AdminError> {
    let again = read(client, version, subject, oid).await.ok().flatten();
    again
        .as_ref()
        .and_then(|r| problem(r, subject, oid))
        .or_else(|| problem(first, subject, oid))
}

/// Starts the guard for a session that begins at `start` with the
/// publication as `baseline` proved it. It owns `client` and ends when the
/// receiver is dropped or after it reports a change or a failure.
pub fn spawn_guard(
    client: Client,
    subject: Subject,
    baseline: Verified,
    start: Lsn,
) -> watch::Receiver<GuardState> {
    let (tx, rx) = watch::channel(GuardState::Verified(start));
    tokio::spawn(async move {
        let mut verified = start;
        let mut previous: Option<Lsn> = None;
        let result: Result<(), AdminError> = async {
            let version = server_version(&client).await?;
            loop {
                let wal = wal_lsn(&client).await?;
                let reading = read(&client, version, &subject, baseline.table_oid).await?;
                // `auto` finds outbox_emit installed: read its messages,
                // in a new session that starts where this one proved.
                if let Some(r) = &reading {
                    let now = subject.receiving.decide(&r.emit);
                    if baseline.message_prefix.is_none()
                        && now.is_some()
                        && emit_problem(&r.emit, &subject.receiving).is_none()
                    {
                        let _ = tx.send(GuardState::Restart {
                            verified,
                            reason: "outbox_emit was installed: reading the table-less outbox's messages from now on"
                                .to_owned(),
                        });
                        return Ok(());
                    }
                }
                // A change of what decides delivery, or a database now set
                // up to emit what this session does not receive. A session
                // that reads messages goes on reading them when outbox_emit
                // is dropped: its events before the drop still arrive.
                // Who may write messages is part of what a session that
                // reads them proved: a GRANT or REVOKE on
                // pg_logical_emit_message stops it.
                let emit_same = |r: &Reading| match (&baseline.messages_fingerprint, subject.receiving.decide(&r.emit)) {
                    (Some(fp), Some(prefix)) => emit_fingerprint(&prefix, &r.emit) == *fp,
                    _ => true,
                };
                let unchanged = reading.as_ref().is_some_and(|r| {
                    let reads_less = baseline.message_prefix.is_some() && subject.receiving.decide(&r.emit).is_none();
                    r.fingerprint() == baseline.fingerprint
                        && problem(r, &subject, baseline.table_oid).is_none()
                        && emit_same(r)
                        && (reads_less || emit_problem(&r.emit, &subject.receiving).is_none())
                });
                if !unchanged {
                    let (publication, table) = (&subject.publication, &subject.table);
                    let reason = match reading {
                        None => format!("publication {} was dropped", publication.as_str()),
                        Some(r) => match described(&client, version, &subject, baseline.table_oid, &r).await {
                            Some(e) => e.to_string(),
                            None if !emit_same(&r) => EMIT_RIGHTS_CHANGED.to_owned(),
                            None => format!("publication {} or table {table} was altered", publication.as_str()),
                        },
                    };
                    let _ = tx.send(GuardState::Changed { verified, reason });
                    return Ok(());
                }
                if let Some(p) = previous {
                    verified = verified.max(p);
                    if tx.send(GuardState::Verified(verified)).is_err() {
                        return Ok(());
                    }
                }
                previous = Some(wal);
                tokio::time::sleep(GUARD_INTERVAL).await;
                if tx.is_closed() {
                    return Ok(());
                }
            }
        }
        .await;
        if let Err(e) = result {
            let _ = tx.send(GuardState::Failed {
                verified,
                reason: e.to_string(),
            });
        }
    });
    rx
}

#[cfg(test)]
mod tests {
    use super::*;

    fn good() -> Reading {
        Reading {
            pub_xmin: "741".into(),
            inserts: true,
            publish: vec!["insert"],
            all_tables: false,
            table_now: Some("public.outbox".into()),
            name_oid: Some(7),
            membership: Some("16405".into()),
            row_filter: None,
            column_list: None,
            schema_membership: None,
            columns: [
                "id",
                "aggregate_type",
                "aggregate_id",
                "type",
                "payload",
                "headers",
                "created_at",
            ]
            .iter()
            .enumerate()
            .map(|(i, c)| ((*c).to_owned(), i as i16 + 1))
            .collect(),
            pub_oid: 16404,
            via_root: Some(true),
            partitioned: false,
            is_partition: false,
            published_as_itself: true,
            membership_xmin: Some("742".into()),
            schema_membership_xmin: None,
            emit: EmitSetup {
                functions: Vec::new(),
                public_can_emit: true,
                emit_signatures: vec!["pg_logical_emit_message(boolean,text,text)".into()],
                emit_xmins: "900".into(),
            },
            not_in_wal: None,
            namespace_dep_xmin: None,
        }
    }

    fn subject(messages: Messages) -> Subject {
        Subject {
            publication: PublicationName::new("outboxd").unwrap(),
            table: TableName::new("public.outbox").unwrap(),
            receiving: Receiving {
                messages,
                ..Receiving::default()
            },
            columns: Vec::new(),
        }
    }

    fn check(r: &Reading) -> Option<String> {
        problem(r, &subject(Messages::Off), 7).map(|e| e.to_string())
    }

    #[test]
    fn rows_that_never_reach_the_wal_are_refused_before_anything_else_is_blamed() {
        // A schema publication leaves an unlogged table out of
        // pg_publication_tables: the error says why, not "an ancestor".
        let unlogged = Reading {
            published_as_itself: false,
            not_in_wal: Some("public.outbox (unlogged)".into()),
            ..good()
        };
        let e = check(&unlogged).unwrap_or_default();
        assert!(
            e.contains("public.outbox (unlogged)") && e.contains("SET LOGGED"),
            "{e}"
        );
        let partition = Reading {
            partitioned: true,
            not_in_wal: Some("public.outbox_2026 (unlogged), public.outbox_remote (foreign)".into()),
            ..good()
        };
        assert!(check(&partition)
            .unwrap_or_default()
            .contains("outbox_remote (foreign)"));
    }

    #[test]
    fn auto_goes_on_reading_messages_a_session_on_the_slot_read_before() {
        let none = EmitSetup::default();
        let auto = subject(Messages::Auto).receiving;
        assert_eq!(auto.decide(&none), None);
        let before = Receiving {
            read_before: true,
            ..auto.clone()
        };
        assert_eq!(before.decide(&none).as_deref(), Some("outbox"));
        let off = Receiving {
            read_before: true,
            ..subject(Messages::Off).receiving
        };
        assert_eq!(off.decide(&none), None, "false is the operator's word");
    }

    #[test]
    fn partitioned_tables_must_be_published_via_the_root() {
        let leaves = Reading {
            partitioned: true,
            via_root: Some(false),
            published_as_itself: false,
            ..good()
        };
        let e = check(&leaves).unwrap_or_default();
        assert!(
            e.contains("ALTER PUBLICATION \"outboxd\" SET (publish_via_partition_root = true);"),
            "{e}"
        );
        let ancestor = Reading {
            is_partition: true,
            published_as_itself: false,
            ..good()
        };
        assert!(check(&ancestor).unwrap_or_default().contains("ancestor"));
        assert_eq!(
            check(&Reading {
                partitioned: true,
                ..good()
            }),
            None,
            "via the root"
        );
    }

    #[test]
    fn emitted_events_need_messages_and_a_closed_emit_function() {
        let installed = |writes_prefix| Reading {
            emit: EmitSetup {
                functions: vec![("public.outbox_emit".into(), writes_prefix)],
                ..good().emit
            },
            ..good()
        };
        // Not receiving messages while outbox_emit is installed.
        let e = check(&installed(true)).unwrap_or_default();
        assert!(
            e.contains("postgres.messages") && e.contains("public.outbox_emit"),
            "{e}"
        );
        let on = subject(Messages::Auto);
        // Receiving, but PUBLIC may write messages.
        let e = problem(&installed(true), &on, 7)
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(
            e.contains("REVOKE EXECUTE ON FUNCTION pg_logical_emit_message(boolean,text,text) FROM PUBLIC;"),
            "{e}"
        );
        // Another prefix than outbox_emit writes.
        let e = problem(&installed(false), &on, 7)
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(e.contains("message_prefix"), "{e}");
        let closed = Reading {
            emit: EmitSetup {
                public_can_emit: false,
                ..installed(true).emit
            },
            ..good()
        };
        assert_eq!(problem(&closed, &on, 7).map(|e| e.to_string()), None);
        // Nothing emits and nothing is received: PUBLIC's default is fine,
        // also with messages on "auto".
        assert_eq!(check(&good()), None);
        assert_eq!(problem(&good(), &on, 7).map(|e| e.to_string()), None);
        // Asked for explicitly, they are read, and PUBLIC must not emit.
        let e = problem(&good(), &subject(Messages::On), 7)
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(e.contains("REVOKE"), "{e}");
        // A server that sends none: outbox_emit installed is refused.
        let old_server = Subject {
            receiving: Receiving {
                server_sends: false,
                ..Receiving::default()
            },
            ..subject(Messages::Auto)
        };
        let e = problem(&installed(true), &old_server, 7)
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(e.contains("14 or later"), "{e}");
    }

    #[test]
    fn xids_compare_modulo_two_to_the_thirty_second() {
        assert!(xid_precedes(741, 742));
        assert!(!xid_precedes(742, 741));
        assert!(xid_precedes(u32::MAX - 5, 10), "across the wraparound");
        assert!(xid_precedes(2, 741), "frozen precedes all");
        let v = Verified {
            table_oid: 7,
            fingerprint: String::new(),
            unsuffixed_fingerprint: String::new(),
            legacy_fingerprint: String::new(),
            namespace_xmin: None,
            xmins: vec![741, 742],
            message_prefix: None,
            messages_fingerprint: None,
        };
        assert!(unchanged_since_slot(&v, Some(800)));
        assert!(!unchanged_since_slot(&v, Some(742)), "742 is not before 742");
        assert!(!unchanged_since_slot(&v, None));
    }

    #[test]
    fn every_way_to_lose_inserts_names_its_fix() {
        assert_eq!(check(&good()), None);
        let cases: Vec<(Reading, &str)> = vec![
            (
                Reading {
                    inserts: false,
                    publish: vec!["update"],
                    ..good()
                },
                "SET (publish = 'insert, update')",
            ),
            (
                Reading {
                    membership: None,
                    ..good()
                },
                "ADD TABLE \"public\".\"outbox\"",
            ),
            (
                Reading {
                    row_filter: Some("(aggregate_type = 'x')".into()),
                    ..good()
                },
                "DROP TABLE",
            ),
            (
                Reading {
                    column_list: Some(vec![1, 2, 3, 4, 5]),
                    ..good()
                },
                "without headers, created_at",
            ),
            (
                Reading {
                    table_now: Some("public.outbox_old".into()),
                    ..good()
                },
                "outbox_old",
            ),
            (
                Reading {
                    table_now: None,
                    ..good()
                },
                "does not exist",
            ),
            (
                Reading {
                    name_oid: Some(8),
                    ..good()
                },
                "replaced",
            ),
        ];
        for (r, want) in cases {
            let got = check(&r).unwrap_or_default();
            assert!(got.contains(want), "{want:?} not in {got:?}");
        }
        // Membership through FOR ALL TABLES or the schema is membership.
        assert_eq!(
            check(&Reading {
                membership: None,
                all_tables: true,
                ..good()
            }),
            None
        );
        assert_eq!(
            check(&Reading {
                membership: None,
                schema_membership: Some("1".into()),
                ..good()
            }),
            None
        );
        // A column list that has every column is fine.
        assert_eq!(
            check(&Reading {
                column_list: Some(vec![1, 2, 3, 4, 5, 6, 7]),
                ..good()
            }),
            None
        );
    }

    #[test]
    fn the_fingerprint_sees_what_decides_delivery() {
        let base = good().fingerprint();
        for changed in [
            Reading {
                pub_xmin: "743".into(),
                ..good()
            },
            Reading {
                membership: Some("16407".into()),
                ..good()
            },
            Reading {
                membership_xmin: Some("750".into()),
                ..good()
            },
            Reading {
                pub_oid: 16500,
                ..good()
            },
            Reading {
                via_root: Some(false),
                ..good()
            },
        ] {
            assert_ne!(changed.fingerprint(), base);
        }
        assert_eq!(good().fingerprint(), base);
        // The columns outboxd reads (a rename, a changed [columns]) decide
        // no delivery; the layout before [columns] held them.
        let renamed = Reading {
            columns: vec![("id".into(), 9)],
            ..good()
        };
        assert_eq!(renamed.fingerprint(), base);
        assert_ne!(renamed.legacy_fingerprint(), good().legacy_fingerprint());
        assert!(comparable(&base) && comparable(&good().legacy_fingerprint()) && !comparable("1:x"));
        // What the database may emit is checked on every reading, not
        // compared: installing outbox_emit is no change of the publication.
        let emitting = Reading {
            emit: EmitSetup {
                functions: vec![("public.outbox_emit".into(), true)],
                ..good().emit
            },
            ..good()
        };
        assert_eq!(emitting.fingerprint(), base);
        assert_eq!(good().xmins(), vec![741, 742]);
    }

    #[test]
    fn the_schema_dependency_counts_only_for_a_table_published_through_its_schema() {
        let with = |r: Reading| Reading {
            namespace_dep_xmin: Some("760".into()),
            ..r
        };
        // A FOR TABLE member: the fingerprint is the one versions before
        // the dependency wrote, byte for byte.
        let member = with(good());
        assert_eq!(member.fingerprint(), good().fingerprint());
        assert!(!member.fingerprint().contains("namespace_dep") && member.fingerprint().ends_with(" } }"));
        assert_eq!(member.xmins(), vec![741, 742]);
        let all = with(Reading {
            all_tables: true,
            membership: None,
            ..good()
        });
        assert_eq!(all.fingerprint(), all.unsuffixed());
        // Published through its schema: a move out and back is a change.
        let schema = |xmin: &str| Reading {
            membership: None,
            membership_xmin: None,
            schema_membership: Some("16500".into()),
            schema_membership_xmin: Some("745".into()),
            namespace_dep_xmin: Some(xmin.into()),
            ..good()
        };
        assert_eq!(
            schema("760").fingerprint(),
            format!("{};nsdep=760", schema("760").unsuffixed())
        );
        assert_ne!(schema("760").fingerprint(), schema("761").fingerprint());
        assert_eq!(schema("760").unsuffixed(), schema("761").unsuffixed());
        assert_eq!(schema("760").xmins(), vec![741, 745, 760]);
    }
}
