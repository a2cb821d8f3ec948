//! The Kafka side's limit on this machine: records like the backlog's
//! (key, payload and headers of the same sizes), built in memory before
//! the clock starts, produced through outboxd's own sink (its producer
//! settings, its batched delivery reports and its in-flight bounds) to the
//! same broker, with no PostgreSQL. Beside `pg_recvlogical` (the decoding
//! side's limit), it shows how close outboxd comes to the slower of the
//! two.
//!
//! It runs in a child process (this binary, with [`ENV`] set), so that its
//! CPU and peak RSS are its own. The same run, unmeasured, warms the broker
//! before the first drain.

use std::collections::{HashMap, VecDeque};
use std::process::Command;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use outboxd::kafka::delivery::Report;
use outboxd::kafka::records::KafkaRecord;
use outboxd::kafka::sink::{KafkaSink, SendOutcome};
use serde_json::{json, Value};

/// Set in the child: `brokers|topic|events|topics|kafka lines
/// (\n-separated)`.
pub const ENV: &str = "OUTBOXD_BENCH_CEILING";

/// A produce-only run.
#[derive(Clone, Debug)]
pub struct Ceiling {
    pub events: usize,
    pub seconds: f64,
    pub cpu_s: f64,
    pub rss_mib: f64,
}

impl Ceiling {
    pub fn rate(&self) -> f64 {
        self.events as f64 / self.seconds
    }

    pub fn cpu_per_100k(&self) -> f64 {
        self.cpu_s * 100_000.0 / self.events as f64
    }

    pub fn json(&self) -> Value {
        json!({"events": self.events, "seconds": self.seconds, "events_per_second": self.rate(),
               "cpu_seconds_per_100k_events": self.cpu_per_100k(), "peak_rss_mib": self.rss_mib})
    }
}

/// Produces `events` records to `topic` in a child process and returns
/// what it measured.
pub fn run(brokers: &str, topic: &str, events: usize, kafka_lines: &[String]) -> Ceiling {
    run_over(brokers, topic, events, kafka_lines, 1)
}

/// [`run`] over `topics` topics (`<topic>-t<i>`, made beforehand; one
/// topic is `topic` itself).
pub fn run_over(brokers: &str, topic: &str, events: usize, kafka_lines: &[String], topics: usize) -> Ceiling {
    let spec = format!("{brokers}|{topic}|{events}|{topics}|{}", kafka_lines.join("\n"));
    let out = Command::new(std::env::current_exe().expect("the bench binary"))
        .env(ENV, spec)
        .output()
        .expect("start the ceiling run");
    assert!(
        out.status.success(),
        "the ceiling run failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).expect("the ceiling run's figures");
    Ceiling {
        events,
        seconds: v["seconds"].as_f64().unwrap(),
        cpu_s: v["cpu_s"].as_f64().unwrap(),
        rss_mib: v["rss_mib"].as_f64().unwrap(),
    }
}

/// The records: as outboxd builds them from the backlog's rows; over
/// several topics, record `i` goes to topic `i mod topics`.
fn records(topic: &str, n: usize, topics: usize) -> Vec<KafkaRecord> {
    let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_millis() as i64;
    (0..n)
        .map(|i| {
            let id = uuid::Uuid::new_v4().to_string();
            let payload = format!(
                r#"{{"note": "{}", "lines": [{{"qty": 2, "sku": "SKU-{}", "price": 1250}}], "orderId": {i}, "customerId": "{:032x}"}}"#,
                "n".repeat(150),
                i % 100 + 1,
                i as u128 * 0x9e37_79b9_7f4a_7c15
            );
            let key = format!("order-{}", i % 5000);
            let topic = if topics == 1 {
                topic.to_owned()
            } else {
                format!("{topic}-t{}", i % topics)
            };
            KafkaRecord {
                topic,
                key: key.into_bytes(),
                value: Some(payload.into_bytes()),
                headers: vec![
                    ("id".into(), id.into_bytes()),
                    ("type".into(), b"ordering.order-placed.v1".to_vec()),
                    ("aggregateType".into(), b"Order".to_vec()),
                    ("aggregateId".into(), format!("order-{}", i % 5000).into_bytes()),
                    ("correlationId".into(), format!("{:032x}", i as u128 * 31).into_bytes()),
                    (
                        "traceparent".into(),
                        format!("00-{:032x}-{:016x}-01", i as u128 * 7 + 1, i as u64 * 13 + 1).into_bytes(),
                    ),
                ],
                timestamp_ms: now,
                partition: None,
            }
        })
        .collect()
}

/// CPU seconds and peak RSS (MiB) of this process so far.
fn own_usage() -> (f64, f64) {
    let (rss_mib, cpu_s) = super::measure::usage(std::process::id());
    (cpu_s, rss_mib)
}

/// At most this many distinct records are built; longer runs cycle
/// through them (Kafka does not mind a repeated id), so the pool's memory
/// stays that of 100,000 records.
const POOL: usize = 100_000;

/// The child's side: produce, then print the figures as JSON.
pub async fn child(spec: &str) {
    let mut parts = spec.splitn(5, '|');
    let (brokers, topic, events, topics, lines) = (
        parts.next().unwrap(),
        parts.next().unwrap(),
        parts.next().unwrap().parse::<usize>().unwrap(),
        parts.next().unwrap().parse::<usize>().unwrap(),
        parts.next().unwrap_or(""),
    );
    let text = format!(
        "[postgres]\nurl = \"postgres://unused@127.0.0.1/unused\"\n[kafka]\nbrokers = \"{brokers}\"\ntopic_replication_factor = 1\n{lines}\n"
    );
    let (config, _) = outboxd::config::Config::from_toml(&text, |_| None).expect("the ceiling's config");
    let kafka = &config.kafka;
    let pool = records(topic, events.min(POOL), topics);
    let mut sink = KafkaSink::new(kafka, Duration::from_secs(10)).expect("the ceiling's producer");
    for rec in pool.iter().take(topics) {
        sink.ensure_topic(&rec.topic).await.expect("the ceiling's topic");
    }
    let queue = sink.reports();
    let (mut in_flight, mut bytes) = (HashMap::new(), 0usize);
    let mut ready = VecDeque::new();
    let (cpu_before, _) = own_usage();
    let start = Instant::now();
    let mut next = pool.iter().cycle().take(events);
    let mut pending = next.next();
    let (max_inflight, max_inflight_bytes) = kafka.inflight_budget(sink.partitions_in_use());
    while pending.is_some() || !in_flight.is_empty() {
        // outboxd's intake rule: read while under both bounds.
        while let Some(rec) = pending.filter(|_| in_flight.len() < max_inflight && bytes < max_inflight_bytes)
        {
            match sink.send_reported(rec).expect("the ceiling's send") {
                SendOutcome::Sent(ticket) => {
                    in_flight.insert(ticket, rec.size());
                    bytes += rec.size();
                    pending = next.next();
                }
                SendOutcome::QueueFull => break,
            }
        }
        if ready.is_empty() {
            queue.arrived().await;
            queue.take(&mut ready);
        }
        while let Some((ticket, report)) = ready.pop_front() {
            assert!(
                matches!(report, Report::Stored { .. }),
                "the ceiling's record was not stored: {report:?}"
            );
            bytes -= in_flight.remove(&ticket).unwrap_or(0);
        }
    }
    let seconds = start.elapsed().as_secs_f64();
    let (cpu_after, rss_mib) = own_usage();
    println!(
        "{}",
        json!({"seconds": seconds, "cpu_s": cpu_after - cpu_before, "rss_mib": rss_mib})
    );
}
