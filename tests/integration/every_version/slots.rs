//! Slots as each version reports them: WAL an idle outbox releases, the
//! retained-WAL guard, an invalidated slot, and `outboxd status` reading
//! the slot's columns.

use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::time::Duration;

use outboxd::Lsn;

use crate::harness::broker::broker;
use crate::harness::postgres::{self, urlencode, SCRAM_USER};
use crate::harness::{wait_for, TestDb};
use crate::operations::{config, get, outboxd, write_events};
use crate::relay::{config_text, current_lsn, spawn_relay, stop_relay, write_config};
use crate::reliability::{health_section, observe, wait_slot};

async fn slot_lsns(c: &tokio_postgres::Client, slot: &str) -> (Lsn, Lsn) {
    let row = c
        .query_one(
            "SELECT restart_lsn::text, confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = $1",
            &[&slot],
        )
        .await
        .unwrap();
    (
        row.get::<_, String>(0).parse().unwrap(),
        row.get::<_, String>(1).parse().unwrap(),
    )
}

/// The idle-outbox rule with 64 MB written to another table, and the
/// retained-WAL guard.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_outbox_releases_wal_and_the_retained_wal_guard_trips() {
    let db = TestDb::new("rel_wal").await;
    let client = db.client().await;
    client
        .batch_execute("CREATE TABLE bulk (id serial PRIMARY KEY, v text)")
        .await
        .unwrap();
    let slot = "wal_idle";
    let r = observe(
        &(config_text(
            &db.superuser_url(),
            slot,
            &broker().brokers,
            "topic = \"wal.{aggregate_type}\"",
            "",
        ) + &health_section("max_retained_wal_bytes = 1")),
    );
    wait_slot(&client, slot).await;
    let (restart0, _) = slot_lsns(&client, slot).await;
    let start = current_lsn(&client).await;
    // 64 MB of WAL that compresses badly, in 256 KB rows.
    for _ in 0..256 {
        client
            .execute(
                "INSERT INTO bulk (v) SELECT string_agg(md5(random()::text), '') FROM generate_series(1, 8192)",
                &[],
            )
            .await
            .unwrap();
    }
    let end = current_lsn(&client).await;
    assert!(
        end.bytes_since(start) >= 64 << 20,
        "wrote {} bytes of WAL",
        end.bytes_since(start)
    );
    client.batch_execute("CHECKPOINT").await.unwrap();
    let (restart, confirmed) = wait_for(
        "restart_lsn and confirmed_flush_lsn to follow",
        Duration::from_secs(60),
        || async {
            // New running-xacts records let the slot move its restart point.
            client.batch_execute("CHECKPOINT").await.unwrap();
            let (restart, confirmed) = slot_lsns(&client, slot).await;
            (confirmed >= end && restart > restart0).then_some((restart, confirmed))
        },
    )
    .await;
    eprintln!(
        "wal: {} MB written elsewhere; restart_lsn {restart0} -> {restart}, confirmed {confirmed}",
        end.bytes_since(start) >> 20
    );

    // The guard: more than 1 byte retained is over the limit.
    wait_for(
        "not ready over max_retained_wal_bytes",
        Duration::from_secs(10),
        || async {
            r.health
                .not_ready_reasons()
                .iter()
                .any(|x| x.contains("retains"))
                .then_some(())
        },
    )
    .await;
    assert!(r.metrics.slot_retained_wal_bytes.get() > 1);
    r.shutdown().await;
}

/// A slot invalidated by max_slot_wal_keep_size: a clear error with the
/// recovery steps, from `run` and from `check`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalidated_slot_names_the_recovery() {
    let pg = postgres::dedicated(
        "max_slot_wal_keep_size = '1MB'\nwal_keep_size = 0\nmax_wal_size = '64MB'\nmin_wal_size = '32MB'",
    );
    let mut c = pg.client("postgres").await;
    outbox_sdk::migrate::migrate(&mut c).await.unwrap();
    let slot = "lost_slot";
    let text = config_text(
        &pg.url("postgres", None, "postgres"),
        slot,
        &broker().brokers,
        "",
        "",
    );
    let (handle, stop) = spawn_relay(&text);
    wait_slot(&c, slot).await;
    stop_relay(handle, stop).await;
    c.batch_execute("CREATE TABLE filler (v text)").await.unwrap();
    wait_for("the slot to be invalidated", Duration::from_secs(120), || async {
        for _ in 0..20 {
            c.execute(
                "INSERT INTO filler SELECT string_agg(md5(random()::text), '') FROM generate_series(1, 8192)",
                &[],
            )
            .await
            .unwrap();
        }
        c.batch_execute("SELECT pg_switch_wal(); CHECKPOINT;")
            .await
            .unwrap();
        let status: Option<String> = c
            .query_one(
                "SELECT wal_status FROM pg_replication_slots WHERE slot_name = $1",
                &[&slot],
            )
            .await
            .unwrap()
            .get(0);
        (status.as_deref() == Some("lost")).then_some(())
    })
    .await;
    let (handle, _stop) = spawn_relay(&text);
    let err = tokio::time::timeout(Duration::from_secs(30), handle)
        .await
        .expect("outboxd stops")
        .unwrap()
        .expect_err("an invalidated slot is a definite error");
    let msg = err.to_string();
    assert!(!err.is_transient());
    assert!(
        msg.contains("invalidated")
            && msg.contains("pg_drop_replication_slot('lost_slot')")
            && msg.contains("`outboxd replay --config <config file> --since "),
        "{msg}"
    );
    let dir = tempfile::tempdir().unwrap();
    let cfg = write_config(dir.path(), "lost.toml", &text);
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_outboxd"))
        .args(["check", "--config"])
        .arg(&cfg)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        !out.status.success() && stdout.contains("FAIL slot") && stdout.contains("invalidated"),
        "{stdout}"
    );
    // The register knows the commit time of the last confirmed
    // transaction: the check prints the command that closes the gap.
    assert!(
        stdout.contains(&format!("outboxd replay --config {} --since ", cfg.display())),
        "{stdout}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_shows_the_real_slot_and_secrets_stay_hidden() {
    let db = TestDb::new("ops_status").await;
    let client = db.client().await;
    client
        .batch_execute(&format!(
            "GRANT SELECT ON outbox TO {user}; CREATE PUBLICATION ops_status FOR TABLE outbox WITH (publish = 'insert');",
            user = SCRAM_USER.0
        ))
        .await
        .unwrap();
    let secret = SCRAM_USER.1;
    let url = db.url(SCRAM_USER.0, Some(secret));
    let port = postgres::free_port();
    let dir = tempfile::tempdir().unwrap();
    let cfg_path = dir.path().join("outboxd.toml");
    std::fs::write(
        &cfg_path,
        config(
            &url,
            "ops_status",
            &broker().brokers,
            &format!("127.0.0.1:{port}"),
        ) + "\n[log]\nlevel = \"debug\"\n",
    )
    .unwrap();
    let log_path = dir.path().join("outboxd.log");
    let log = std::fs::File::create(&log_path).unwrap();
    let mut daemon = crate::harness::Reaped::new(
        Command::new(env!("CARGO_BIN_EXE_outboxd"))
            .args(["run", "--config"])
            .arg(&cfg_path)
            .env_remove("RUST_LOG")
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap(),
    );
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    wait_for("the daemon to be ready", Duration::from_secs(30), || async {
        let url = format!("http://{addr}/readyz");
        let ok = tokio::task::spawn_blocking(move || ureq::get(&url).call().is_ok())
            .await
            .unwrap();
        ok.then_some(())
    })
    .await;
    write_events(&client, 5, 4).await;
    let (code, metrics_text) = get(addr, "/metrics").await;
    assert_eq!(code, 200);

    let cfg = cfg_path.display().to_string();
    let (ok, text, err) = tokio::task::spawn_blocking({
        let cfg = cfg.clone();
        move || outboxd(&["status", "--config", &cfg])
    })
    .await
    .unwrap();
    assert!(ok, "{err}");
    let (pid, confirmed): (i32, String) = {
        let row = client
            .query_one(
                "SELECT active_pid, confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = 'ops_status'",
                &[],
            )
            .await
            .unwrap();
        (row.get(0), row.get(1))
    };
    assert!(
        text.contains(&format!("ops_status active, walsender PID {pid}")),
        "{text}"
    );
    assert!(
        text.contains("outboxd         ready") && text.contains("kafka           reachable"),
        "{text}"
    );
    let (ok, json, _) = tokio::task::spawn_blocking({
        let cfg = cfg.clone();
        move || outboxd(&["status", "--config", &cfg, "--json"])
    })
    .await
    .unwrap();
    assert!(ok);
    let report: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(report["walsender_pid"], pid);
    let reported: outboxd::Lsn = report["confirmed_lsn"].as_str().unwrap().parse().unwrap();
    assert!(
        reported >= confirmed.parse().unwrap(),
        "status reads the slot's confirmed LSN"
    );

    // Stop the daemon; events written now wait in the idle slot.
    let _ = Command::new("kill")
        .args(["-TERM", &daemon.id().to_string()])
        .status();
    assert!(daemon.wait().unwrap().success());
    write_events(&client, 1, 1).await;
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let (_, idle, _) = tokio::task::spawn_blocking({
        let cfg = cfg.clone();
        move || outboxd(&["status", "--config", &cfg, "--json"])
    })
    .await
    .unwrap();
    let idle: serde_json::Value = serde_json::from_str(&idle).unwrap();
    assert_eq!(idle["slot_active"], false);
    assert_eq!(idle["oldest_unconfirmed_source"], "slot");
    assert!(
        idle["oldest_unconfirmed_event_age_seconds"].as_f64().unwrap() >= 1.0,
        "{idle}"
    );

    // A failing check with a wrong password must not echo it either.
    let wrong = "Wr0ng-S3cret-Pa55";
    let bad_cfg = dir.path().join("bad.toml");
    std::fs::write(
        &bad_cfg,
        std::fs::read_to_string(&cfg_path)
            .unwrap()
            .replace(&urlencode(secret), wrong),
    )
    .unwrap();
    let (ok, check_out, check_err) =
        tokio::task::spawn_blocking(move || outboxd(&["check", "--config", &bad_cfg.display().to_string()]))
            .await
            .unwrap();
    assert!(
        !ok && check_out.contains("password authentication failed"),
        "{check_out}"
    );

    let logs = std::fs::read_to_string(&log_path).unwrap();
    assert!(
        logs.contains("starting outboxd") && logs.contains("ops_status"),
        "{logs}"
    );
    for (what, text) in [
        ("logs", &logs),
        ("status", &text),
        ("status --json", &json),
        ("/metrics", &metrics_text),
        ("check", &(check_out + &check_err)),
    ] {
        for needle in [secret, urlencode(secret).as_str(), wrong] {
            assert!(!text.contains(needle), "{what} shows a password:\n{text}");
        }
    }
}
