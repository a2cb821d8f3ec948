//! Class 6: emitted messages that the configuration would not receive.
//! Class 7: who may write a table-less outbox event.

use std::collections::HashSet;
use std::time::Duration;

use uuid::Uuid;

use crate::hardening::{daemon_config, exits, ids, log_text, outboxd_async, prefix, records, wait_ids};
use crate::harness::broker::broker;
use crate::harness::{wait_for, TestDb};
use crate::relay::{confirmed_flush, current_lsn, Daemon};

/// Grants or revokes PUBLIC's EXECUTE on every `pg_logical_emit_message`
/// signature (PostgreSQL 17 added a fourth argument).
fn public_emit(grant: bool) -> String {
    let (verb, dir) = if grant {
        ("GRANT", "TO")
    } else {
        ("REVOKE", "FROM")
    };
    format!(
        "DO $$ DECLARE f regprocedure; BEGIN
           FOR f IN SELECT p.oid::regprocedure FROM pg_proc p
                     WHERE p.proname = 'pg_logical_emit_message' AND p.pronamespace = 'pg_catalog'::regnamespace
           LOOP EXECUTE format('{verb} EXECUTE ON FUNCTION %s {dir} PUBLIC', f); END LOOP;
         END $$"
    )
}

/// A new login role `<name>_<random>` with `grants` (`{role}` stands for
/// its name; may be empty), connected to `db`.
async fn login_role(db: &TestDb, name: &str, grants: &str) -> tokio_postgres::Client {
    let role = format!("{name}_{}", &Uuid::new_v4().simple().to_string()[..8]);
    let setup = format!(
        "CREATE ROLE {role} LOGIN PASSWORD 'role-pass'; {}",
        grants.replace("{role}", &role)
    );
    db.client().await.batch_execute(&setup).await.unwrap();
    let (client, conn) = tokio_postgres::connect(
        &format!(
            "host=127.0.0.1 port={} user={role} password=role-pass dbname={}",
            crate::harness::server().port,
            db.name
        ),
        tokio_postgres::NoTls,
    )
    .await
    .unwrap();
    tokio::spawn(conn);
    client
}

/// What outbox_emit writes, for a forger to copy.
fn content(id: Uuid, agg: &str) -> String {
    format!(
        r#"{{"v": 1, "id": "{id}", "aggregateType": "Order", "aggregateId": "{agg}", "type": "forged.v1", "payload": {{"x": 1}}}}"#
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_written_with_outbox_emit_are_never_lost_to_the_configuration() {
    let db = TestDb::new("hard_emit6").await;
    let client = db.client().await;
    let dir = tempfile::tempdir().unwrap();
    let brokers = &broker().brokers;
    let p = prefix("emit6");
    let topic = format!("{p}.order");
    let config = |name: &str, postgres: &str| {
        let path = daemon_config(
            dir.path(),
            name,
            &db.superuser_url(),
            "emit6",
            brokers,
            &p,
            "",
            "",
            "",
        );
        let text = std::fs::read_to_string(&path).unwrap().replacen(
            "[postgres]\n",
            &format!("[postgres]\n{postgres}\n"),
            1,
        );
        std::fs::write(&path, text).unwrap();
        path
    };
    // outbox_emit is installed (migration 0007), messages are off.
    let off = config("off.toml", "messages = false");
    let (code, out, _) = outboxd_async(&["check", "--config", off.to_str().unwrap()]).await;
    assert_ne!(code, Some(0), "{out}");
    assert!(
        out.contains("FAIL messages") && out.contains("postgres.messages"),
        "{out}"
    );
    let log = dir.path().join("off.log");
    let mut d = Daemon::start(&off, &log);
    assert_eq!(exits(&mut d, Duration::from_secs(30), &log).await, Some(1));
    assert!(log_text(&log).contains("every event written with outbox_emit would be lost"));
    // Another prefix than outbox_emit writes.
    let other = config("prefix.toml", "message_prefix = \"events\"");
    let (code, out, _) = outboxd_async(&["check", "--config", other.to_str().unwrap()]).await;
    assert_ne!(code, Some(0), "{out}");
    assert!(out.contains("message_prefix"), "{out}");

    // Messages off, and no outbox_emit: streaming starts. outbox_emit
    // installed while it streams stops it before anything past the
    // event is confirmed; with messages on, the event arrives.
    client
        .batch_execute("DROP FUNCTION outbox_emit(text, text, text, jsonb, jsonb, uuid)")
        .await
        .unwrap();
    let log = dir.path().join("live.log");
    let mut d = Daemon::start(&off, &log);
    wait_for("the slot", Duration::from_secs(30), || async {
        confirmed_flush(&client, "emit6").await
    })
    .await;
    client
        .batch_execute(include_str!("../../../migrations/0007_outbox_emit.sql"))
        .await
        .unwrap();
    let id: Uuid = client
        .query_one(
            "SELECT outbox_emit('Order', 'e1', 'emitted.v1', '{\"n\": 1}')",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    let after = current_lsn(&client).await;
    assert_eq!(exits(&mut d, Duration::from_secs(30), &log).await, Some(1));
    assert!(log_text(&log).contains("outbox_emit"), "{}", log_text(&log));
    assert!(
        confirmed_flush(&client, "emit6").await.unwrap() < after,
        "not confirmed past the emitted event"
    );
    let on = config("on.toml", "messages = true");
    let d = Daemon::start(&on, &dir.path().join("on.log"));
    wait_ids(brokers, &[&topic], &HashSet::from([id])).await;
    assert!(d.sigterm().success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_role_that_may_only_call_outbox_emit_cannot_forge_an_event() {
    let db = TestDb::new("hard_emit7").await;
    let client = db.client().await;
    let dir = tempfile::tempdir().unwrap();
    let brokers = &broker().brokers;
    let p = prefix("emit7");
    let topic = format!("{p}.order");
    // An application role that may call outbox_emit and nothing else.
    let app = login_role(
        &db,
        "app",
        "GRANT EXECUTE ON FUNCTION outbox_emit(text, text, text, jsonb, jsonb, uuid) TO {role}",
    )
    .await;

    let cfg = daemon_config(
        dir.path(),
        "f.toml",
        &db.superuser_url(),
        "emit7",
        brokers,
        &p,
        "",
        "",
        "",
    );
    let log = dir.path().join("f.log");
    let mut d = Daemon::start(&cfg, &log);
    wait_for("the slot", Duration::from_secs(30), || async {
        confirmed_flush(&client, "emit7").await
    })
    .await;
    let real: Uuid = app
        .query_one("SELECT outbox_emit('Order', 'real', 'real.v1', '{}')", &[])
        .await
        .unwrap()
        .get(0);
    let forged = Uuid::new_v4();
    let e = app
        .execute(
            "SELECT pg_logical_emit_message(true, 'outbox', $1::text)",
            &[&content(forged, "forged")],
        )
        .await
        .expect_err("PUBLIC may not write messages (migration 0008)");
    assert!(format!("{e:?}").contains("permission denied"), "{e:?}");
    wait_ids(brokers, &[&topic], &HashSet::from([real])).await;

    // A database where PUBLIC may write messages again: the running relay
    // stops (within a guard round), and refuses to start.
    client.batch_execute(&public_emit(true)).await.unwrap();
    assert_eq!(exits(&mut d, Duration::from_secs(30), &log).await, Some(1));
    assert!(log_text(&log).contains("any role may call pg_logical_emit_message"));
    app.execute(
        "SELECT pg_logical_emit_message(true, 'outbox', $1::text)",
        &[&content(forged, "forged")],
    )
    .await
    .unwrap();
    let mut again = Daemon::start(&cfg, &log);
    assert_eq!(exits(&mut again, Duration::from_secs(30), &log).await, Some(1));
    let (code, out, _) = outboxd_async(&["check", "--config", cfg.to_str().unwrap()]).await;
    assert_ne!(code, Some(0));
    assert!(
        out.contains("REVOKE EXECUTE ON FUNCTION pg_logical_emit_message"),
        "{out}"
    );
    let in_kafka = ids(&records(brokers, &[&topic]).await);
    assert!(!in_kafka.contains(&forged), "the forged event was not published");

    // PUBLIC's right revoked again: the forged message is still in the WAL
    // the slot has not confirmed. Who may write messages changed since the
    // last session proved it, so the start is refused, not streamed.
    client.batch_execute(&public_emit(false)).await.unwrap();
    let mut after = Daemon::start(&cfg, &log);
    assert_eq!(exits(&mut after, Duration::from_secs(30), &log).await, Some(1));
    let text = log_text(&log);
    assert!(
        text.contains("the rights to write logical decoding messages"),
        "{text}"
    );
    let (code, out, _) = outboxd_async(&["check", "--config", cfg.to_str().unwrap()]).await;
    assert_ne!(code, Some(0), "{out}");
    assert!(
        out.contains("FAIL register") && out.contains("rights to write"),
        "{out}"
    );
    let in_kafka = ids(&records(brokers, &[&topic]).await);
    assert!(!in_kafka.contains(&forged), "the forged event was not published");
}

/// `postgres.messages = "auto"` reads messages while `outbox_emit` is
/// installed. Dropped while the slot lags behind events it wrote, those
/// events are still read: a session on the slot read messages before, so
/// the next ones do too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_emitted_before_outbox_emit_is_dropped_still_arrive() {
    let db = TestDb::new("hard_emitdrop").await;
    let client = db.client().await;
    let dir = tempfile::tempdir().unwrap();
    let brokers = &broker().brokers;
    let p = prefix("emitdrop");
    let topic = format!("{p}.order");
    let cfg = daemon_config(
        dir.path(),
        "d.toml",
        &db.superuser_url(),
        "emitdrop",
        brokers,
        &p,
        "",
        "",
        "",
    );
    let log = dir.path().join("d.log");
    let emit = |n: usize| {
        let client = &client;
        async move {
            let mut ids = HashSet::new();
            for i in 0..n {
                let id: Uuid = client
                    .query_one(
                        "SELECT outbox_emit('Order', 'agg', 'emitted.v1', jsonb_build_object('i', $1::int))",
                        &[&(i as i32)],
                    )
                    .await
                    .unwrap()
                    .get(0);
                ids.insert(id);
            }
            ids
        }
    };
    let d = Daemon::start(&cfg, &log);
    wait_for("the slot", Duration::from_secs(30), || async {
        confirmed_flush(&client, "emitdrop").await
    })
    .await;
    let first = emit(1).await;
    wait_ids(brokers, &[&topic], &first).await;
    assert!(d.sigterm().success());

    let lagging = emit(2).await;
    client
        .batch_execute("DROP FUNCTION outbox_emit(text, text, text, jsonb, jsonb, uuid)")
        .await
        .unwrap();
    let (row, _) = crate::relay::write_events(&client, 1, 1, 1, &["Order"], 0).await;
    let d = Daemon::start(&cfg, &log);
    let mut want = lagging.clone();
    want.extend(row.iter().map(|e| e.id));
    wait_ids(brokers, &[&topic], &want).await;
    assert!(d.sigterm().success());
}

/// Any role may create a `pg_temp.outbox_emit` (and, before 15, one in
/// `public`): a function that cannot write a message, since its owner may
/// not call `pg_logical_emit_message`. It must not stop outboxd, neither
/// a running session nor the next start nor `check`, whether messages
/// are read or not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outbox_emit_made_by_a_role_that_cannot_emit_stops_nothing() {
    let db = TestDb::new("hard_emitfake").await;
    let client = db.client().await;
    let dir = tempfile::tempdir().unwrap();
    let brokers = &broker().brokers;
    let p = prefix("emitfake");
    let topic = format!("{p}.order");
    // No table-less outbox here: the intruder's function is the only one.
    client
        .batch_execute("DROP FUNCTION IF EXISTS outbox_emit(text, text, text, jsonb, jsonb, uuid)")
        .await
        .unwrap();
    let intruder = login_role(&db, "nobody", "").await;

    let auto = daemon_config(
        dir.path(),
        "a.toml",
        &db.superuser_url(),
        "emitfake",
        brokers,
        &p,
        "",
        "",
        "",
    );
    let off = daemon_config(
        dir.path(),
        "o.toml",
        &db.superuser_url(),
        "emitfake",
        brokers,
        &p,
        "",
        "",
        "",
    );
    let text = std::fs::read_to_string(&off)
        .unwrap()
        .replace("[postgres]", "[postgres]\nmessages = false");
    std::fs::write(&off, text).unwrap();

    let log = dir.path().join("a.log");
    let mut d = Daemon::start(&auto, &log);
    wait_for("the slot", Duration::from_secs(30), || async {
        confirmed_flush(&client, "emitfake").await
    })
    .await;
    // A function without the prefix, in the intruder's temporary schema,
    // kept for as long as its session lives.
    intruder
        .batch_execute(
            "CREATE FUNCTION pg_temp.outbox_emit(a text, b text, c text, d jsonb) RETURNS uuid
               LANGUAGE sql AS 'SELECT gen_random_uuid()'",
        )
        .await
        .unwrap();
    let (events, _) = crate::relay::write_events(&client, 3, 1, 1, &["Order"], 0).await;
    wait_ids(brokers, &[&topic], &events.iter().map(|e| e.id).collect()).await;
    // Several guard rounds later the session still streams.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(d.try_wait().is_none(), "the relay stopped:\n{}", log_text(&log));
    assert!(d.sigterm().success());

    for cfg in [&auto, &off] {
        let (code, out, _) = outboxd_async(&["check", "--config", cfg.to_str().unwrap()]).await;
        assert_eq!(code, Some(0), "{out}");
    }
    let mut again = Daemon::start(&off, &log);
    wait_for("the slot", Duration::from_secs(30), || async {
        confirmed_flush(&client, "emitfake").await
    })
    .await;
    let (more, _) = crate::relay::write_events(&client, 2, 1, 1, &["Order"], 3).await;
    wait_ids(brokers, &[&topic], &more.iter().map(|e| e.id).collect()).await;
    assert!(again.try_wait().is_none(), "{}", log_text(&log));
    assert!(again.sigterm().success());
    drop(intruder);
}
