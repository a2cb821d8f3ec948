//! The replication client and pgoutput decoder against the real server.

use std::time::Duration;

use outboxd::config::conninfo::PgConnectConfig;
use outboxd::config::ident::{PublicationName, SlotName, TableName};
use outboxd::postgres::admin::{self, AdminError, SlotState};
use outboxd::postgres::connection::{ReplicationConnection, StartOptions};
use outboxd::postgres::error::PgError;
use outboxd::source::stream::{OutboxStream, StreamEvent};
use outboxd::Lsn;
use serde_json::json;
use uuid::Uuid;

use crate::harness::postgres::{self, CLEARTEXT_USER, MD5_USER, SCRAM_USER, TRUST_USER};
use crate::harness::{server, wait_for, TestDb};

/// What the session proves: `publication` and `table`, with the table-less
/// outbox's messages (migration 0007 is applied to every test database).
fn subject(publication: &PublicationName, table: &TableName) -> outboxd::postgres::publication::Subject {
    outboxd::postgres::publication::Subject {
        publication: publication.clone(),
        table: table.clone(),
        receiving: Default::default(),
        columns: outboxd::config::columns::ColumnMap::default()
            .read_columns()
            .into_iter()
            .map(|c| c.as_str().to_owned())
            .collect(),
    }
}

fn cfg(url: &str) -> PgConnectConfig {
    url.parse().expect("test url parses")
}

/// Ensures publication and slot with our code, then starts streaming.
async fn open_stream(db: &TestDb, publication: &str, slot: &str) -> (OutboxStream, tokio_postgres::Client) {
    let cfg = cfg(&db.superuser_url());
    let client = admin::connect(&cfg).await.expect("admin connection");
    let publication = PublicationName::new(publication).unwrap();
    let slot = SlotName::new(slot).unwrap();
    let table = TableName::new("public.outbox").unwrap();
    let verified = admin::ensure_publication(&client, &subject(&publication, &table))
        .await
        .expect("publication");
    let mut repl = ReplicationConnection::connect(&cfg)
        .await
        .expect("replication connection");
    let state = admin::ensure_slot(&client, &mut repl, &slot, &db.name, None)
        .await
        .expect("slot");
    assert!(matches!(state, SlotState::Created { .. }), "{state:?}");
    let stream = repl
        .start_replication(&StartOptions {
            slot,
            publication,
            start_lsn: Lsn::ZERO,
            messages: true,
        })
        .await
        .expect("START_REPLICATION");
    (
        OutboxStream::new(stream, table, verified.table_oid, Default::default(), Vec::new()),
        client,
    )
}

async fn next(stream: &mut OutboxStream) -> StreamEvent {
    tokio::time::timeout(Duration::from_secs(30), stream.next_event())
        .await
        .expect("an event within 30s")
        .expect("stream ok")
        .expect("stream open")
}

/// Skips keepalives.
async fn next_data(stream: &mut OutboxStream) -> StreamEvent {
    loop {
        match next(stream).await {
            StreamEvent::Keepalive { .. } => continue,
            e => return e,
        }
    }
}

#[derive(Debug)]
struct Written {
    id: Uuid,
    aggregate_type: String,
    aggregate_id: String,
    event_type: String,
    payload: serde_json::Value,
    headers: serde_json::Value,
}

/// Deterministic text that compresses badly, so PostgreSQL stores it out of line.
fn incompressible(len: usize, seed: u64) -> String {
    let mut x = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            char::from(b'a' + (x % 26) as u8)
        })
        .collect()
}

#[tokio::test]
async fn thousand_rows_in_hundred_transactions_decode_exactly() {
    let db = TestDb::new("repl_e2e").await;
    let (mut stream, _admin) = open_stream(&db, "outboxd", "e2e_slot").await;
    let client = db.client().await;

    let mut expected: Vec<(Vec<Written>, Lsn, Lsn)> = Vec::new();
    for t in 0..100u64 {
        let mut rows = Vec::new();
        for r in 0..10u64 {
            let n = t * 10 + r;
            let mut payload = json!({
                "orderId": format!("ord-{n}"),
                "customer": {"name": "김철수 Ünïcødé 🚀", "tier": {"level": n % 3, "since": "2024-01-01"}},
                "lines": [{"sku": "A-1", "qty": 2, "price": 12.5}, {"sku": "B-2", "qty": 1, "price": 3}],
                "note": null,
            });
            if n == 500 {
                payload["blob"] = json!(incompressible(20_000, n));
            }
            rows.push(Written {
                id: Uuid::now_v7(),
                aggregate_type: ["Order", "Payment", "Shipment"][(n % 3) as usize].to_owned(),
                aggregate_id: format!("agg-{}", n % 17),
                event_type: format!("ordering.event-{}.v1", n % 5),
                payload,
                headers: json!({"correlationId": format!("corr-{t}"), "attempt": r}),
            });
        }
        client.batch_execute("BEGIN").await.unwrap();
        for w in &rows {
            client
                .execute(
                    "INSERT INTO outbox (id, aggregate_type, aggregate_id, type, payload, headers)
                     VALUES ($1, $2, $3, $4, $5, $6)",
                    &[
                        &w.id,
                        &w.aggregate_type,
                        &w.aggregate_id,
                        &w.event_type,
                        &w.payload,
                        &w.headers,
                    ],
                )
                .await
                .unwrap();
        }
        let before: String = client
            .query_one("SELECT pg_current_wal_insert_lsn()::text", &[])
            .await
            .unwrap()
            .get(0);
        client.batch_execute("COMMIT").await.unwrap();
        let after: String = client
            .query_one("SELECT pg_current_wal_insert_lsn()::text", &[])
            .await
            .unwrap()
            .get(0);
        expected.push((rows, before.parse().unwrap(), after.parse().unwrap()));
    }
    let toasted: i64 = client
        .query_one(
            "SELECT count(*) FROM outbox WHERE pg_column_size(payload) > 8192 OR octet_length(payload::text) > 8192",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(toasted, 1, "one payload is over 8 KB");
    let created: std::collections::HashMap<Uuid, chrono::DateTime<chrono::Utc>> = client
        .query("SELECT id, created_at FROM outbox", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();

    let mut last_end = Lsn::ZERO;
    for (t, (rows, before, after)) in expected.iter().enumerate() {
        let StreamEvent::Begin { final_lsn, .. } = next_data(&mut stream).await else {
            panic!("transaction {t} does not start with Begin")
        };
        for (r, w) in rows.iter().enumerate() {
            let StreamEvent::Insert { row, lsn } = next_data(&mut stream).await else {
                panic!("transaction {t} row {r}: expected an insert")
            };
            assert!(lsn < final_lsn, "insert precedes its commit record");
            assert_eq!(row.id, w.id.to_string());
            assert_eq!(row.aggregate_type, w.aggregate_type);
            assert_eq!(row.aggregate_id, w.aggregate_id);
            assert_eq!(row.event_type, w.event_type);
            let payload: serde_json::Value = serde_json::from_slice(row.payload.as_bytes()).unwrap();
            assert_eq!(payload, w.payload, "payload of {t}/{r}");
            let headers: serde_json::Value = serde_json::from_str(&row.headers).unwrap();
            assert_eq!(headers, w.headers);
            assert_eq!(
                row.created_at,
                outboxd::source::outbox::CreatedAt::At(created[&w.id]),
                "created_at of {t}/{r}"
            );
        }
        let StreamEvent::Commit {
            commit_lsn, end_lsn, ..
        } = next_data(&mut stream).await
        else {
            panic!("transaction {t} does not end with Commit")
        };
        assert_eq!(commit_lsn, final_lsn, "Begin announces the commit LSN");
        assert!(
            *before <= commit_lsn && end_lsn <= *after,
            "commit {commit_lsn}..{end_lsn} within {before}..{after}"
        );
        assert!(end_lsn > commit_lsn);
        assert!(commit_lsn > last_end, "commit order");
        last_end = end_lsn;
    }

    // The status update encoder works against the server: the slot moves.
    stream.send_status(last_end, last_end, false).await.unwrap();
    let admin = db.client().await;
    wait_for(
        "confirmed_flush_lsn to reach the last commit",
        Duration::from_secs(20),
        || async {
            let row = admin
                .query_one(
                    "SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = 'e2e_slot'",
                    &[],
                )
                .await
                .unwrap();
            let confirmed: Lsn = row.get::<_, String>(0).parse().unwrap();
            (confirmed >= last_end).then_some(())
        },
    )
    .await;
    stream.stop(Duration::from_secs(5)).await.expect("clean stop");
    wait_for("the slot to become inactive", Duration::from_secs(10), || async {
        let active: bool = admin
            .query_one(
                "SELECT active FROM pg_replication_slots WHERE slot_name = 'e2e_slot'",
                &[],
            )
            .await
            .unwrap()
            .get(0);
        (!active).then_some(())
    })
    .await;
}

#[tokio::test]
async fn other_tables_updates_and_deletes_do_not_surface() {
    let db = TestDb::new("repl_filter").await;
    let client = db.client().await;
    // A wide publication, as a user might already have: all operations and
    // a second table. Only outbox INSERTs may come out of the stream.
    client
        .batch_execute(
            "CREATE TABLE parcels (id int PRIMARY KEY, status text);
             ALTER TABLE outbox REPLICA IDENTITY FULL;
             CREATE PUBLICATION wide FOR TABLE outbox, parcels;",
        )
        .await
        .unwrap();
    let (mut stream, _admin) = open_stream(&db, "wide", "filter_slot").await;
    let keep = Uuid::now_v7();
    let gone = Uuid::now_v7();
    client
        .batch_execute(&format!(
            "BEGIN;
             INSERT INTO parcels VALUES (1, 'new');
             INSERT INTO outbox (id, aggregate_type, aggregate_id, type, payload) VALUES ('{keep}', 'Order', '1', 't', '{{}}');
             INSERT INTO outbox (id, aggregate_type, aggregate_id, type, payload) VALUES ('{gone}', 'Order', '1', 't', '{{}}');
             COMMIT;"
        ))
        .await
        .unwrap();
    // Each statement is its own transaction.
    for sql in [
        format!("UPDATE outbox SET published_at = now() WHERE id = '{keep}'"),
        format!("DELETE FROM outbox WHERE id = '{gone}'"),
        "UPDATE parcels SET status = 'paid'".to_owned(),
        "TRUNCATE parcels".to_owned(),
        "SELECT pg_logical_emit_message(true, 'test', 'hello')".to_owned(),
        "INSERT INTO parcels VALUES (2, 'new')".to_owned(),
    ] {
        client.batch_execute(&sql).await.unwrap();
    }
    let last = Uuid::now_v7();
    client
        .batch_execute(&format!(
            "INSERT INTO outbox (id, aggregate_type, aggregate_id, type, payload) VALUES ('{last}', 'Order', '2', 't', '[1, 2]')"
        ))
        .await
        .unwrap();

    let mut inserts = Vec::new();
    let mut commits = 0;
    while inserts.len() < 3 {
        match next_data(&mut stream).await {
            StreamEvent::Insert { row, .. } => inserts.push(row.id),
            StreamEvent::Commit { .. } => commits += 1,
            _ => {}
        }
    }
    assert_eq!(
        inserts,
        vec![keep.to_string(), gone.to_string(), last.to_string()],
        "only outbox inserts surface"
    );
    // Every transaction with published changes still frames Begin/Commit.
    assert!(commits >= 6, "saw {commits} commits");
}

async fn identify(url: &str) -> Result<(), PgError> {
    let mut conn = ReplicationConnection::connect(&cfg(url)).await?;
    let id = conn.identify_system().await?;
    assert!(id.xlogpos > Lsn::ZERO && id.timeline >= 1 && !id.system_id.is_empty());
    Ok(())
}

#[tokio::test]
async fn authenticates_with_trust_cleartext_md5_and_scram() {
    let db = TestDb::new("repl_auth").await;
    identify(&db.url(TRUST_USER, None)).await.expect("trust");
    identify(&db.url(CLEARTEXT_USER.0, Some(CLEARTEXT_USER.1)))
        .await
        .expect("cleartext");
    identify(&db.url(MD5_USER.0, Some(MD5_USER.1)))
        .await
        .expect("md5");
    identify(&db.url(SCRAM_USER.0, Some(SCRAM_USER.1)))
        .await
        .expect("scram-sha-256");

    for user in [CLEARTEXT_USER.0, MD5_USER.0, SCRAM_USER.0] {
        let err = identify(&db.url(user, Some("wrong"))).await.unwrap_err();
        assert!(err.is_auth_failure(), "{user}: {err}");
        assert_eq!(err.sqlstate(), Some("28P01"));
        let text = err.to_string();
        assert!(text.contains("password authentication failed"), "{user}: {text}");
        assert!(!err.is_transient());
    }
    let err = identify(&db.url(SCRAM_USER.0, None)).await.unwrap_err();
    assert!(
        matches!(
            err,
            PgError::PasswordRequired {
                method: "scram-sha-256"
            }
        ),
        "{err}"
    );
    assert!(err.to_string().contains("has none"), "{err}");
}

#[tokio::test]
async fn unix_socket_and_unreachable_server() {
    let db = TestDb::new("repl_unix").await;
    identify(&server().socket_url(&db.name))
        .await
        .expect("unix socket");
    let port = postgres::free_port();
    let err = identify(&format!("postgres://postgres@127.0.0.1:{port}/x?sslmode=disable"))
        .await
        .unwrap_err();
    assert!(err.is_transient());
    assert!(
        err.to_string()
            .contains("cannot connect to PostgreSQL at 127.0.0.1"),
        "{err}"
    );
}

async fn ssl_in_use(url: &str) -> Result<bool, PgError> {
    let mut conn = ReplicationConnection::connect(&cfg(url)).await?;
    let r = conn
        .simple_query("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()")
        .await?;
    Ok(r.rows[0][0].as_deref() == Some("t"))
}

#[tokio::test]
async fn tls_follows_sslmode() {
    let db = TestDb::new("repl_tls").await;
    let s = server();
    let base = |host: &str, mode: &str, ca: Option<&std::path::Path>| {
        let mut u = format!("postgres://postgres@{host}:{}/{}?sslmode={mode}", s.port, db.name);
        if let Some(ca) = ca {
            u.push_str(&format!("&sslrootcert={}", ca.display()));
        }
        u
    };
    assert!(!ssl_in_use(&base("127.0.0.1", "disable", None)).await.unwrap());
    assert!(ssl_in_use(&base("127.0.0.1", "prefer", None)).await.unwrap());
    assert!(ssl_in_use(&base("127.0.0.1", "require", None)).await.unwrap());
    assert!(ssl_in_use(&base("localhost", "verify-full", Some(&s.ca_cert)))
        .await
        .unwrap());
    // The certificate names localhost only: verify-ca accepts 127.0.0.1,
    // verify-full does not.
    assert!(ssl_in_use(&base("127.0.0.1", "verify-ca", Some(&s.ca_cert)))
        .await
        .unwrap());
    let err = ssl_in_use(&base("127.0.0.1", "verify-full", Some(&s.ca_cert)))
        .await
        .unwrap_err();
    assert!(matches!(err, PgError::TlsHandshake(_)), "{err}");
    let err = ssl_in_use(&base("localhost", "verify-ca", Some(&s.other_ca_cert)))
        .await
        .unwrap_err();
    assert!(matches!(err, PgError::TlsHandshake(_)), "{err}");
    let err = ssl_in_use(&base(
        "localhost",
        "verify-full",
        Some(std::path::Path::new("/nonexistent/ca.pem")),
    ))
    .await
    .unwrap_err();
    assert!(err.to_string().contains("sslrootcert"), "{err}");
    // The admin connection follows the same rules.
    admin::connect(&cfg(&base("localhost", "verify-full", Some(&s.ca_cert))))
        .await
        .expect("admin over verify-full");
}

#[tokio::test]
async fn publication_problems_name_the_fix() {
    let db = TestDb::new("repl_pub").await;
    let client = admin::connect(&cfg(&db.superuser_url())).await.unwrap();
    let table = TableName::new("public.outbox").unwrap();
    let p = PublicationName::new("outboxd").unwrap();
    let first = admin::ensure_publication(&client, &subject(&p, &table))
        .await
        .unwrap();
    assert_eq!(
        admin::ensure_publication(&client, &subject(&p, &table))
            .await
            .unwrap(),
        first,
        "a second call finds the same proven publication"
    );
    let published: i64 = client
        .query_one(
            "SELECT count(*) FROM pg_publication p JOIN pg_publication_tables t USING (pubname)
              WHERE p.pubname = 'outboxd' AND t.tablename = 'outbox' AND p.pubinsert AND NOT p.pubupdate AND NOT p.pubdelete",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(published, 1, "FOR TABLE outbox WITH (publish = 'insert')");

    client
        .batch_execute("CREATE TABLE other (id int); CREATE PUBLICATION elsewhere FOR TABLE other")
        .await
        .unwrap();
    let err = admin::ensure_publication(
        &client,
        &subject(&PublicationName::new("elsewhere").unwrap(), &table),
    )
    .await
    .unwrap_err();
    assert!(matches!(err, AdminError::TableNotPublished { .. }));
    assert!(
        err.to_string()
            .contains(r#"ALTER PUBLICATION "elsewhere" ADD TABLE "public"."outbox";"#),
        "{err}"
    );
    client
        .batch_execute("CREATE PUBLICATION no_inserts FOR TABLE outbox WITH (publish = 'update')")
        .await
        .unwrap();
    let err = admin::ensure_publication(
        &client,
        &subject(&PublicationName::new("no_inserts").unwrap(), &table),
    )
    .await
    .unwrap_err();
    assert!(
        err.to_string().contains("SET (publish = 'insert, update')"),
        "{err}"
    );
    let err = admin::ensure_publication(&client, &subject(&p, &TableName::new("public.missing").unwrap()))
        .await
        .unwrap_err();
    assert!(matches!(err, AdminError::NoTable { .. }), "{err}");
    // A hostile name never becomes a publication.
    assert!(PublicationName::new("x\"; drop table outbox; --").is_err());
    let tables: i64 = client
        .query_one("SELECT count(*) FROM pg_tables WHERE tablename = 'outbox'", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(tables, 1);
}

#[tokio::test]
async fn server_errors_keep_sqlstate_and_slots_are_checked() {
    let db = TestDb::new("repl_err").await;
    let url = db.superuser_url();
    let mut conn = ReplicationConnection::connect(&cfg(&url)).await.unwrap();
    let err = conn.simple_query("SELEC 1").await.unwrap_err();
    assert_eq!(err.sqlstate(), Some("42601"), "{err}");
    // The connection is still usable after an error.
    conn.identify_system().await.unwrap();
    let err = conn
        .start_replication(&StartOptions {
            slot: SlotName::new("no_such_slot").unwrap(),
            publication: PublicationName::new("outboxd").unwrap(),
            start_lsn: Lsn::ZERO,
            messages: false,
        })
        .await
        .unwrap_err();
    assert_eq!(err.sqlstate(), Some("42704"), "{err}");
    assert!(err.to_string().contains("no_such_slot"), "{err}");

    // A slot with another plugin is refused with the fix.
    let client = admin::connect(&cfg(&url)).await.unwrap();
    client
        .batch_execute("SELECT pg_create_logical_replication_slot('td_slot', 'test_decoding')")
        .await
        .unwrap();
    let mut repl = ReplicationConnection::connect(&cfg(&url)).await.unwrap();
    let err = admin::ensure_slot(
        &client,
        &mut repl,
        &SlotName::new("td_slot").unwrap(),
        &db.name,
        None,
    )
    .await
    .unwrap_err();
    assert!(
        err.to_string().contains("test_decoding") && err.to_string().contains("pg_drop_replication_slot"),
        "{err}"
    );
    // An existing pgoutput slot is reused, not recreated.
    let slot = SlotName::new("reuse_slot").unwrap();
    assert!(matches!(
        admin::ensure_slot(&client, &mut repl, &slot, &db.name, None)
            .await
            .unwrap(),
        SlotState::Created { .. }
    ));
    assert!(matches!(
        admin::ensure_slot(&client, &mut repl, &slot, &db.name, None)
            .await
            .unwrap(),
        SlotState::Existing(_)
    ));
}
