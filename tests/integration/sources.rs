//! Many sources in one outboxd (`[[sources]]`), with the real binary: two
//! PostgreSQL servers, two outbox tables in one database, one broker.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use uuid::Uuid;

use crate::harness::broker::{broker, consume, consume_to_end, Consumed};
use crate::harness::postgres::{self, free_port, PgServer};
use crate::harness::{wait_for, TestDb};
use crate::relay::{confirmed_flush, write_config, Daemon};

pub(crate) const TOKEN: &str = "sources-test-token-0123456789";

/// One source of the test: where it writes and where its events go.
#[derive(Clone)]
struct Src {
    name: &'static str,
    url: String,
    table: String,
    slot: String,
    prefix: String,
}

impl Src {
    /// A source `name` on `table` of `url`; `tag` and the run's id make its
    /// slot and topics unique.
    fn new(name: &'static str, url: &str, table: &str, tag: &str, run: &str) -> Src {
        Src {
            name,
            url: url.to_owned(),
            table: table.to_owned(),
            slot: format!("{tag}_{name}_{run}"),
            prefix: format!("{tag}{name}{run}"),
        }
    }

    fn topic(&self) -> String {
        format!("{}.order", self.prefix)
    }

    fn toml(&self) -> String {
        format!(
            r#"
[[sources]]
name = "{name}"
[sources.postgres]
url = "{url}"
table = "{table}"
slot = "{slot}"
publication = "{slot}"
status_interval = "100ms"
reconnect_backoff_max = "1s"
[sources.routing]
topic = "{prefix}.{{aggregate_type}}"
"#,
            name = self.name,
            url = self.url,
            table = self.table,
            slot = self.slot,
            prefix = self.prefix,
        )
    }
}

fn file(listen: SocketAddr, sources: &[&Src]) -> String {
    let mut text = format!(
        r#"
[kafka]
brokers = "{brokers}"
topic_partitions = 3
topic_replication_factor = 1
admin_timeout = "5s"

[http]
listen = "{listen}"
admin_token = "{TOKEN}"

[health]
poll_interval = "300ms"

[shutdown]
drain_timeout = "10s"
"#,
        brokers = broker().brokers
    );
    for s in sources {
        text.push_str(&s.toml());
    }
    text
}

/// Writes `n` events in one transaction: aggregates `a0`..`a4`, each
/// carrying its per-aggregate sequence number.
pub(crate) async fn write(
    client: &tokio_postgres::Client,
    table: &str,
    seq: &mut HashMap<String, i64>,
    n: usize,
) {
    let mut sql = String::from("BEGIN;");
    for i in 0..n {
        let agg = format!("a{}", i % 5);
        let s = seq.entry(agg.clone()).or_default();
        *s += 1;
        sql.push_str(&format!(
            "INSERT INTO {table} (id, aggregate_type, aggregate_id, type, payload) VALUES ('{}', 'order', '{agg}', 'o.v1', '{{\"seq\": {s}}}');",
            Uuid::new_v4()
        ));
    }
    sql.push_str("COMMIT;");
    client.batch_execute(&sql).await.unwrap();
}

/// Every aggregate's sequence numbers as consumed, in partition order,
/// each event once (by its `id` header: a PostgreSQL restart can replay
/// what the slot had not yet saved as confirmed, and consumers deduplicate
/// by id).
pub(crate) fn sequences(records: &[Consumed]) -> (BTreeMap<String, Vec<i64>>, usize) {
    let mut by_key: BTreeMap<String, Vec<i64>> = BTreeMap::new();
    let mut seen = std::collections::HashSet::new();
    for r in records {
        if !seen.insert(r.header("id").unwrap().to_owned()) {
            continue;
        }
        let v: serde_json::Value = serde_json::from_slice(&r.value).unwrap();
        by_key
            .entry(r.key.clone())
            .or_default()
            .push(v["data"]["seq"].as_i64().unwrap());
    }
    (by_key, seen.len())
}

/// Consumes `src`'s topic until it holds what `seq` says was written, and
/// checks that each aggregate's events arrived, each in order.
async fn all_arrive(src: &Src, seq: &HashMap<String, i64>, within: Duration) {
    arrive_in_order(
        &broker().brokers,
        &src.topic(),
        seq,
        within,
        false,
        &format!("source {}", src.name),
    )
    .await;
}

/// Waits up to `within` until `topic` holds every event `seq` counts (an
/// aggregate's events numbered 1..=n), then asserts each aggregate's events
/// arrived in order and nothing else did; `exactly_once`: each only once
/// (read as `read_committed`). Returns the records read.
pub(crate) async fn arrive_in_order(
    brokers: &str,
    topic: &str,
    seq: &HashMap<String, i64>,
    within: Duration,
    exactly_once: bool,
    what: &str,
) -> usize {
    let want: usize = seq.values().map(|n| *n as usize).sum();
    let deadline = Instant::now() + within;
    let (by_key, unique, total) = loop {
        let (t, b) = (topic.to_owned(), brokers.to_owned());
        let got = tokio::task::spawn_blocking(move || {
            if exactly_once {
                consume(&b, &[&t], want, Duration::from_secs(20))
            } else {
                consume_to_end(&b, &[&t], Duration::from_secs(20))
            }
        })
        .await
        .unwrap();
        let (by_key, unique) = sequences(&got);
        if unique >= want || Instant::now() > deadline {
            break (by_key, unique, got.len());
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    };
    for (agg, n) in seq {
        let expected: Vec<i64> = (1..=*n).collect();
        assert_eq!(
            by_key.get(agg),
            Some(&expected),
            "{what}: aggregate {agg}, every event and in order"
        );
    }
    assert_eq!(unique, want, "{what}: nothing else");
    if exactly_once {
        assert_eq!(total, want, "{what}: exactly-once, each event once");
    }
    total
}

/// The distinct events in `src`'s topic now.
async fn unique_count(src: &Src) -> usize {
    let topic = src.topic();
    let got = tokio::task::spawn_blocking(move || {
        consume_to_end(&broker().brokers, &[&topic], Duration::from_secs(30))
    })
    .await
    .unwrap();
    sequences(&got).1
}

/// The process that holds `slot` (a walsender, streaming or not).
pub(crate) async fn slot_pid(client: &tokio_postgres::Client, slot: &str) -> Option<i32> {
    client
        .query_opt(
            "SELECT active_pid FROM pg_replication_slots WHERE slot_name = $1",
            &[&slot],
        )
        .await
        .unwrap()
        .and_then(|r| r.get(0))
}

/// The walsender streaming `slot`. A slot being created is active too,
/// before its consistent point, and what commits then is never decoded:
/// a test writes only once the walsender streams.
pub(crate) async fn streaming_pid(client: &tokio_postgres::Client, slot: &str) -> Option<i32> {
    client
        .query_opt(
            "SELECT s.active_pid FROM pg_replication_slots s JOIN pg_stat_replication r ON r.pid = s.active_pid
              WHERE s.slot_name = $1 AND r.state = 'streaming'",
            &[&slot],
        )
        .await
        .unwrap()
        .and_then(|r| r.get(0))
}

/// An HTTP request with an optional bearer token: status and body.
pub(crate) async fn http(
    method: &'static str,
    addr: SocketAddr,
    path: &str,
    token: Option<&str>,
) -> (u16, String) {
    let url = format!("http://{addr}{path}");
    let token = token.map(str::to_owned);
    tokio::task::spawn_blocking(move || {
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_global(Some(Duration::from_secs(60)))
            .build()
            .into();
        let auth = token.map(|t| format!("Bearer {t}"));
        let resp = match method {
            "GET" => {
                let mut r = agent.get(&url);
                if let Some(a) = &auth {
                    r = r.header("Authorization", a);
                }
                r.call()
            }
            _ => {
                let mut r = agent.post(&url);
                if let Some(a) = &auth {
                    r = r.header("Authorization", a);
                }
                r.send_empty()
            }
        };
        match resp {
            Ok(mut resp) => (resp.status().as_u16(), resp.body_mut().read_to_string().unwrap()),
            // Not listening yet: code 0.
            Err(e) => (0, e.to_string()),
        }
    })
    .await
    .unwrap()
}

/// Mean commit-to-ack seconds of `source` since `before` (sum, count).
/// The value of `name{source="<source>"}` in Prometheus text (0 if absent).
fn sourced(metrics: &str, name: &str, source: &str) -> f64 {
    let series = format!("{name}{{source=\"{source}\"}} ");
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(&series))
        .and_then(|v| v.parse::<f64>().ok())
        .unwrap_or(0.0)
}

fn mean_since(metrics: &str, source: &str, before: (f64, f64)) -> (f64, (f64, f64)) {
    let read = |name: &str| sourced(metrics, name, source);
    let now = (
        read("outboxd_commit_to_ack_seconds_sum"),
        read("outboxd_commit_to_ack_seconds_count"),
    );
    let count = now.1 - before.1;
    let mean = if count > 0.0 {
        (now.0 - before.0) / count
    } else {
        f64::NAN
    };
    (mean, now)
}

/// The issue's test: three sources on one broker; one database stopped for
/// 30 s while the others stream with their latency; a source added and
/// another removed by SIGHUP while writers run; pause and resume of one
/// source over HTTP, which hold and release only its slot; no token, no
/// verbs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_sources_stream_apart_and_change_without_a_restart() {
    let run = &Uuid::new_v4().simple().to_string()[..6];
    let own: PgServer = postgres::dedicated("");
    outbox_sdk::migrate::migrate(&mut own.client("postgres").await)
        .await
        .unwrap();
    let shared = TestDb::new("sources").await;
    let sql = shared.client().await;
    sql.batch_execute(
        "CREATE TABLE outbox2 (LIKE outbox INCLUDING ALL); CREATE TABLE outbox3 (LIKE outbox INCLUDING ALL);",
    )
    .await
    .unwrap();
    let alpha = Src::new(
        "alpha",
        &own.url("postgres", None, "postgres"),
        "outbox",
        "src",
        run,
    );
    let beta = Src::new("beta", &shared.superuser_url(), "outbox", "src", run);
    let gamma = Src::new("gamma", &beta.url, "outbox2", "src", run);
    let delta = Src::new("delta", &beta.url, "outbox3", "src", run);
    let listen: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let _log_on_failure = LogOnFailure(dir.path().join("outboxd.log"));
    let config = write_config(
        dir.path(),
        "outboxd.toml",
        &file(listen, &[&alpha, &beta, &gamma]),
    );
    let log = dir.path().join("outboxd.log");
    let daemon = Daemon::start_logging(&config, &log, "info");
    let alpha_sql = own.client("postgres").await;
    let ready = || async {
        let (code, body) = http("GET", listen, "/readyz", None).await;
        (code == 200).then_some(body)
    };
    wait_for("every source ready", Duration::from_secs(60), ready).await;

    // Every event of each source arrives, in order per aggregate.
    let (mut sa, mut sb, mut sg) = (HashMap::new(), HashMap::new(), HashMap::new());
    for _ in 0..10 {
        write(&alpha_sql, "outbox", &mut sa, 5).await;
        write(&sql, "outbox", &mut sb, 5).await;
        write(&sql, "outbox2", &mut sg, 5).await;
    }
    all_arrive(&alpha, &sa, Duration::from_secs(60)).await;
    all_arrive(&beta, &sb, Duration::from_secs(60)).await;
    all_arrive(&gamma, &sg, Duration::from_secs(60)).await;
    let (_, metrics) = http("GET", listen, "/metrics", None).await;
    assert!(
        metrics.contains("outboxd_events_published_total{source=\"alpha\"} 50"),
        "{metrics}"
    );
    assert_eq!(
        metrics.matches("# TYPE outboxd_events_published_total").count(),
        1
    );

    // Baseline latency of beta, then alpha's server stops for 30 s.
    let (_, m0) = http("GET", listen, "/metrics", None).await;
    let (_, base0) = mean_since(&m0, "beta", (0.0, 0.0));
    write_for(&sql, "outbox", &mut sb, Duration::from_secs(5)).await;
    all_arrive(&beta, &sb, Duration::from_secs(60)).await;
    let (_, m1) = http("GET", listen, "/metrics", None).await;
    let (baseline, base1) = mean_since(&m1, "beta", base0);
    write(&alpha_sql, "outbox", &mut sa, 5).await; // just before the stop
    drop(alpha_sql);
    own.pg_ctl(&["stop", "-m", "fast"]).unwrap();
    let down = Instant::now();
    let beta_pid = slot_pid(&sql, &beta.slot).await;
    let gamma_pid = slot_pid(&sql, &gamma.slot).await;
    while down.elapsed() < Duration::from_secs(30) {
        write(&sql, "outbox", &mut sb, 5).await;
        write(&sql, "outbox2", &mut sg, 5).await;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    all_arrive(&beta, &sb, Duration::from_secs(60)).await;
    all_arrive(&gamma, &sg, Duration::from_secs(60)).await;
    let (code, body) = http("GET", listen, "/readyz", None).await;
    assert_eq!(code, 503, "alpha is required: {body}");
    assert!(body.contains("alpha: ") && !body.contains("beta: "), "{body}");
    let (_, m2) = http("GET", listen, "/metrics", None).await;
    let (outage, _) = mean_since(&m2, "beta", base1);
    eprintln!(
        "sources: beta commit-to-ack mean {:.1} ms before, {:.1} ms with alpha's server down (ratio {:.2})",
        baseline * 1e3,
        outage * 1e3,
        outage / baseline
    );
    assert!(
        outage < baseline * 4.0 + 0.05,
        "beta's latency holds while alpha is down: {baseline} s -> {outage} s"
    );
    assert_eq!(
        slot_pid(&sql, &beta.slot).await,
        beta_pid,
        "beta was never restarted"
    );
    assert_eq!(
        slot_pid(&sql, &gamma.slot).await,
        gamma_pid,
        "gamma was never restarted"
    );
    own.pg_ctl(&["start", "-w", "-l", &own.log_file.display().to_string()])
        .unwrap();
    let alpha_sql = own.client("postgres").await;
    write(&alpha_sql, "outbox", &mut sa, 5).await;
    all_arrive(&alpha, &sa, Duration::from_secs(90)).await;
    wait_for("ready again", Duration::from_secs(60), ready).await;

    // SIGHUP with writers running: delta is added, gamma removed, beta untouched.
    let beta_pid = slot_pid(&sql, &beta.slot).await;
    assert!(beta_pid.is_some());
    write_config(
        dir.path(),
        "outboxd.toml",
        &file(listen, &[&alpha, &beta, &delta]),
    );
    let writer = {
        let client = shared.client().await;
        let mut seq = std::mem::take(&mut sb);
        tokio::spawn(async move {
            write_for(&client, "outbox", &mut seq, Duration::from_secs(6)).await;
            seq
        })
    };
    let mut sd = HashMap::new();
    daemon.signal("HUP");
    wait_for("gamma's slot released", Duration::from_secs(30), || async {
        slot_pid(&sql, &gamma.slot).await.is_none().then_some(())
    })
    .await;
    // A new source streams from the moment its slot exists.
    wait_for("delta streaming", Duration::from_secs(30), || async {
        streaming_pid(&sql, &delta.slot).await.map(|_| ())
    })
    .await;
    write(&sql, "outbox3", &mut sd, 25).await;
    write(&sql, "outbox2", &mut sg, 5).await; // gamma is gone: not published
    sb = writer.await.unwrap();
    all_arrive(&beta, &sb, Duration::from_secs(60)).await;
    all_arrive(&delta, &sd, Duration::from_secs(60)).await;
    assert_eq!(
        slot_pid(&sql, &beta.slot).await,
        beta_pid,
        "beta was untouched by the reload"
    );
    let gamma_count = unique_count(&gamma).await;
    let gamma_sent: i64 = sg.values().sum();
    assert_eq!(
        gamma_count as i64,
        gamma_sent - 5,
        "a removed source publishes nothing"
    );

    // A file that fails validation changes nothing.
    write_config(
        dir.path(),
        "outboxd.toml",
        &file(listen, &[&alpha, &beta, &delta]).replace("name = \"delta\"", "name = \"Delta!\""),
    );
    daemon.signal("HUP");
    wait_for("the refused reload logged", Duration::from_secs(10), || async {
        std::fs::read_to_string(&log)
            .unwrap_or_default()
            .contains("reload refused")
            .then_some(())
    })
    .await;
    write(&sql, "outbox3", &mut sd, 5).await;
    all_arrive(&delta, &sd, Duration::from_secs(60)).await;

    // The verbs need the token.
    for token in [None, Some("wrong-token-wrong-token-wrong")] {
        let (code, _) = http("POST", listen, "/sources/beta/pause", token).await;
        assert_eq!(code, 401, "{token:?}");
        let (code, _) = http("GET", listen, "/sources", token).await;
        assert_eq!(code, 401, "{token:?}");
    }
    let (code, body) = http("GET", listen, "/sources", Some(TOKEN)).await;
    assert_eq!(code, 200);
    let list: serde_json::Value = serde_json::from_str(&body).unwrap();
    let names: Vec<&str> = list
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["alpha", "beta", "delta"]);
    let (code, _) = http("POST", listen, "/sources/nope/pause", Some(TOKEN)).await;
    assert_eq!(code, 404);

    // Pause holds only beta's slot; resume releases it.
    let alpha_pid = slot_pid(&alpha_sql, &alpha.slot).await;
    let delta_pid = slot_pid(&sql, &delta.slot).await;
    let (code, body) = http("POST", listen, "/sources/beta/pause", Some(TOKEN)).await;
    assert_eq!(code, 200, "{body}");
    let paused: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(paused["state"], "paused");
    assert_eq!(
        slot_pid(&sql, &beta.slot).await,
        None,
        "beta's slot is not streamed"
    );
    let confirmed_before = confirmed_flush(&sql, &beta.slot).await;
    let published_before: i64 = sb.values().sum();
    let retained = |text: &str| sourced(text, "outboxd_slot_retained_wal_bytes", "beta");
    let retained_at_pause = retained(&http("GET", listen, "/metrics", None).await.1);
    write(&sql, "outbox", &mut sb, 10).await;
    write(&sql, "outbox3", &mut sd, 5).await;
    all_arrive(&delta, &sd, Duration::from_secs(60)).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let beta_count = unique_count(&beta).await;
    assert_eq!(
        beta_count as i64, published_before,
        "nothing of paused beta is published"
    );
    let confirmed_paused = confirmed_flush(&sql, &beta.slot).await;
    assert_eq!(
        confirmed_paused, confirmed_before,
        "the paused slot keeps its WAL"
    );
    // The paused slot's retained WAL is still watched (the alert sees it).
    sql.batch_execute("SELECT pg_switch_wal()").await.unwrap();
    wait_for(
        "the paused slot's retained WAL grows",
        Duration::from_secs(20),
        || async {
            let now = retained(&http("GET", listen, "/metrics", None).await.1);
            (now > retained_at_pause).then_some(())
        },
    )
    .await;
    let (code, body) = http("GET", listen, "/readyz", None).await;
    assert_eq!(code, 503, "beta is required: {body}");
    assert!(body.contains("beta: paused"), "{body}");
    assert_eq!(
        slot_pid(&alpha_sql, &alpha.slot).await,
        alpha_pid,
        "alpha untouched"
    );
    assert_eq!(slot_pid(&sql, &delta.slot).await, delta_pid, "delta untouched");
    let (code, body) = http("POST", listen, "/sources/beta/resume", Some(TOKEN)).await;
    assert_eq!(code, 200, "{body}");
    all_arrive(&beta, &sb, Duration::from_secs(60)).await;
    wait_for("beta streams again", Duration::from_secs(30), || async {
        streaming_pid(&sql, &beta.slot).await.map(|_| ())
    })
    .await;
    let (code, body) = http("GET", listen, "/sources/beta", Some(TOKEN)).await;
    assert_eq!(code, 200);
    let one: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(one["state"], "running", "{body}");
    assert_eq!(one["slot"], beta.slot.as_str());

    let status = daemon.sigterm();
    assert!(status.success(), "a clean stop: {status:?}");
    for slot in [&beta.slot, &delta.slot] {
        assert_eq!(slot_pid(&sql, slot).await, None);
    }
}

/// `run --source NAME` runs that one source, also after SIGHUP.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_with_source_keeps_to_it_across_reloads() {
    let run = &Uuid::new_v4().simple().to_string()[..6];
    let db = TestDb::new("sources_one").await;
    let sql = db.client().await;
    sql.batch_execute("CREATE TABLE outbox2 (LIKE outbox INCLUDING ALL)")
        .await
        .unwrap();
    let a = Src::new("alpha", &db.superuser_url(), "outbox", "one", run);
    let b = Src::new("beta", &a.url, "outbox2", "one", run);
    let listen: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("outboxd.log");
    let _log_on_failure = LogOnFailure(log.clone());
    let config = write_config(dir.path(), "outboxd.toml", &file(listen, &[&a, &b]));
    let out = std::fs::File::create(&log).unwrap();
    let child = crate::harness::Reaped::new(
        std::process::Command::new(env!("CARGO_BIN_EXE_outboxd"))
            .args(["run", "--source", "alpha", "--config"])
            .arg(&config)
            .env("RUST_LOG", "info")
            .stdin(std::process::Stdio::null())
            .stdout(out.try_clone().unwrap())
            .stderr(out)
            .spawn()
            .unwrap(),
    );
    wait_for("alpha streaming", Duration::from_secs(60), || async {
        streaming_pid(&sql, &a.slot).await.map(|_| ())
    })
    .await;
    let sources = |body: String| -> Vec<String> {
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        v["sources"].as_object().unwrap().keys().cloned().collect()
    };
    assert_eq!(sources(http("GET", listen, "/status", None).await.1), ["alpha"]);
    let pid = child.id().to_string();
    let hup = std::process::Command::new("kill")
        .args(["-HUP", &pid])
        .status()
        .unwrap();
    assert!(hup.success());
    wait_for("the reload logged", Duration::from_secs(10), || async {
        std::fs::read_to_string(&log)
            .unwrap_or_default()
            .contains("reloading the config file")
            .then_some(())
    })
    .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(sources(http("GET", listen, "/status", None).await.1), ["alpha"]);
    let beta_slot = sql
        .query_opt(
            "SELECT 1 FROM pg_replication_slots WHERE slot_name = $1",
            &[&b.slot],
        )
        .await
        .unwrap();
    assert!(beta_slot.is_none(), "beta is never started by this process");
    let mut seq = HashMap::new();
    write(&sql, "outbox", &mut seq, 10).await;
    all_arrive(&a, &seq, Duration::from_secs(60)).await;
    let _ = std::process::Command::new("kill").args(["-TERM", &pid]).status();
    let mut child = child.into_inner();
    assert!(child.wait().unwrap().success(), "a clean stop");
}

/// Prints outboxd's log when the test fails.
pub(crate) struct LogOnFailure(pub(crate) std::path::PathBuf);

impl Drop for LogOnFailure {
    fn drop(&mut self) {
        if std::thread::panicking() {
            let log = std::fs::read_to_string(&self.0).unwrap_or_default();
            let tail: Vec<&str> = log.lines().rev().take(60).collect();
            eprintln!("--- outboxd log (last 60 lines) ---");
            for l in tail.iter().rev() {
                eprintln!("{l}");
            }
        }
    }
}

/// Writes 5 events every 50 ms for `d`.
async fn write_for(
    client: &tokio_postgres::Client,
    table: &str,
    seq: &mut HashMap<String, i64>,
    d: Duration,
) {
    let end = Instant::now() + d;
    while Instant::now() < end {
        write(client, table, seq, 5).await;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// SIGTERM is heard while the supervisor waits for a drain. A source whose
/// server accepts connections but never answers cannot drain until its
/// deadline (`drain_timeout` + 30 s); a pause of it, then SIGTERM: the
/// other source stops at once (Kubernetes' SIGKILL after its grace period
/// must not find it streaming), and outboxd exits once the stuck one is
/// aborted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_during_a_pause_drain_stops_every_source_at_once() {
    let run = &Uuid::new_v4().simple().to_string()[..6];
    let db = TestDb::new("sigdrain").await;
    let sql = db.client().await;
    // Accepts (the kernel's backlog) and never answers.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let silent_url = format!(
        "postgres://postgres@{}/stuck?connect_timeout=120",
        silent.local_addr().unwrap()
    );
    let healthy = Src::new("healthy", &db.superuser_url(), "outbox", "sd", run);
    let stuck = Src::new("stuck", &silent_url, "outbox", "sd", run);
    let listen: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("outboxd.log");
    let _log_on_failure = LogOnFailure(log.clone());
    let text = file(listen, &[&healthy, &stuck]).replace("drain_timeout = \"10s\"", "drain_timeout = \"2s\"");
    let config = write_config(dir.path(), "outboxd.toml", &text);
    let mut daemon = Daemon::start_logging(&config, &log, "info");
    wait_for("healthy streaming", Duration::from_secs(60), || async {
        streaming_pid(&sql, &healthy.slot).await
    })
    .await;
    let mut seq = HashMap::new();
    write(&sql, "outbox", &mut seq, 10).await;
    all_arrive(&healthy, &seq, Duration::from_secs(60)).await;

    // The pause waits for the stuck source's drain; SIGTERM meanwhile.
    let pause = tokio::spawn(async move { http("POST", listen, "/sources/stuck/pause", Some(TOKEN)).await });
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(!pause.is_finished(), "the stuck source's drain is under way");
    write(&sql, "outbox", &mut seq, 10).await;
    let term = Instant::now();
    daemon.signal("TERM");
    wait_for("healthy's slot released", Duration::from_secs(10), || async {
        slot_pid(&sql, &healthy.slot).await.is_none().then_some(())
    })
    .await;
    let released = term.elapsed();
    assert!(
        released < Duration::from_secs(5),
        "healthy streamed {released:?} after SIGTERM"
    );
    let exited = loop {
        if let Some(status) = daemon.try_wait() {
            break status;
        }
        assert!(term.elapsed() < Duration::from_secs(45), "outboxd did not exit");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(exited.success(), "{exited}");
    let (code, _) = pause.await.unwrap();
    assert_ne!(code, 200, "the pause did not complete: outboxd stopped");
    // What healthy had before the SIGTERM arrived (drained, or published
    // again at the next start: nothing lost).
    let mut daemon = Daemon::start_logging(&config, &log, "info");
    all_arrive(&healthy, &seq, Duration::from_secs(60)).await;
    daemon.kill9();
    drop(silent);
}
