//! A publication that does not carry every outbox INSERT must never let the
//! slot move past rows it did not deliver: refused at start with the exact
//! statement (which, applied, fixes it), and any change while streaming
//! stops the relay before the rows written after the change.

use std::process::Command;
use std::time::Duration;

use outboxd::relay::RelayError;
use outboxd::Lsn;

use crate::harness::broker::broker;
use crate::harness::{wait_for, TestDb};
use crate::relay::{
    bin, config_text, confirmed_flush, current_lsn, spawn_relay_with_slot, stop_relay, write_config, Daemon,
};

/// The statement an error names: what follows its last "run: ".
fn statement(message: &str) -> String {
    let lower = message.to_lowercase();
    let at = lower
        .rfind("run: ")
        .unwrap_or_else(|| panic!("no statement in {message:?}"))
        + 5;
    message[at..].lines().next().unwrap().trim().to_owned()
}

fn outboxd(args: &[&str], config: &std::path::Path) -> (bool, String) {
    let out = Command::new(bin())
        .args(args)
        .arg("--config")
        .arg(config)
        .env("RUST_LOG", "error")
        .output()
        .unwrap();
    (
        out.status.success(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publication_that_would_lose_inserts_is_refused_with_the_statement_that_fixes_it() {
    let cases = [
        ("missing", "", "CREATE PUBLICATION"),
        (
            "lacks_table",
            "CREATE PUBLICATION pubx FOR TABLE other",
            "ADD TABLE",
        ),
        (
            "no_inserts",
            "CREATE PUBLICATION pubx FOR TABLE outbox WITH (publish = 'update, delete')",
            "SET (publish = 'insert, update, delete')",
        ),
        (
            "row_filter",
            "CREATE PUBLICATION pubx FOR TABLE outbox WHERE (aggregate_type = 'Order')",
            "row filter",
        ),
        (
            "column_list",
            "CREATE PUBLICATION pubx FOR TABLE outbox (id, aggregate_type, aggregate_id, type, payload)",
            "without created_at, headers",
        ),
    ];
    let dir = tempfile::tempdir().unwrap();
    for (name, setup, want) in cases {
        let db = TestDb::new(&format!("pub_start_{name}")).await;
        let client = db.client().await;
        client.batch_execute("CREATE TABLE other (id int)").await.unwrap();
        if !setup.is_empty() {
            client.batch_execute(setup).await.unwrap();
        }
        let text = config_text(&db.superuser_url(), "pub_start", &broker().brokers, "", "").replace(
            "publication = \"pub_start\"",
            "publication = \"pubx\"\ncreate_publication = false",
        );
        let cfg = write_config(dir.path(), &format!("{name}.toml"), &text);
        let (ok, out) = outboxd(&["check"], &cfg);
        assert!(!ok, "{name}: check must fail:\n{out}");
        assert!(out.contains(want), "{name}: {want:?} not in:\n{out}");
        let (ok, run_out) = outboxd(&["run"], &cfg);
        assert!(
            !ok && run_out.contains(want),
            "{name}: run must refuse:\n{run_out}"
        );
        let slots: i64 = client
            .query_one(
                "SELECT count(*) FROM pg_replication_slots WHERE slot_name = 'pub_start'",
                &[],
            )
            .await
            .unwrap()
            .get(0);
        assert_eq!(
            slots, 0,
            "{name}: no slot is created for a publication that loses rows"
        );
        // The statement it names is the fix.
        let line = out.lines().find(|l| l.contains(want)).unwrap();
        client.batch_execute(&statement(line)).await.unwrap();
        let (ok, out) = outboxd(&["check"], &cfg);
        assert!(
            out.contains("delivers every INSERT"),
            "{name}: after the fix:\n{out}"
        );
        assert!(ok || out.contains("FAIL kafka"), "{name}:\n{out}");
    }
}

/// Starts a relay on a fresh database, publishes a first batch, runs
/// `change`, writes a row in a transaction whose insert position it
/// reads, and returns the relay's error, that position and the slot's
/// final confirmed LSN.
async fn change_while_streaming(name: &str, change: &str, after: &str) -> (RelayError, Lsn, Lsn) {
    let db = TestDb::new(&format!("pub_live_{name}")).await;
    let client = db.client().await;
    client.batch_execute("CREATE TABLE other (id int)").await.unwrap();
    // Slots are cluster-wide: one name per case. The publication has the
    // same name; the statements say {pub} for it.
    let slot = &format!("pub_live_{name}");
    let (change, after) = (change.replace("{pub}", slot), after.replace("{pub}", slot));
    let (change, after) = (change.as_str(), after.as_str());
    let (handle, stop) = spawn_relay_with_slot(
        &client,
        slot,
        &config_text(
            &db.superuser_url(),
            slot,
            &broker().brokers,
            &format!("topic = \"pub-{name}.{{aggregate_type}}\""),
            "",
        ),
    )
    .await;
    let insert = "INSERT INTO outbox (id, aggregate_type, aggregate_id, type, payload) VALUES (gen_random_uuid(), 'Order', 'a', 't', '{}')";
    client.batch_execute(insert).await.unwrap();
    let first = current_lsn(&client).await;
    wait_for("the first row confirmed", Duration::from_secs(30), || async {
        (confirmed_flush(&client, slot).await? >= first).then_some(())
    })
    .await;
    client.batch_execute(change).await.unwrap();
    // The row the changed publication may not deliver, and a position
    // inside its transaction: its commit lies after it.
    let renamed = insert.replace("INTO outbox ", "INTO outbox_old ");
    let insert_after = if change.contains("RENAME TO outbox_old") {
        renamed.as_str()
    } else {
        insert
    };
    let row_lsn: Lsn = {
        client.batch_execute("BEGIN").await.unwrap();
        client.batch_execute(insert_after).await.unwrap();
        let l = current_lsn(&client).await;
        client.batch_execute("COMMIT").await.unwrap();
        l
    };
    if !after.is_empty() {
        client.batch_execute(after).await.unwrap();
    }
    // Traffic on another table keeps keepalives coming.
    for _ in 0..20 {
        client
            .batch_execute("INSERT INTO other VALUES (1)")
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let result = tokio::time::timeout(Duration::from_secs(30), handle).await;
    let err = match result {
        Ok(joined) => joined.unwrap().expect_err("the relay stops with an error"),
        Err(_) => {
            let confirmed = confirmed_flush(&client, slot).await.unwrap();
            let _ = stop.send(true);
            panic!(
                "{name}: the relay kept running after {change:?}; confirmed {confirmed}, row at {row_lsn}"
            );
        }
    };
    drop(stop);
    let confirmed = confirmed_flush(&client, slot).await.unwrap();
    (err, row_lsn, confirmed)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn changing_the_publication_or_the_table_while_streaming_stops_before_the_rows_it_may_lose() {
    let cases = [
        ("drop_table", "ALTER PUBLICATION {pub} DROP TABLE outbox", ""),
        (
            "publish_update",
            "ALTER PUBLICATION {pub} SET (publish = 'update')",
            "",
        ),
        ("drop_publication", "DROP PUBLICATION {pub}", ""),
        // Out and back in: the row between is lost, the end state is correct.
        (
            "flip_flop",
            "ALTER PUBLICATION {pub} DROP TABLE outbox",
            "ALTER PUBLICATION {pub} ADD TABLE outbox",
        ),
        ("rename", "ALTER TABLE outbox RENAME TO outbox_old", ""),
    ];
    for (name, change, after) in cases {
        let (err, row_lsn, confirmed) = change_while_streaming(name, change, after).await;
        assert!(!err.is_transient(), "{name}: a definite stop, not a retry: {err}");
        assert!(
            matches!(err, RelayError::PublicationChanged { .. } | RelayError::Stream(_)),
            "{name}: {err}"
        );
        assert!(
            confirmed < row_lsn,
            "{name}: the slot confirmed {confirmed}, past the row written after the change (inside its transaction: {row_lsn})"
        );
        eprintln!("publication {name}: stopped at {confirmed} (row at {row_lsn}): {err}");
    }
}

/// Changes that cannot keep an outbox INSERT from the publication do not
/// stop the relay, and confirmations go on. Changing the outbox table's
/// columns is one: each row is read with the columns its relation had when
/// it was written (an optional column dropped and added back reads as
/// absent in between), and no column decides delivery without a column
/// list.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn harmless_changes_keep_the_relay_running() {
    let db = TestDb::new("pub_harmless").await;
    let client = db.client().await;
    client.batch_execute("CREATE TABLE other (id int)").await.unwrap();
    let slot = "pub_harmless";
    let (handle, stop) = spawn_relay_with_slot(
        &client,
        slot,
        &config_text(
            &db.superuser_url(),
            slot,
            &broker().brokers,
            "topic = \"pub-harmless.{aggregate_type}\"",
            "",
        ),
    )
    .await;
    client
        .batch_execute(
            "ALTER PUBLICATION pub_harmless ADD TABLE other;
             ALTER TABLE outbox ADD COLUMN trace_id text;
             CREATE INDEX ON outbox (aggregate_id);
             INSERT INTO outbox (id, aggregate_type, aggregate_id, type, payload) VALUES (gen_random_uuid(), 'Order', 'a', 't', '{}');
             ALTER TABLE outbox DROP COLUMN headers;
             INSERT INTO outbox (id, aggregate_type, aggregate_id, type, payload) VALUES (gen_random_uuid(), 'Order', 'a', 't', '{}');
             ALTER TABLE outbox ADD COLUMN headers jsonb NOT NULL DEFAULT '{}';
             INSERT INTO outbox (id, aggregate_type, aggregate_id, type, payload, headers) VALUES (gen_random_uuid(), 'Order', 'a', 't', '{}', '{\"k\": \"v\"}')",
        )
        .await
        .unwrap();
    let target = current_lsn(&client).await;
    wait_for("confirmed past the row", Duration::from_secs(30), || async {
        (confirmed_flush(&client, slot).await? >= target).then_some(())
    })
    .await;
    assert!(!handle.is_finished(), "still running");
    stop_relay(handle, stop).await;
    let records = tokio::task::spawn_blocking(|| {
        crate::harness::broker::consume(
            &broker().brokers,
            &["pub-harmless.order"],
            3,
            Duration::from_secs(30),
        )
    })
    .await
    .unwrap();
    assert_eq!(records.len(), 3, "every row, whatever the columns were");
    assert_eq!(
        records[2].header("k"),
        Some("v"),
        "the headers column read again once it is back"
    );
}

/// A schema publication does not stop `ALTER TABLE … SET UNLOGGED` on the
/// outbox (a publication that lists the table does): the running relay
/// stops, saying the table is unlogged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outbox_set_unlogged_under_a_schema_publication_stops_naming_it() {
    let db = TestDb::new("pub_unlogged").await;
    let client = db.client().await;
    client
        .batch_execute(
            "CREATE PUBLICATION unlogged_schema FOR TABLES IN SCHEMA public WITH (publish = 'insert')",
        )
        .await
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let brokers = &broker().brokers;
    let p = crate::hardening::prefix("pubunl");
    let cfg = crate::hardening::daemon_config(
        dir.path(),
        "s.toml",
        &db.superuser_url(),
        "unlogged_schema",
        brokers,
        &p,
        "",
        "",
        "",
    );
    let log = dir.path().join("s.log");
    let mut d = Daemon::start(&cfg, &log);
    wait_for("the slot", Duration::from_secs(30), || async {
        confirmed_flush(&client, "unlogged_schema").await
    })
    .await;
    client
        .batch_execute("ALTER TABLE outbox SET UNLOGGED")
        .await
        .unwrap();
    assert_eq!(
        crate::hardening::exits(&mut d, Duration::from_secs(30), &log).await,
        Some(1)
    );
    let text = crate::hardening::log_text(&log);
    assert!(text.contains("public.outbox (unlogged)"), "{text}");
    assert!(!text.contains("ancestor"), "{text}");
}
