//! Operating outboxd: metrics, probes, status, and secrets kept out of sight.

use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::time::Duration;

use tokio::sync::watch;

use crate::harness::broker::{self, broker};
use crate::harness::postgres;
use crate::harness::{wait_for, TestDb};

pub(crate) fn config(db_url: &str, slot: &str, brokers: &str, listen: &str) -> String {
    format!(
        r#"
[postgres]
url = "{db_url}"
slot = "{slot}"
publication = "{slot}"
status_interval = "200ms"
reconnect_backoff_max = "1s"

[kafka]
brokers = "{brokers}"
topic_partitions = 3
topic_replication_factor = 1
admin_timeout = "2s"

[routing]
topic = "ops.{{aggregate_type}}"

[http]
listen = "{listen}"

[health]
poll_interval = "300ms"
status_max_age = "3s"
ack_max_age = "5s"
"#
    )
}

pub(crate) struct Running {
    addr: SocketAddr,
    stop: watch::Sender<bool>,
    handle: tokio::task::JoinHandle<outboxd::daemon::Ending>,
}

/// Runs the sources of `text` with the HTTP server, as `outboxd run` does.
pub(crate) async fn start(text: &str) -> Running {
    crate::harness::init_logs();
    let sources = outboxd::config::sources::from_toml(text, |_| None).unwrap();
    let (listen, token) = (
        sources[0].validated.listen,
        sources[0].config.http.admin_token.clone(),
    );
    let (supervisor, board) = outboxd::daemon::Supervisor::new(None, None, sources).unwrap();
    let addr = outboxd::ops::http::serve(listen, board, token).await.unwrap();
    let (stop, rx) = watch::channel(false);
    let handle = tokio::spawn(supervisor.run(rx));
    Running { addr, stop, handle }
}

impl Running {
    async fn shutdown(self) {
        self.stop.send(true).unwrap();
        let ending = tokio::time::timeout(Duration::from_secs(30), self.handle)
            .await
            .expect("stops in time")
            .unwrap();
        assert_eq!(ending, outboxd::daemon::Ending::Stopped, "clean stop");
    }
}

/// GET a path; returns the status code and body.
pub(crate) async fn get(addr: SocketAddr, path: &str) -> (u16, String) {
    let url = format!("http://{addr}{path}");
    tokio::task::spawn_blocking(move || {
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_global(Some(Duration::from_secs(5)))
            .build()
            .into();
        let mut resp = agent.get(&url).call().unwrap();
        let status = resp.status().as_u16();
        (status, resp.body_mut().read_to_string().unwrap())
    })
    .await
    .unwrap()
}

/// The value of an unlabelled metric in Prometheus text.
pub(crate) fn metric(text: &str, name: &str) -> Option<f64> {
    // Unlabelled, or with the `source` label only.
    text.lines()
        .find(|l| {
            l.strip_prefix(name).is_some_and(|rest| {
                rest.starts_with(' ') || (rest.starts_with("{source=\"") && rest.matches('=').count() == 1)
            })
        })
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

pub(crate) async fn write_events(client: &tokio_postgres::Client, txns: usize, per_txn: usize) {
    for t in 0..txns {
        client
            .execute(
                "INSERT INTO outbox (id, aggregate_type, aggregate_id, type, payload)
                 SELECT gen_random_uuid(), 'Metric', 'agg-' || (g % 7), 'm.v1', jsonb_build_object('t', $1::int, 'g', g)
                   FROM generate_series(1, $2::int) g",
                &[&(t as i32), &(per_txn as i32)],
            )
            .await
            .unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_under_load() {
    let db = TestDb::new("ops_metrics").await;
    let client = db.client().await;
    let r = start(&config(
        &db.superuser_url(),
        "ops_metrics",
        &broker().brokers,
        "127.0.0.1:0",
    ))
    .await;
    let first = wait_for(
        "the first scrape with a confirmed LSN",
        Duration::from_secs(30),
        || async {
            let (code, text) = get(r.addr, "/metrics").await;
            assert_eq!(code, 200);
            metric(&text, "outboxd_confirmed_lsn").filter(|v| *v > 0.0)
        },
    )
    .await;
    write_events(&client, 200, 10).await;
    // The confirmed LSN follows the acknowledgements one publication-guard
    // round later (about 250 ms): wait for both.
    let text = wait_for(
        "2,000 events counted and confirmed",
        Duration::from_secs(60),
        || async {
            let (_, text) = get(r.addr, "/metrics").await;
            let counted = metric(&text, "outboxd_events_published_total") == Some(2000.0);
            let moved = metric(&text, "outboxd_confirmed_lsn").is_some_and(|c| c > first);
            (counted && moved).then_some(text)
        },
    )
    .await;
    let confirmed = metric(&text, "outboxd_confirmed_lsn").unwrap();
    assert!(
        confirmed > first,
        "confirmed LSN advances: {first} -> {confirmed}"
    );
    assert!(metric(&text, "outboxd_transactions_total").unwrap() >= 200.0);
    assert!(
        metric(&text, "outboxd_commit_to_ack_seconds_count").unwrap() >= 200.0,
        "histogram has samples"
    );
    assert!(metric(&text, "outboxd_last_ack_timestamp_seconds").unwrap() > 1.7e9);
    assert!(text.contains("outboxd_build_info{version=\""));
    assert!(text.contains("outboxd_slot_retained_wal_bytes"));
    assert_eq!(metric(&text, "outboxd_inflight_events"), Some(0.0));
    let (code, body) = get(r.addr, "/healthz").await;
    assert_eq!((code, body.as_str()), (200, "ok\n"));
    r.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readiness_follows_postgres_and_the_broker() {
    let pg = postgres::dedicated("");
    let own_broker = broker::dedicated();
    outbox_sdk::migrate::migrate(&mut pg.client("postgres").await)
        .await
        .unwrap();
    let url = pg.url("postgres", None, "postgres");
    let r = start(&config(&url, "ops_ready", &own_broker.brokers, "127.0.0.1:0")).await;
    let ready = |want: u16| {
        let addr = r.addr;
        move || async move {
            let (code, body) = get(addr, "/readyz").await;
            (code == want).then_some(body)
        }
    };
    wait_for("ready", Duration::from_secs(30), ready(200)).await;

    let t = std::time::Instant::now();
    pg.pg_ctl(&["stop", "-m", "fast"]).unwrap();
    let body = wait_for(
        "not ready with PostgreSQL down",
        Duration::from_secs(10),
        ready(503),
    )
    .await;
    eprintln!("readiness: PostgreSQL down noticed in {:?}: {body}", t.elapsed());
    assert!(body.contains("not streaming"), "{body}");
    let (code, _) = get(r.addr, "/healthz").await;
    assert_eq!(code, 200, "still live while reconnecting");
    pg.pg_ctl(&["start", "-w", "-l", &pg.log_file.display().to_string()])
        .unwrap();
    wait_for(
        "ready after PostgreSQL is back",
        Duration::from_secs(30),
        ready(200),
    )
    .await;

    let t = std::time::Instant::now();
    own_broker.kill();
    let body = wait_for(
        "not ready with the broker down",
        Duration::from_secs(15),
        ready(503),
    )
    .await;
    eprintln!("readiness: broker down noticed in {:?}: {body}", t.elapsed());
    assert!(body.contains("Kafka"), "{body}");
    own_broker.restart();
    wait_for(
        "ready after the broker is back",
        Duration::from_secs(30),
        ready(200),
    )
    .await;
    r.shutdown().await;
    own_broker.kill();
}

/// Runs the outboxd binary: success, stdout, stderr.
pub(crate) fn outboxd(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_outboxd"))
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// `outboxd retention` under a polling configuration never deletes a row
/// the polling relay has not published, whatever its age; in CDC mode it
/// trims every old row (the WAL already carried them), but not while the
/// slot is missing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retention_keeps_what_a_polling_relay_has_not_published() {
    let db = TestDb::new("ops_retention").await;
    let client = db.client().await;
    client
        .batch_execute(
            "INSERT INTO outbox (id, aggregate_type, aggregate_id, type, payload, created_at, published_at)
             SELECT gen_random_uuid(), 'Order', 'a', 't', '{}', now() - interval '10 days',
                    CASE WHEN g % 2 = 0 THEN now() END
               FROM generate_series(1, 10) g",
        )
        .await
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let write = |name: &str, mode: &str| {
        let path = dir.path().join(name);
        std::fs::write(
            &path,
            format!(
                "mode = \"{mode}\"\n[postgres]\nurl = \"{}\"\n[kafka]\nbrokers = \"127.0.0.1:9\"\n",
                db.superuser_url()
            ),
        )
        .unwrap();
        path.display().to_string()
    };
    let polling = write("polling.toml", "polling");
    let cdc = write("cdc.toml", "cdc");
    let count = |sql: &'static str| {
        let client = &client;
        async move { client.query_one(sql, &[]).await.unwrap().get::<_, i64>(0) }
    };
    let (ok, out, err) = outboxd(&["retention", "--config", &polling, "--older-than", "1d"]);
    assert!(ok, "{out}{err}");
    assert!(out.contains("deleted 5"), "{out}");
    assert_eq!(
        count("SELECT count(*) FROM outbox WHERE published_at IS NULL").await,
        5,
        "unpublished rows stay"
    );
    assert_eq!(count("SELECT count(*) FROM outbox").await, 5);
    // No slot: the rows may be the only copy of what it did not deliver.
    let (ok, out, err) = outboxd(&["retention", "--config", &cdc, "--older-than", "1d"]);
    assert!(
        !ok && err.contains("does not exist") && err.contains("outboxd replay"),
        "{out}{err}"
    );
    assert_eq!(count("SELECT count(*) FROM outbox").await, 5, "nothing deleted");
    let (ok, out, err) = outboxd(&["retention", "--config", &cdc, "--older-than", "1d", "--force"]);
    assert!(ok, "{out}{err}");
    assert_eq!(
        count("SELECT count(*) FROM outbox").await,
        0,
        "CDC mode trims every old row"
    );
}

/// A password that breaks TOML, URLs and HTML-form decoding authenticates
/// with SCRAM through `postgres.password` (from `${VAR}`, no encoding) and
/// through a libpq-encoded URL (a literal `+` is a plus), and no output of
/// `outboxd check` ever shows it, not even when it is wrong.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_passwords_authenticate_and_never_show() {
    let db = TestDb::new("ops_hostile").await;
    let client = db.client().await;
    let password = "p\"a\\s+s&w%o=r d@/#ü'";
    client
        .batch_execute(&format!(
            "CREATE ROLE hostile LOGIN REPLICATION PASSWORD '{}'; GRANT SELECT ON outbox TO hostile;",
            password.replace('\'', "''")
        ))
        .await
        .unwrap();
    let base = db.url("hostile", None);
    // Every reserved character percent-encoded, the '+' left as it is.
    let encoded: String = password
        .chars()
        .map(|c| match c {
            '+' => "+".to_owned(),
            c if c.is_ascii_alphanumeric() => c.to_string(),
            c => c.to_string().bytes().map(|b| format!("%{b:02X}")).collect(),
        })
        .collect();
    let in_url = base.replace("hostile@", &format!("hostile:{encoded}@"));
    let dir = tempfile::tempdir().unwrap();
    let run = |name: &str, postgres: String, env_pw: &str| {
        let path = dir.path().join(name);
        std::fs::write(
            &path,
            format!(
                "[postgres]\n{postgres}\ncreate_publication = true\n[kafka]\nbrokers = \"{}\"\n",
                broker().brokers
            ),
        )
        .unwrap();
        let out = Command::new(env!("CARGO_BIN_EXE_outboxd"))
            .args(["check", "--config"])
            .arg(&path)
            .env("HOSTILE_PW", env_pw)
            .output()
            .unwrap();
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(!text.contains(password), "{name}: the password is shown:\n{text}");
        assert!(
            !text.contains(&encoded),
            "{name}: the encoded password is shown:\n{text}"
        );
        (out.status.success(), text)
    };
    let (ok, text) = run(
        "password_key.toml",
        format!("url = \"{base}\"\npassword = \"${{HOSTILE_PW}}\""),
        password,
    );
    assert!(ok, "postgres.password:\n{text}");
    let (ok, text) = run("url.toml", format!("url = \"{in_url}\""), "");
    assert!(ok, "libpq-encoded url:\n{text}");
    let wrong = "p\"a\\s+s&w%o=r d@/#";
    let (ok, text) = run(
        "wrong.toml",
        format!("url = \"{base}\"\npassword = \"${{HOSTILE_PW}}\""),
        wrong,
    );
    assert!(
        !ok && text.contains("28P01"),
        "a wrong password fails with 28P01:\n{text}"
    );
    assert!(!text.contains(wrong), "the wrong password is shown:\n{text}");
}
