//! Many sources in one process (`--sources`, or `--only-sources` for this
//! table alone): one outboxd drains one backlog of `n` events from one
//! source, then one outboxd drains three backlogs of `n` at once, from
//! three sources (three outbox tables, three slots and publications, one
//! database). Reported side by side: the total rate, CPU per 100k events,
//! the process's peak RSS and what each source adds to it.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use super::harness::postgres::free_port;
use super::measure::{started_at, unix_now, usage};
use super::relays::Setting;
use super::{confirmed, create_slot, drop_slot, harness, watch, write_rows_into, Shape, PARTITIONS};

/// One drain of `sources` backlogs of `n` events each, by one process.
struct Run {
    sources: usize,
    events: usize,
    secs: f64,
    rss_mib: f64,
    cpu_s: f64,
}

impl Run {
    fn rate(&self) -> f64 {
        self.events as f64 / self.secs
    }

    fn cpu_per_100k(&self) -> f64 {
        self.cpu_s / (self.events as f64 / 100_000.0)
    }
}

fn table(i: usize) -> String {
    if i == 0 {
        "outbox".to_owned()
    } else {
        format!("outbox_s{i}")
    }
}

fn config(s: &Setting, sources: usize, tag: &str, http_port: u16) -> String {
    let mut text = format!(
        "[kafka]\nbrokers = \"{}\"\ntopic_partitions = {PARTITIONS}\ntopic_replication_factor = 1\n{}\n[http]\nlisten = \"127.0.0.1:{http_port}\"\n[log]\nlevel = \"warn\"\n",
        s.brokers,
        s.outboxd_kafka.join("\n"),
    );
    for i in 0..sources {
        text.push_str(&format!(
            r#"
[[sources]]
name = "s{i}"
[sources.postgres]
url = "postgres://postgres@127.0.0.1:{pg}/postgres?sslmode=disable"
table = "{table}"
slot = "many_{tag}_{i}"
publication = "many_{i}"
[sources.routing]
topic = "many{tag}-{i}-{{aggregate_type}}"
"#,
            pg = s.pg_port,
            table = table(i),
        ));
    }
    text
}

async fn drain(client: &mut tokio_postgres::Client, s: &Setting, sources: usize, tag: &str, n: usize) -> Run {
    let topics: Vec<String> = (0..sources).map(|i| format!("many{tag}-{i}-order")).collect();
    {
        let (brokers, topics) = (s.brokers.clone(), topics.clone());
        tokio::task::spawn_blocking(move || harness::broker::create_topics_with(&brokers, &topics, &[]))
            .await
            .unwrap();
    }
    let mut targets = Vec::new();
    for i in 0..sources {
        client
            .batch_execute(&format!("TRUNCATE {}", table(i)))
            .await
            .unwrap();
        let slot = format!("many_{tag}_{i}");
        create_slot(client, &slot).await;
        targets.push((slot, write_rows_into(client, &table(i), n, Shape::STANDARD).await));
    }
    eprintln!("bench: sources: {sources} source(s) of {n} events each");
    let http_port = free_port();
    let path = s.dir.join(format!("many-{tag}.toml"));
    std::fs::write(&path, config(s, sources, tag, http_port)).unwrap();
    let log = std::fs::File::create(s.dir.join(format!("many-{tag}.log"))).unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_outboxd"))
        .args(["run", "--config"])
        .arg(&path)
        .env_remove("RUST_LOG")
        .stdin(Stdio::null())
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .spawn()
        .unwrap();
    let pid = child.id();
    let wm = watch::client(&s.brokers);
    let deadline = Instant::now() + Duration::from_secs(3600);
    loop {
        let mut done = true;
        for (slot, target) in &targets {
            done &= confirmed(client, slot).await >= *target;
        }
        let in_kafka: i64 = tokio::task::block_in_place(|| {
            topics
                .iter()
                .map(|t| watch::high_watermarks(&wm, t, PARTITIONS).iter().sum::<i64>())
                .sum()
        });
        if done && in_kafka >= (n * sources) as i64 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{sources} sources did not drain within an hour"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let secs = unix_now() - started_at(pid);
    let (rss_mib, cpu_s) = usage(pid);
    let _ = Command::new("kill").args(["-TERM", &pid.to_string()]).status();
    let _ = child.wait();
    for (slot, _) in &targets {
        drop_slot(client, slot).await;
    }
    Run {
        sources,
        events: n * sources,
        secs,
        rss_mib,
        cpu_s,
    }
}

/// Runs one source, then three; a markdown table on stdout and JSON.
pub async fn run(client: &mut tokio_postgres::Client, s: &Setting, n: usize) -> Value {
    // Each source's table and publication exist before its slot: a slot
    // decodes with the catalog of its own past.
    for i in 0..3 {
        if i > 0 {
            client
                .batch_execute(&format!(
                    "CREATE TABLE IF NOT EXISTS {} (LIKE outbox INCLUDING ALL)",
                    table(i)
                ))
                .await
                .unwrap();
        }
        client
            .batch_execute(&format!("CREATE PUBLICATION many_{i} FOR TABLE {}", table(i)))
            .await
            .unwrap();
    }
    // One source drains first and again last, so the broker's warming up
    // favours neither side; the ratios use the faster one-source drain.
    let first = drain(client, s, 1, "1a", n).await;
    let three = drain(client, s, 3, "3", n).await;
    let last = drain(client, s, 1, "1b", n).await;
    let one = if last.rate() > first.rate() { &last } else { &first };
    println!("| sources | events | drain (total) | CPU per 100k events | peak RSS | RSS per source |");
    println!("|---|---|---|---|---|---|");
    for r in [&first, &three, &last] {
        println!(
            "| {} | {} | {:.0} events/s | {:.2} core-s | {:.1} MiB | {:.1} MiB |",
            r.sources,
            r.events,
            r.rate(),
            r.cpu_per_100k(),
            r.rss_mib,
            r.rss_mib / r.sources as f64
        );
    }
    let added = (three.rss_mib - one.rss_mib) / 2.0;
    println!(
        "three sources beside one: total rate {:.2}x, CPU per event {:.2}x, each added source {added:.1} MiB of RSS",
        three.rate() / one.rate(),
        three.cpu_per_100k() / one.cpu_per_100k()
    );
    let fig = |r: &Run| {
        json!({"sources": r.sources, "events": r.events, "seconds": r.secs, "events_per_second": r.rate(),
               "cpu_seconds": r.cpu_s, "cpu_seconds_per_100k_events": r.cpu_per_100k(),
               "peak_rss_mib": r.rss_mib, "rss_mib_per_source": r.rss_mib / r.sources as f64})
    };
    json!({"one": fig(&first), "three": fig(&three), "one_again": fig(&last), "rate_ratio": three.rate() / one.rate(),
           "rss_mib_per_added_source": added})
}
