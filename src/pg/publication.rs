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

use crate::lsn::Lsn;
use crate::pg::admin::AdminError;
use crate::pg::ident::{PublicationName, TableName};

pub use outbox_sdk::schema::column;

/// How often the guard re-reads the catalog.
pub const GUARD_INTERVAL: Duration = Duration::from_millis(250);

/// Columns outboxd reads when the table has them; a column list must
/// publish every one of them that exists.
const OUTBOX_COLUMNS: [&str; 7] = [
    column::ID,
    column::AGGREGATE_TYPE,
    column::AGGREGATE_ID,
    column::TYPE,
    column::PAYLOAD,
    column::HEADERS,
    column::CREATED_AT,
];

/// Columns the table must have.
const REQUIRED_COLUMNS: [&str; 5] = [
    column::ID,
    column::AGGREGATE_TYPE,
    column::AGGREGATE_ID,
    column::TYPE,
    column::PAYLOAD,
];

/// A publication proven to deliver the table's INSERTs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Verified {
    /// The table's oid: the stream matches its rows by it.
    pub table_oid: u32,
    /// Everything that decides delivery, as text.
    pub fingerprint: String,
}

/// What the catalog says about the publication and the table.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct Reading {
    pub_xmin: String,
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
}

impl Reading {
    fn fingerprint(&self) -> String {
        format!("{self:?}")
    }
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

/// One consistent reading (a single statement, so a single snapshot).
async fn read(
    client: &Client,
    version: i32,
    publication: &PublicationName,
    table: &TableName,
    oid: u32,
) -> Result<Option<Reading>, AdminError> {
    // Row filters, column lists and schema publications exist from 15 on.
    let (filter, list, schema) = if version >= 150_000 {
        (
            "pg_catalog.pg_get_expr(pr.prqual, pr.prrelid)",
            "pr.prattrs::text",
            "(SELECT pn.oid::text FROM pg_catalog.pg_publication_namespace pn JOIN pg_catalog.pg_class c
                ON c.relnamespace = pn.pnnspid WHERE pn.pnpubid = p.oid AND c.oid = $2)",
        )
    } else {
        ("NULL::text", "NULL::text", "NULL::text")
    };
    let sql = format!(
        "SELECT p.xmin::text, p.pubinsert, p.pubupdate, p.pubdelete, p.pubtruncate, p.puballtables,
                (SELECT n.nspname || '.' || c.relname FROM pg_catalog.pg_class c
                   JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace WHERE c.oid = $2),
                (SELECT c.oid FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
                  WHERE n.nspname = $3 AND c.relname = $4 AND c.relkind IN ('r', 'p')),
                pr.oid::text, {filter}, {list}, {schema},
                (SELECT string_agg(a.attname || '=' || a.attnum, ',' ORDER BY a.attname)
                   FROM pg_catalog.pg_attribute a
                  WHERE a.attrelid = $2 AND a.attnum > 0 AND NOT a.attisdropped AND a.attname = ANY($5))
           FROM pg_catalog.pg_publication p
           LEFT JOIN pg_catalog.pg_publication_rel pr ON pr.prpubid = p.oid AND pr.prrelid = $2
          WHERE p.pubname = $1"
    );
    let names: Vec<&str> = OUTBOX_COLUMNS.to_vec();
    let row = client
        .query_opt(
            &sql,
            &[&publication.as_str(), &oid, &table.schema, &table.name, &names],
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
    let columns = r
        .get::<_, Option<String>>(12)
        .unwrap_or_default()
        .split(',')
        .filter_map(|kv| {
            let (k, v) = kv.split_once('=')?;
            Some((k.to_owned(), v.parse().ok()?))
        })
        .collect();
    Ok(Some(Reading {
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
    }))
}

/// Why a reading does not prove delivery, with the statement that fixes it.
fn problem(
    reading: &Reading,
    publication: &PublicationName,
    table: &TableName,
    oid: u32,
) -> Option<AdminError> {
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
    if let Some(missing) = REQUIRED_COLUMNS
        .iter()
        .find(|c| !reading.columns.iter().any(|(n, _)| n == *c))
    {
        return Some(AdminError::NoColumn {
            table: table.to_string(),
            column: missing,
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
    None
}

/// Proves that `publication` delivers every INSERT on `table` with every
/// column outboxd reads; the error names the statement that fixes it.
pub async fn inspect(
    client: &Client,
    publication: &PublicationName,
    table: &TableName,
) -> Result<Verified, AdminError> {
    let version = server_version(client).await?;
    let oid = table_oid(client, table)
        .await?
        .ok_or_else(|| AdminError::NoTable {
            table: table.to_string(),
        })?;
    let reading = read(client, version, publication, table, oid)
        .await?
        .ok_or_else(|| AdminError::NoPublication {
            publication: publication.as_str().to_owned(),
            publication_sql: publication.quoted().to_string(),
            table_sql: table.quoted().to_string(),
        })?;
    if let Some(e) = problem(&reading, publication, table, oid) {
        return Err(e);
    }
    Ok(Verified {
        table_oid: oid,
        fingerprint: reading.fingerprint(),
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
}

impl GuardState {
    /// The highest LSN that may be confirmed.
    pub fn verified(&self) -> Lsn {
        match self {
            GuardState::Verified(l)
            | GuardState::Changed { verified: l, .. }
            | GuardState::Failed { verified: l, .. } => *l,
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

/// Starts the guard for a session that begins at `start` with the
/// publication as `baseline` proved it. It owns `client` and ends when the
/// receiver is dropped or after it reports a change or a failure.
pub fn spawn_guard(
    client: Client,
    publication: PublicationName,
    table: TableName,
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
                let reading = read(&client, version, &publication, &table, baseline.table_oid).await?;
                let unchanged = reading
                    .as_ref()
                    .is_some_and(|r| r.fingerprint() == baseline.fingerprint);
                if !unchanged {
                    let reason = match reading {
                        None => format!("publication {} was dropped", publication.as_str()),
                        Some(r) => problem(&r, &publication, &table, baseline.table_oid)
                            .map(|e| e.to_string())
                            .unwrap_or_else(|| {
                                format!(
                                    "publication {} or table {table} was altered",
                                    publication.as_str()
                                )
                            }),
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
            columns: OUTBOX_COLUMNS
                .iter()
                .enumerate()
                .map(|(i, c)| ((*c).to_owned(), i as i16 + 1))
                .collect(),
        }
    }

    fn check(r: &Reading) -> Option<String> {
        let p = PublicationName::new("outboxd").unwrap();
        let t = TableName::new("public.outbox").unwrap();
        problem(r, &p, &t, 7).map(|e| e.to_string())
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
            (
                Reading {
                    columns: vec![("id".into(), 1)],
                    ..good()
                },
                "aggregate_type",
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
                columns: vec![("id".into(), 9)],
                ..good()
            },
        ] {
            assert_ne!(changed.fingerprint(), base);
        }
        assert_eq!(good().fingerprint(), base);
    }
}
