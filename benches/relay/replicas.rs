//! Sources spread over replicas (`--only-replicas`): twelve sources, each
//! with a backlog of `n / 12` events, drained by one outboxd (no
//! `[coordination]`, today's shape), then by two and by three replicas of
//! one file with `[coordination]`, then by one again (so the broker's
//! warm-up favours neither side). Reported: the total drain rate (from the
//! first process's start to every slot confirmed and every event in
//! Kafka, group join and settling included), CPU per 100k events summed
//! over the replicas, the largest replica's peak RSS, and how many sources
//! each replica led.
//!
//! Every replica runs on the same 2 cores as PostgreSQL (twelve walsenders
//! decoding the same WAL) and the broker, so more replicas add no CPU:
//! the figure says what the spread costs, not what more machines give.

use std::path::Path;
use std::process::Command;

use serde_json::{json, Value};

use super::harness::postgres::free_port;
use super::measure::{started_at, unix_now, usage};
use super::relays::Setting;
use super::sources::{backlogs, start, wait_drained};
use super::{drop_slot, PARTITIONS};

const SOURCES: usize = 12;

fn table(i: usize) -> String {
    format!("outbox_r{i}")
}

fn config(s: &Setting, tag: &str, http_port: u16, coordinated: bool, replica: usize) -> String {
    let mut text = format!(
        "[kafka]\nbrokers = \"{}\"\ntopic_partitions = {PARTITIONS}\ntopic_replication_factor = 1\n{}\n[http]\nlisten = \"127.0.0.1:{http_port}\"\n[log]\nlevel = \"warn\"\n",
        s.brokers,
        s.outboxd_kafka.join("\n"),
    );
    if coordinated {
        text.push_str(&format!(
            "[coordination]\ngroup = \"bench-replicas-{tag}\"\nreplica = \"r{replica}\"\nsession_timeout = \"6s\"\n"
        ));
    }
    for i in 0..SOURCES {
        text.push_str(&format!(
            r#"
[[sources]]
name = "s{i}"
[sources.postgres]
url = "postgres://postgres@127.0.0.1:{pg}/postgres?sslmode=disable"
table = "{table}"
slot = "rep_{tag}_{i}"
publication = "rep_{i}"
[sources.routing]
topic = "rep{tag}-{i}-{{aggregate_type}}"
"#,
            pg = s.pg_port,
            table = table(i),
        ));
    }
    text
}

/// How many sources the replica on `port` streams.
fn leading(port: u16) -> usize {
    ureq::get(&format!("http://127.0.0.1:{port}/status"))
        .call()
        .ok()
        .and_then(|mut r| r.body_mut().read_to_string().ok())
        .and_then(|b| serde_json::from_str::<Value>(&b).ok())
        .map(|v| {
            v["sources"]
                .as_object()
                .map(|m| {
                    m.values()
                        .filter(|s| s["state"] == "running" && s["streaming"] == true)
                        .count()
                })
                .unwrap_or(0)
        })
        .unwrap_or(0)
}

struct Run {
    replicas: usize,
    events: usize,
    secs: f64,
    /// From the first start until every source was led.
    startup: f64,
    cpu_s: f64,
    rss_mib: f64,
    led: Vec<usize>,
}

async fn drain(
    client: &mut tokio_postgres::Client,
    s: &Setting,
    replicas: usize,
    tag: &str,
    per_source: usize,
) -> Run {
    let topics: Vec<String> = (0..SOURCES).map(|i| format!("rep{tag}-{i}-order")).collect();
    let tables: Vec<(String, String)> = (0..SOURCES)
        .map(|i| (table(i), format!("rep_{tag}_{i}")))
        .collect();
    let targets = backlogs(client, s, &tables, &topics, per_source).await;
    eprintln!("bench: replicas: {replicas} replica(s), {SOURCES} sources of {per_source} events each");
    let coordinated = replicas > 1;
    let mut children = Vec::new();
    for r in 0..replicas {
        let port = free_port();
        let path = s.dir.join(format!("rep-{tag}-{r}.toml"));
        std::fs::write(&path, config(s, tag, port, coordinated, r)).unwrap();
        children.push((
            start(
                Path::new(env!("CARGO_BIN_EXE_outboxd")),
                s,
                &path,
                &format!("rep-{tag}-{r}.log"),
            ),
            port,
        ));
    }
    let mut led = vec![0; replicas];
    let mut all_led: Option<f64> = None;
    wait_drained(client, s, &targets, &topics, per_source * SOURCES, || {
        let now: Vec<usize> = children
            .iter()
            .map(|(_, port)| tokio::task::block_in_place(|| leading(*port)))
            .collect();
        for (r, n) in now.iter().enumerate() {
            led[r] = led[r].max(*n);
        }
        if all_led.is_none() && now.iter().sum::<usize>() == SOURCES {
            all_led = Some(unix_now());
        }
    })
    .await;
    let first = children
        .iter()
        .map(|(c, _)| started_at(c.id()))
        .fold(f64::INFINITY, f64::min);
    let secs = unix_now() - first;
    let startup = all_led.map_or(secs, |t| t - first);
    let (mut cpu_s, mut rss_mib) = (0.0, 0.0_f64);
    for (c, _) in &children {
        let (rss, cpu) = usage(c.id());
        cpu_s += cpu;
        rss_mib = rss_mib.max(rss);
    }
    for (c, _) in &mut children {
        let _ = Command::new("kill").args(["-TERM", &c.id().to_string()]).status();
    }
    for (c, _) in &mut children {
        let _ = c.wait();
    }
    for (slot, _) in &targets {
        drop_slot(client, slot).await;
    }
    Run {
        replicas,
        events: per_source * SOURCES,
        secs,
        startup,
        cpu_s,
        rss_mib,
        led,
    }
}

pub async fn run(client: &mut tokio_postgres::Client, s: &Setting, n: usize) -> Value {
    for i in 0..SOURCES {
        client
            .batch_execute(&format!(
                "CREATE TABLE IF NOT EXISTS {} (LIKE outbox INCLUDING ALL); DROP PUBLICATION IF EXISTS rep_{i}; CREATE PUBLICATION rep_{i} FOR TABLE {}",
                table(i),
                table(i)
            ))
            .await
            .unwrap();
    }
    let per_source = (n / SOURCES).max(1);
    let mut runs = Vec::new();
    for (tag, replicas) in [("1a", 1), ("2", 2), ("3", 3), ("1b", 1)] {
        runs.push(drain(client, s, replicas, tag, per_source).await);
    }
    println!("| replicas | events | drain (total) | every source led after | drain once led | CPU per 100k events (all replicas) | largest peak RSS | sources led per replica |");
    println!("|---|---|---|---|---|---|---|---|");
    for r in &runs {
        println!(
            "| {} | {} | {:.0} events/s | {:.1} s | {:.0} events/s | {:.2} core-s | {:.1} MiB | {:?} |",
            r.replicas,
            r.events,
            r.events as f64 / r.secs,
            r.startup,
            r.events as f64 / (r.secs - r.startup).max(0.001),
            r.cpu_s / (r.events as f64 / 100_000.0),
            r.rss_mib,
            r.led
        );
    }
    let rate = |r: &Run| r.events as f64 / r.secs;
    let one = runs
        .iter()
        .filter(|r| r.replicas == 1)
        .map(rate)
        .fold(0.0, f64::max);
    for k in [2, 3] {
        if let Some(r) = runs.iter().find(|r| r.replicas == k) {
            println!("{k} replicas beside one: total rate {:.2}x", rate(r) / one);
        }
    }
    json!({"drains": runs.iter().map(|r| json!({
        "replicas": r.replicas, "events": r.events, "seconds": r.secs,
        "events_per_second": rate(r), "cpu_seconds": r.cpu_s, "startup_seconds": r.startup,
        "cpu_seconds_per_100k_events": r.cpu_s / (r.events as f64 / 100_000.0),
        "largest_peak_rss_mib": r.rss_mib, "sources_led": r.led,
    })).collect::<Vec<_>>()})
}
