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

/// Set in the child: `brokers|topic|events|topics|producers|kafka lines
/// (\n-separated)`.
pub const ENV: &str = "OUTBOXD_BENCH_CEILING";

/// The shape of a ceiling run: how many topics the records spread over
/// (`<topic>-t<i>`, each of [`PARTITIONS`] partitions, made beforehand)
/// and how many producers send them. With several producers each
/// partition is written by one of them only (partition `p` of topic `t`
/// by producer `(3t + p) mod producers`), the partition picked here from
/// the key, so every key keeps its order.
#[derive(Clone, Copy, Debug)]
pub struct Spread {
    pub topics: usize,
    pub producers: usize,
}

impl Spread {
    pub const ONE: Spread = Spread { topics: 1, producers: 1 };
}

/// Partitions of each topic of a spread run.
pub const PARTITIONS: usize = 3;

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
    run_spread(brokers, topic, events, kafka_lines, Spread::ONE)
}

/// [`run`] over `spread.topics` topics and `spread.producers` producers.
pub fn run_spread(brokers: &str, topic: &str, events: usize, kafka_lines: &[String], spread: Spread) -> Ceiling {
    let spec = format!(
        "{brokers}|{topic}|{events}|{}|{}|{}",
        spread.topics,
        spread.producers,
        kafka_lines.join("\n")
    );
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
/// several topics, record `i` goes to topic `i mod topics`, on the
/// partition its key hashes to.
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
            let (topic, partition) = if topics == 1 {
                (topic.to_owned(), None)
            } else {
                let h = key.bytes().fold(0u32, |h, b| h.wrapping_mul(31).wrapping_add(u32::from(b)));
                (format!("{topic}-t{}", i % topics), Some((h as usize % PARTITIONS) as i32))
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
                partition,
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

/// The producer that owns a record's partition.
fn owner(rec: &KafkaRecord, producers: usize) -> usize {
    let t: usize = rec
        .topic
        .rsplit_once("-t")
        .and_then(|(_, t)| t.parse().ok())
        .unwrap_or(0);
    (t * PARTITIONS + rec.partition.unwrap_or(0) as usize) % producers
}

/// The child's side: produce, then print the figures as JSON. The
/// in-flight budget is outboxd's for the partitions written to, split
/// evenly between the producers.
pub async fn child(spec: &str) {
    let mut parts = spec.splitn(6, '|');
    let (brokers, topic, events, topics, producers, lines) = (
        parts.next().unwrap(),
        parts.next().unwrap(),
        parts.next().unwrap().parse::<usize>().unwrap(),
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
    let mut sinks = Vec::new();
    for _ in 0..producers {
        let mut sink = KafkaSink::new(kafka, Duration::from_secs(10)).expect("the ceiling's producer");
        for rec in pool.iter().take(topics) {
            sink.ensure_topic(&rec.topic).await.expect("the ceiling's topic");
        }
        sinks.push(sink);
    }
    let queues: Vec<_> = sinks.iter().map(KafkaSink::reports).collect();
    let partitions = if topics == 1 { sinks[0].partitions_in_use() } else { topics * PARTITIONS };
    let (max_inflight, max_inflight_bytes) = kafka.inflight_budget(partitions);
    let (max_inflight, max_inflight_bytes) = (max_inflight / producers, max_inflight_bytes / producers);
    let mut in_flight: Vec<HashMap<_, usize>> = vec![HashMap::new(); producers];
    let mut bytes = vec![0usize; producers];
    let mut ready = VecDeque::new();
    let (cpu_before, _) = own_usage();
    let start = Instant::now();
    let mut next = pool.iter().cycle().take(events);
    let mut pending = next.next();
    while pending.is_some() || in_flight.iter().any(|f| !f.is_empty()) {
        // outboxd's intake rule: read while under both bounds (of the
        // producer the next record goes to).
        while let Some(rec) = pending {
            let k = owner(rec, producers);
            if in_flight[k].len() >= max_inflight || bytes[k] >= max_inflight_bytes {
                break;
            }
            match sinks[k].send_reported(rec).expect("the ceiling's send") {
                SendOutcome::Sent(ticket) => {
                    in_flight[k].insert(ticket, rec.size());
                    bytes[k] += rec.size();
                    pending = next.next();
                }
                SendOutcome::QueueFull => break,
            }
        }
        let mut heard = false;
        for (k, queue) in queues.iter().enumerate() {
            queue.take(&mut ready);
            while let Some((ticket, report)) = ready.pop_front() {
                assert!(
                    matches!(report, Report::Stored { .. }),
                    "the ceiling's record was not stored: {report:?}"
                );
                bytes[k] -= in_flight[k].remove(&ticket).unwrap_or(0);
                heard = true;
            }
        }
        if !heard {
            let arrivals: Vec<_> = queues.iter().map(|q| Box::pin(q.arrived())).collect();
            futures::future::select_all(arrivals).await;
        }
    }
    let seconds = start.elapsed().as_secs_f64();
    let (cpu_after, rss_mib) = own_usage();
    println!(
        "{}",
        json!({"seconds": seconds, "cpu_s": cpu_after - cpu_before, "rss_mib": rss_mib})
    );
}
