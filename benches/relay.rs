//! outboxd benchmark: one command, local throwaway services, four measures.
//!
//! ```sh
//! scripts/bench.sh                      # 200,000 events
//! scripts/bench.sh --events 1000000     # 1M
//! ```
//!
//! a. Backlog drain: N outbox rows (~300-byte payloads, 100 rows per
//!    transaction) written while outboxd is stopped; the time from starting
//!    outboxd until the slot's `confirmed_flush_lsn` reaches the end of
//!    that WAL; events/s, peak RSS, CPU seconds per 100k events.
//! b. The same WAL range drained by `pg_recvlogical` (pgoutput, the same
//!    publication, output to /dev/null) from a second slot created at the
//!    same point, stopping at `--endpos`: PostgreSQL's decoding limit.
//! c. The same rows drained by polling mode.
//! d. Latency: single-row transactions at a steady rate (default 2,000/s
//!    for 30 s). Commit → Kafka ack from outboxd's histogram (PostgreSQL
//!    commit timestamp to delivery), and commit → consumed per event
//!    (commit timestamps from `pg_xact_commit_timestamp`), an upper bound
//!    that also gives an exact max.
//!
//! Results: a markdown table on stdout and JSON in target/bench/results.json.
//! All measures run side by side in this one process on the same machine,
//! so the ratios are the figures to trust; absolute numbers move with the
//! machine's load.

#![allow(clippy::unwrap_used, clippy::expect_used, missing_debug_implementations)]

#[path = "../tests/integration/harness/mod.rs"]
#[allow(dead_code)]
mod harness;

use std::collections::HashMap;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use harness::broker::dedicated as dedicated_broker;
use harness::postgres::{dedicated, free_port, PgServer};
use outboxd::Lsn;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{Headers, Message};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};
use serde_json::json;

struct Args {
    events: usize,
    latency_secs: u64,
    rate: u64,
}

fn args() -> Args {
    let mut a = Args {
        events: 200_000,
        latency_secs: 30,
        rate: 2_000,
    };
    let argv: Vec<String> = std::env::args().collect();
    let mut i = 1;
    while i < argv.len() {
        let value = || {
            argv.get(i + 1)
                .and_then(|v| v.parse().ok())
                .expect("a number after the flag")
        };
        match argv[i].as_str() {
            "--events" => a.events = value(),
            "--latency-secs" => a.latency_secs = value() as u64,
            "--rate" => a.rate = value() as u64,
            _ => {}
        }
        i += 1;
    }
    a
}

async fn lsn(client: &tokio_postgres::Client, sql: &str) -> Lsn {
    let s: Option<String> = client.query_one(sql, &[]).await.unwrap().get(0);
    s.map(|s| s.parse().unwrap()).unwrap_or(Lsn::ZERO)
}

async fn confirmed(client: &tokio_postgres::Client, slot: &str) -> Lsn {
    let s: Option<String> = client
        .query_one(
            "SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = $1",
            &[&slot],
        )
        .await
        .unwrap()
        .get(0);
    s.map(|s| s.parse().unwrap()).unwrap_or(Lsn::ZERO)
}

fn clk_tck() -> f64 {
    Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|o| String::from_utf8_lossy(&o.stdout).trim().parse().ok())
        .unwrap_or(100.0)
}

/// (peak RSS KiB, CPU seconds) of a running process.
fn usage(pid: u32) -> (u64, f64) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let hwm = status
        .lines()
        .find(|l| l.starts_with("VmHWM:"))
        .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        .unwrap_or(0);
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let fields: Vec<&str> = stat.rsplit(')').next().unwrap_or("").split_whitespace().collect();
    // After the command name: state is field 3, utime 14, stime 15 (1-based).
    let ticks: f64 = [11, 12]
        .iter()
        .filter_map(|&i| fields.get(i)?.parse::<f64>().ok())
        .sum();
    (hwm, ticks / clk_tck())
}

fn config(pg: &PgServer, slot: &str, brokers: &str, topic: &str, port: u16, extra: &str) -> String {
    format!(
        r#"{extra}
[postgres]
url = "postgres://postgres@127.0.0.1:{port_pg}/postgres?sslmode=disable"
slot = "{slot}"
publication = "bench_pub"
[kafka]
brokers = "{brokers}"
topic_partitions = 3
topic_replication_factor = 1
[routing]
topic = "{topic}.{{aggregate_type}}"
[http]
listen = "127.0.0.1:{port}"
[log]
level = "warn"
"#,
        port_pg = pg.port
    )
}

fn start_outboxd(dir: &Path, name: &str, text: &str) -> Child {
    let cfg = dir.join(format!("{name}.toml"));
    std::fs::write(&cfg, text).unwrap();
    let log = std::fs::File::create(dir.join(format!("{name}.log"))).unwrap();
    Command::new(env!("CARGO_BIN_EXE_outboxd"))
        .args(["run", "--config"])
        .arg(&cfg)
        .env_remove("RUST_LOG")
        .stdin(Stdio::null())
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .spawn()
        .unwrap()
}

fn stop(mut child: Child) {
    let _ = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status();
    let _ = child.wait();
}

/// Writes `n` rows, 100 per transaction, ~300-byte payloads.
async fn write_backlog(client: &tokio_postgres::Client, n: usize) {
    for t in 0..n.div_ceil(100) {
        let rows = (n - t * 100).min(100) as i32;
        client
            .execute(
                "INSERT INTO outbox (id, aggregate_type, aggregate_id, type, payload, headers)
                 SELECT gen_random_uuid(), 'Order', 'order-' || ($1::int * 100 + g) % 5000, 'ordering.order-placed.v1',
                        jsonb_build_object('orderId', $1::int * 100 + g, 'customerId', md5(g::text),
                                           'lines', jsonb_build_array(jsonb_build_object('sku', 'SKU-' || g, 'qty', 2, 'price', 1250)),
                                           'note', repeat('n', 150)),
                        jsonb_build_object('correlationId', md5(($1::int * 100 + g)::text))
                   FROM generate_series(1, $2::int) g",
                &[&(t as i32), &rows],
            )
            .await
            .unwrap();
    }
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let idx = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[idx]
}

/// p-quantile from Prometheus cumulative buckets, linearly interpolated.
fn histogram_quantile(buckets: &[(f64, f64)], p: f64) -> f64 {
    let total = buckets.last().map_or(0.0, |b| b.1);
    let rank = total * p;
    let mut prev = (0.0, 0.0);
    for &(le, count) in buckets {
        if count >= rank {
            if le.is_infinite() {
                return prev.0;
            }
            let width = count - prev.1;
            let frac = if width > 0.0 { (rank - prev.1) / width } else { 0.0 };
            return prev.0 + (le - prev.0) * frac;
        }
        prev = (le, count);
    }
    f64::NAN
}

fn scrape(port: u16) -> String {
    ureq::get(&format!("http://127.0.0.1:{port}/metrics"))
        .call()
        .ok()
        .and_then(|mut r| r.body_mut().read_to_string().ok())
        .unwrap_or_default()
}

fn ack_histogram(text: &str) -> Vec<(f64, f64)> {
    text.lines()
        .filter(|l| l.starts_with("outboxd_commit_to_ack_seconds_bucket{le=\""))
        .filter_map(|l| {
            let le = l.split("le=\"").nth(1)?.split('"').next()?;
            let le = if le == "+Inf" {
                f64::INFINITY
            } else {
                le.parse().ok()?
            };
            Some((le, l.rsplit(' ').next()?.parse().ok()?))
        })
        .collect()
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let a = args();
    let dir = tempfile::tempdir().unwrap();
    eprintln!("bench: starting PostgreSQL and the broker");
    let pg = dedicated("");
    let broker = dedicated_broker();
    let mut client = pg.client("postgres").await;
    outbox_sdk::migrate::migrate(&mut client).await.unwrap();
    // Separate statements: a slot cannot be created in a transaction that wrote.
    for sql in [
        "CREATE PUBLICATION bench_pub FOR TABLE outbox WITH (publish = 'insert')",
        "SELECT pg_create_logical_replication_slot('bench_outboxd', 'pgoutput')",
        "SELECT pg_create_logical_replication_slot('bench_recv', 'pgoutput')",
        "SELECT pg_create_logical_replication_slot('bench_recv_after', 'pgoutput')",
    ] {
        client.batch_execute(sql).await.unwrap();
    }
    let start_lsn = lsn(&client, "SELECT pg_current_wal_lsn()::text").await;
    eprintln!("bench: writing {} rows, 100 per transaction", a.events);
    let t = Instant::now();
    write_backlog(&client, a.events).await;
    let end = lsn(&client, "SELECT pg_current_wal_lsn()::text").await;
    let write_secs = t.elapsed().as_secs_f64();
    let wal_mb = end.bytes_since(start_lsn) as f64 / 1048576.0;
    eprintln!("bench: wrote {wal_mb:.0} MB of WAL in {write_secs:.1}s");

    // b. pg_recvlogical on the same WAL range, once before and once after
    //    outboxd, so neither side gets the warmer cache; the faster run is
    //    the decoding limit.
    let recvlogical = |slot: &str| {
        let t = Instant::now();
        let status = Command::new(pg.bin_dir.join("pg_recvlogical"))
            .args([
                "-h",
                "127.0.0.1",
                "-p",
                &pg.port.to_string(),
                "-U",
                "postgres",
                "-d",
                "postgres",
            ])
            .args([
                "--slot",
                slot,
                "--start",
                "-o",
                "proto_version=1",
                "-o",
                "publication_names=bench_pub",
            ])
            .args(["-E", &end.to_string(), "-f", "/dev/null", "--no-loop"])
            .status()
            .unwrap();
        assert!(status.success(), "pg_recvlogical failed");
        t.elapsed().as_secs_f64()
    };
    eprintln!("bench: pg_recvlogical (before)");
    let recv_before = recvlogical("bench_recv");

    // a. outboxd drains the backlog.
    eprintln!("bench: outboxd drain");
    let port = free_port();
    let text = config(&pg, "bench_outboxd", &broker.brokers, "bench", port, "");
    let t = Instant::now();
    let child = start_outboxd(dir.path(), "drain", &text);
    let pid = child.id();
    let mut peak = (0, 0.0);
    while confirmed(&client, "bench_outboxd").await < end {
        peak = usage(pid);
        assert!(t.elapsed() < Duration::from_secs(1800), "drain did not finish");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let drain_secs = t.elapsed().as_secs_f64();
    let (rss_kib, cpu) = {
        let now = usage(pid);
        (now.0.max(peak.0), now.1)
    };
    stop(child);
    // The drain is real: the broker holds every event (Kafka's high
    // watermarks, read at once, count every record in the topic).
    let brokers = broker.brokers.clone();
    let in_kafka = tokio::task::spawn_blocking(move || {
        let c: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", &brokers)
            .set("group.id", "bench-count")
            .create()
            .unwrap();
        (0..3)
            .map(|p| {
                c.fetch_watermarks("bench.order", p, Duration::from_secs(10))
                    .unwrap()
                    .1
            })
            .sum::<i64>()
    })
    .await
    .unwrap();
    assert!(
        in_kafka >= a.events as i64,
        "only {in_kafka} of {} events in Kafka after the drain",
        a.events
    );
    eprintln!("bench: pg_recvlogical (after)");
    let recv_after = recvlogical("bench_recv_after");
    let recv_secs = recv_before.min(recv_after);

    // c. polling mode drains the same rows.
    eprintln!("bench: polling mode");
    let text = config(
        &pg,
        "unused",
        &broker.brokers,
        "benchpoll",
        free_port(),
        "mode = \"polling\"",
    );
    let t = Instant::now();
    let child = start_outboxd(dir.path(), "polling", &text);
    loop {
        // EXISTS uses the partial index; count(*) would scan the table.
        let left: bool = client
            .query_one(
                "SELECT EXISTS (SELECT 1 FROM outbox WHERE published_at IS NULL)",
                &[],
            )
            .await
            .unwrap()
            .get(0);
        if !left {
            break;
        }
        assert!(t.elapsed() < Duration::from_secs(3600), "polling did not finish");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let poll_secs = t.elapsed().as_secs_f64();
    stop(child);

    // d. latency at a steady rate.
    eprintln!("bench: latency, {} events/s for {}s", a.rate, a.latency_secs);
    client.batch_execute("TRUNCATE outbox").await.unwrap();
    client
        .batch_execute("SELECT pg_create_logical_replication_slot('bench_latency', 'pgoutput')")
        .await
        .unwrap();
    let lport = free_port();
    let text = config(&pg, "bench_latency", &broker.brokers, "latency", lport, "");
    let child = start_outboxd(dir.path(), "latency", &text);
    // Warm up: the topic exists and outboxd streams.
    client
        .execute(
            "INSERT INTO outbox (id, aggregate_type, aggregate_id, type, payload) VALUES (gen_random_uuid(), 'Order', 'warm', 'w', '{}')",
            &[],
        )
        .await
        .unwrap();
    let warm_end = lsn(&client, "SELECT pg_current_wal_lsn()::text").await;
    while confirmed(&client, "bench_latency").await < warm_end {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let brokers = broker.brokers.clone();
    let total = (a.rate * a.latency_secs) as usize;
    let consumer = std::thread::spawn(move || {
        let c: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", &brokers)
            .set("group.id", "bench-latency")
            .set("fetch.wait.max.ms", "1")
            .set("enable.auto.commit", "false")
            .create()
            .unwrap();
        let mut tpl = TopicPartitionList::new();
        for p in 0..3 {
            tpl.add_partition_offset("latency.order", p, Offset::Beginning)
                .unwrap();
        }
        c.assign(&tpl).unwrap();
        let mut seen: HashMap<String, f64> = HashMap::new();
        let deadline = Instant::now() + Duration::from_secs(a.latency_secs + 120);
        while seen.len() < total + 1 && Instant::now() < deadline {
            if let Some(Ok(m)) = c.poll(Duration::from_millis(50)) {
                let now = SystemTime::now()
                    .duration_since(UNIX_EPOCH)
                    .unwrap()
                    .as_secs_f64();
                if let Some(id) = m.headers().and_then(|h| h.iter().find(|h| h.key == "id")?.value) {
                    seen.entry(String::from_utf8_lossy(id).into_owned())
                        .or_insert(now);
                }
            }
        }
        seen
    });
    let writers = 4u64;
    let mut tasks = Vec::new();
    for w in 0..writers {
        let c = pg.client("postgres").await;
        let per = a.rate / writers;
        let secs = a.latency_secs;
        tasks.push(tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / per as f64));
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
            for i in 0..per * secs {
                tick.tick().await;
                c.execute(
                    "INSERT INTO outbox (id, aggregate_type, aggregate_id, type, payload)
                     VALUES (gen_random_uuid(), 'Order', $1, 'ordering.tick.v1', jsonb_build_object('i', $2::bigint))",
                    &[&format!("w{w}-{}", i % 50), &(i as i64)],
                )
                .await
                .unwrap();
            }
        }));
    }
    let t = Instant::now();
    for task in tasks {
        task.await.unwrap();
    }
    let achieved = total as f64 / t.elapsed().as_secs_f64();
    let seen = consumer.join().unwrap();
    let metrics_text = tokio::task::spawn_blocking(move || scrape(lport)).await.unwrap();
    stop(child);
    let commits: HashMap<String, f64> = client
        .query(
            "SELECT id::text, EXTRACT(EPOCH FROM pg_xact_commit_timestamp(xmin))::float8 FROM outbox WHERE aggregate_id <> 'warm'",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    let mut consumed_ms: Vec<f64> = commits
        .iter()
        .filter_map(|(id, commit)| Some((seen.get(id)? - commit) * 1000.0))
        .collect();
    consumed_ms.sort_by(f64::total_cmp);
    let missing = commits.len() - consumed_ms.len();
    let hist = ack_histogram(&metrics_text);
    let ack_p50 = histogram_quantile(&hist, 0.5) * 1000.0;
    let ack_p99 = histogram_quantile(&hist, 0.99) * 1000.0;

    let n = a.events as f64;
    let drain_rate = n / drain_secs;
    let recv_rate = n / recv_secs;
    let poll_rate = n / poll_secs;
    let cpu_per_100k = cpu / (n / 100_000.0);
    let results = json!({
        "events": a.events,
        "wal_mb": wal_mb,
        "drain": {"high_watermark_sum": in_kafka, "seconds": drain_secs, "events_per_second": drain_rate, "peak_rss_mib": rss_kib as f64 / 1024.0,
                  "cpu_seconds": cpu, "cpu_seconds_per_100k_events": cpu_per_100k},
        "pg_recvlogical": {"seconds": recv_secs, "events_per_second": recv_rate,
                           "seconds_before_outboxd": recv_before, "seconds_after_outboxd": recv_after},
        "polling": {"seconds": poll_secs, "events_per_second": poll_rate},
        "ratios": {"outboxd_to_pg_recvlogical": drain_rate / recv_rate, "outboxd_to_polling": drain_rate / poll_rate},
        "latency": {"target_events_per_second": a.rate, "achieved_events_per_second": achieved, "seconds": a.latency_secs,
                    "commit_to_ack_ms": {"p50": ack_p50, "p99": ack_p99, "samples": hist.last().map_or(0.0, |b| b.1)},
                    "commit_to_consumed_ms": {"p50": percentile(&consumed_ms, 0.5), "p99": percentile(&consumed_ms, 0.99),
                                              "max": consumed_ms.last().copied().unwrap_or(f64::NAN), "samples": consumed_ms.len(),
                                              "missing": missing}},
    });
    let out_dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("target/bench");
    std::fs::create_dir_all(&out_dir).unwrap();
    std::fs::write(
        out_dir.join("results.json"),
        serde_json::to_string_pretty(&results).unwrap(),
    )
    .unwrap();

    println!("| measure | result |");
    println!("|---|---|");
    println!(
        "| backlog | {} events, {wal_mb:.0} MB of WAL, 100 rows per transaction |",
        a.events
    );
    println!(
        "| outboxd drain | {drain_secs:.2} s, {drain_rate:.0} events/s (all {} events verified in Kafka) |",
        a.events
    );
    println!(
        "| pg_recvlogical (decoding limit) | {recv_secs:.2} s, {recv_rate:.0} events/s (runs before/after outboxd: {recv_before:.2} s / {recv_after:.2} s) |"
    );
    println!("| polling mode (defaults: 500 rows per round) | {poll_secs:.2} s, {poll_rate:.0} events/s |");
    println!(
        "| outboxd / pg_recvlogical | {:.2} (target ≥ 0.8) |",
        drain_rate / recv_rate
    );
    println!(
        "| outboxd / polling | {:.1} (target ≥ 10) |",
        drain_rate / poll_rate
    );
    println!("| outboxd peak RSS | {:.1} MiB |", rss_kib as f64 / 1024.0);
    println!("| outboxd CPU | {cpu:.2} s, {cpu_per_100k:.2} core-s per 100k events (target ≤ 1) |");
    println!(
        "| latency load | {achieved:.0} events/s for {} s (single-row transactions) |",
        a.latency_secs
    );
    println!("| commit → Kafka ack (outboxd histogram) | p50 {ack_p50:.1} ms, p99 {ack_p99:.1} ms (target p99 ≤ 25) |");
    println!(
        "| commit → consumed (per event, upper bound) | p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms, {} missing |",
        percentile(&consumed_ms, 0.5),
        percentile(&consumed_ms, 0.99),
        consumed_ms.last().copied().unwrap_or(f64::NAN),
        missing
    );
    broker.kill();
}
