//! Time travel through the accounts service: the latency of
//! `GET /accounts/{id}/state?at=` on an account with 10,000 events and a
//! snapshot every 100 versions, beside the same answer computed in this
//! process without HTTP, and beside the seed's replay without snapshots.
//!
//! ```sh
//! scripts/bench-accounts.sh                    # 10,000 events, 2,000 requests
//! scripts/bench-accounts.sh --events 100000 --requests 5000
//! ```
//!
//! Each run asks for the same `at` moments (spread evenly over the
//! account's history, in a shuffled order) after a warm-up of 200:
//!
//! a. the service over HTTP (keep-alive), one client at a time;
//! b. the service over HTTP, 4 clients at once;
//! c. `AccountStore::state_at` in this process (the latest snapshot at or
//!    before the version, then the events after it): the floor under (a);
//! d. the seed's way: read every event up to the version and replay them
//!    all (no snapshot).
//!
//! Results: a markdown table on stdout and JSON in
//! target/bench/accounts.json. All four run side by side on one machine;
//! the ratios are the figures to trust.

#![allow(clippy::unwrap_used, clippy::expect_used, missing_debug_implementations)]

#[path = "../../tests/integration/harness/mod.rs"]
#[allow(dead_code)]
mod harness;

use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use outbox_sdk::accounts::{Account, AccountStore};
use outbox_sdk::event_store::EventStore;
use outbox_sdk::outbox::Headers;
use serde_json::{json, Value};

const WARMUP: usize = 200;
const SNAPSHOT_EVERY: i64 = 100;

struct Args {
    events: i64,
    requests: usize,
}

fn args() -> Args {
    let mut a = Args {
        events: 10_000,
        requests: 2_000,
    };
    let argv: Vec<String> = std::env::args().collect();
    for w in argv.windows(2) {
        match w[0].as_str() {
            "--events" => a.events = w[1].parse().expect("a number after --events"),
            "--requests" => a.requests = w[1].parse().expect("a number after --requests"),
            _ => {}
        }
    }
    a
}

/// Latencies in milliseconds: p50, p90, p99, max.
fn summary(mut ms: Vec<f64>) -> Value {
    ms.sort_by(f64::total_cmp);
    let q = |p: f64| ms[((ms.len() as f64 * p).ceil() as usize).clamp(1, ms.len()) - 1];
    json!({"n": ms.len(), "p50": q(0.50), "p90": q(0.90), "p99": q(0.99), "max": q(1.0)})
}

fn timed<T>(f: impl FnOnce() -> T) -> (T, f64) {
    let start = Instant::now();
    let v = f();
    (v, start.elapsed().as_secs_f64() * 1e3)
}

fn agent() -> ureq::Agent {
    ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_secs(30)))
        .build()
        .into()
}

/// One request; checks the answer's version against the expected one.
fn ask(http: &ureq::Agent, base: &str, at: &DateTime<Utc>, want_version: i64) -> f64 {
    let url = format!(
        "{base}/accounts/acc-bench/state?at={}",
        at.to_rfc3339_opts(chrono::SecondsFormat::Micros, true)
    );
    let (body, ms) = timed(|| {
        let mut r = http.get(&url).call().unwrap();
        assert_eq!(r.status().as_u16(), 200);
        r.body_mut().read_to_string().unwrap()
    });
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["version"], want_version, "{body}");
    ms
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let a = args();
    eprintln!("bench: starting PostgreSQL and the broker");
    let pg = harness::postgres::dedicated("");
    let broker = harness::broker::dedicated();
    let mut client = pg.client("postgres").await;
    outbox_sdk::migrate::migrate(&mut client).await.unwrap();

    // One account, `events` events: 100 deposits per command, so each
    // command crosses one snapshot point and leaves a snapshot.
    eprintln!("bench: writing {} events to acc-bench", a.events);
    let store = AccountStore::new(EventStore::with_snapshot_every(SNAPSHOT_EVERY));
    {
        let tx = client.transaction().await.unwrap();
        let mut account = Account::open("acc-bench", "owner", 0).unwrap();
        store.save(&tx, &mut account, &Headers::new()).await.unwrap();
        tx.commit().await.unwrap();
    }
    let mut version = 1;
    while version < a.events {
        let n = (a.events - version).min(SNAPSHOT_EVERY);
        store
            .update(&mut client, "acc-bench", 1, &Headers::new(), |acc| {
                for i in 0..n {
                    acc.deposit(1 + i % 7, "bench")?;
                }
                Ok(())
            })
            .await
            .unwrap();
        version += n;
    }
    for table in ["events", "snapshots"] {
        client
            .batch_execute(&format!("VACUUM ANALYZE {table}"))
            .await
            .unwrap();
    }
    let snapshots: i64 = client
        .query_one("SELECT count(*) FROM snapshots", &[])
        .await
        .unwrap()
        .get(0);
    let times: Vec<DateTime<Utc>> = client
        .query(
            "SELECT occurred_at FROM events WHERE aggregate_id = 'acc-bench' ORDER BY version",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    // The moments asked for: evenly over the history, each one an event's
    // own time, shuffled so that neighbours are not asked in a row.
    let total = WARMUP + a.requests;
    // The version expected at a moment: the events that occurred by then
    // (one writer here, so the times rise with the versions; several events
    // of one command can share a microsecond).
    let mut moments: Vec<(DateTime<Utc>, i64)> = (0..total)
        .map(|i| {
            let t = times[(i * 7919) % times.len()];
            (t, times.partition_point(|x| *x <= t) as i64)
        })
        .collect();
    let mut rng = 0x9E37_79B9_7F4A_7C15u64;
    for i in (1..moments.len()).rev() {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        moments.swap(i, (rng % (i as u64 + 1)) as usize);
    }

    eprintln!("bench: starting the accounts service");
    let url = pg.url("postgres", None, "postgres");
    let snapshot_every = SNAPSHOT_EVERY.to_string();
    let (mut child, base) = harness::spawn_example_server(
        "accounts_service",
        &[
            "--database-url",
            &url,
            "--brokers",
            &broker.brokers,
            "--listen",
            "127.0.0.1:0",
            "--snapshot-every",
            &snapshot_every,
            "--dlq-replication-factor",
            "1",
        ],
    );

    let mut results = serde_json::Map::new();
    // a. one client.
    let sequential = {
        let (base, moments) = (base.clone(), moments.clone());
        tokio::task::spawn_blocking(move || {
            let http = agent();
            let ms: Vec<f64> = moments.iter().map(|(t, v)| ask(&http, &base, t, *v)).collect();
            summary(ms[WARMUP..].to_vec())
        })
        .await
        .unwrap()
    };
    results.insert("service_1_client".into(), sequential);
    // b. four clients, the same moments split between them.
    let concurrent = {
        let mut threads = Vec::new();
        for c in 0..4 {
            let (base, mine): (String, Vec<_>) = (
                base.clone(),
                moments[WARMUP..].iter().skip(c).step_by(4).cloned().collect(),
            );
            threads.push(std::thread::spawn(move || {
                let http = agent();
                mine.iter()
                    .map(|(t, v)| ask(&http, &base, t, *v))
                    .collect::<Vec<f64>>()
            }));
        }
        summary(threads.into_iter().flat_map(|t| t.join().unwrap()).collect())
    };
    results.insert("service_4_clients".into(), concurrent);
    // c. in process, with snapshots.
    let mut ms = Vec::new();
    for (t, v) in &moments {
        let start = Instant::now();
        let state = store.state_at(&client, "acc-bench", *t).await.unwrap().unwrap();
        ms.push(start.elapsed().as_secs_f64() * 1e3);
        assert_eq!(state.version, *v);
    }
    results.insert("in_process_snapshots".into(), summary(ms[WARMUP..].to_vec()));
    // d. in process, the seed's full replay.
    let events = EventStore::default();
    let key = outbox_sdk::accounts::key("acc-bench");
    let mut ms = Vec::new();
    for (t, v) in &moments {
        let start = Instant::now();
        let history = events.read_at(&client, key, *t).await.unwrap();
        let account = Account::from_history("acc-bench", &history).unwrap();
        ms.push(start.elapsed().as_secs_f64() * 1e3);
        assert_eq!(account.version(), *v);
    }
    results.insert("in_process_full_replay".into(), summary(ms[WARMUP..].to_vec()));
    let _ = child.kill();
    let _ = child.wait();

    println!(
        "\n## Time travel: GET /accounts/{{id}}/state?at= ({} events, a snapshot every {SNAPSHOT_EVERY}: {snapshots} snapshots; {} requests each)\n",
        a.events, a.requests
    );
    println!("| run | p50 ms | p90 ms | p99 ms | max ms |");
    println!("|---|---|---|---|---|");
    for (name, label) in [
        ("service_1_client", "service over HTTP, 1 client"),
        ("service_4_clients", "service over HTTP, 4 clients"),
        (
            "in_process_snapshots",
            "`state_at` in process (snapshot + events after it)",
        ),
        (
            "in_process_full_replay",
            "in process, every event replayed (no snapshot)",
        ),
    ] {
        let r = &results[name];
        println!(
            "| {label} | {:.2} | {:.2} | {:.2} | {:.2} |",
            r["p50"].as_f64().unwrap(),
            r["p90"].as_f64().unwrap(),
            r["p99"].as_f64().unwrap(),
            r["max"].as_f64().unwrap()
        );
    }
    let p99 = |n: &str| results[n]["p99"].as_f64().unwrap();
    println!(
        "\np99: service / in process {:.2}x; full replay / snapshots {:.1}x; target for the service: under 20 ms ({})",
        p99("service_1_client") / p99("in_process_snapshots"),
        p99("in_process_full_replay") / p99("in_process_snapshots"),
        if p99("service_1_client") < 20.0 { "met" } else { "NOT met" }
    );
    let out = std::path::Path::new(&std::env::var("CARGO_TARGET_DIR").unwrap_or_else(|_| "target".into()))
        .join("bench");
    std::fs::create_dir_all(&out).unwrap();
    let json = json!({"events": a.events, "snapshot_every": SNAPSHOT_EVERY, "snapshots": snapshots, "requests": a.requests, "results": results});
    std::fs::write(
        out.join("accounts.json"),
        serde_json::to_string_pretty(&json).unwrap(),
    )
    .unwrap();
}
