//! The one consumer both relays are judged by: it reads a topic from its
//! current end and notes when each record arrives, by the record's `id`
//! header (outboxd and Debezium's EventRouter both set it to the outbox
//! row's id). Commit → arrival therefore carries the same consumer overhead
//! for both. The benchmark's topics keep the broker's append time
//! (`message.timestamp.type = LogAppendTime`), so each arrival also carries
//! the moment the record entered Kafka, with no consumer in it.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{Headers, Message, Timestamp};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};

use crate::measure::unix_now;

/// A topic's partitions' high watermarks: the next offset of each.
pub fn high_watermarks(consumer: &BaseConsumer, topic: &str, partitions: i32) -> Vec<i64> {
    (0..partitions)
        .map(|p| {
            consumer
                .fetch_watermarks(topic, p, Duration::from_secs(10))
                .unwrap_or_else(|e| panic!("watermarks of {topic}/{p}: {e}"))
                .1
        })
        .collect()
}

/// A plain consumer for watermark reads.
pub fn client(brokers: &str) -> BaseConsumer {
    ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("group.id", "bench-watermarks")
        .create()
        .expect("a Kafka client")
}

/// When a record reached the watcher, and when the broker appended it
/// (Unix seconds).
#[derive(Clone, Copy, Debug)]
pub struct Arrival {
    pub consumed: f64,
    pub appended: f64,
}

/// Records reaching a topic after the watcher was made, by `id` header.
pub struct Watcher {
    seen: Arc<Mutex<HashMap<String, Arrival>>>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Watcher {
    /// Starts reading every partition of `topic` at its current end. The
    /// offsets are resolved before this returns, so no record produced
    /// afterwards is missed.
    pub fn from_end(brokers: &str, topic: &str, partitions: i32) -> Watcher {
        let consumer: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", brokers)
            .set("group.id", "bench-watch")
            .set("enable.auto.commit", "false")
            .set("fetch.wait.max.ms", "1")
            .set("enable.sparse.connections", "false")
            .create()
            .expect("a Kafka consumer");
        let ends = high_watermarks(&consumer, topic, partitions);
        let mut tpl = TopicPartitionList::new();
        for (p, end) in ends.into_iter().enumerate() {
            tpl.add_partition_offset(topic, p as i32, Offset::Offset(end))
                .expect("a partition");
        }
        consumer.assign(&tpl).expect("assign");
        let seen = Arc::new(Mutex::new(HashMap::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let (seen, stop) = (seen.clone(), stop.clone());
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    if let Some(Ok(m)) = consumer.poll(Duration::from_millis(20)) {
                        let consumed = unix_now();
                        let appended = match m.timestamp() {
                            Timestamp::LogAppendTime(ms) => ms as f64 / 1000.0,
                            _ => panic!("the benchmark's topics keep LogAppendTime"),
                        };
                        let id = m
                            .headers()
                            .and_then(|h| h.iter().find(|h| h.key == "id")?.value)
                            .map(|v| String::from_utf8_lossy(v).into_owned());
                        if let Some(id) = id {
                            seen.lock()
                                .expect("watcher lock")
                                .entry(id)
                                .or_insert(Arrival { consumed, appended });
                        }
                    }
                }
            })
        };
        Watcher {
            seen,
            stop,
            thread: Some(thread),
        }
    }

    /// When the record with this id arrived, waiting up to `timeout`.
    pub fn wait_for(&self, id: &str, timeout: Duration) -> Option<Arrival> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(t) = self.seen.lock().expect("watcher lock").get(id) {
                return Some(*t);
            }
            if Instant::now() > deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// Waits until `n` distinct ids have arrived, or `timeout`.
    pub fn wait_count(&self, n: usize, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        while self.seen.lock().expect("watcher lock").len() < n && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Stops reading; every arrival, by id.
    pub fn finish(mut self) -> HashMap<String, Arrival> {
        self.halt();
        std::mem::take(&mut *self.seen.lock().expect("watcher lock"))
    }

    fn halt(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for Watcher {
    fn drop(&mut self) {
        self.halt();
    }
}
