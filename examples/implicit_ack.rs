//! A reduced reproducer of librdkafka's implicit acknowledgements, for a
//! report upstream: an idempotent producer reports messages delivered that
//! the broker never stored.
//!
//! librdkafka's idempotent producer acknowledges the messages of a Produce
//! request *implicitly* (`rd_kafka_dr_implicit_ack`, logged as
//! `IMPLICITACK` under `debug=eos,msg`) when a later request of the same
//! partition succeeds while the earlier one waits for a retry: a broker
//! that enforces sequence numbers would only have accepted the later one
//! after the earlier. A broker that holds no producer state for the
//! partition (Apache Kafka for a new partition, or once the producer state
//! expired; rdkafka's mock cluster always, for idempotent producers)
//! accepts the later request anyway, so the earlier messages are reported
//! delivered, with no offset (`RD_KAFKA_OFFSET_INVALID`), and are not in
//! the log.
//!
//! The program produces to librdkafka's mock cluster (no broker needed):
//! three brokers, the first slow, so that a partition's Produce requests
//! overlap in flight; retriable errors (`NOT_LEADER_FOR_PARTITION`)
//! injected on Produce requests; then it compares what was reported
//! delivered with what the partitions hold (every run here, 2 to 4 of 500
//! messages):
//!
//! ```text
//! cargo run --example implicit_ack [-- --debug]
//! delivered with an offset:    497
//! delivered without an offset: 3      <- implicit acknowledgements
//! failed:                      0
//! the partitions hold:         497 records
//! 3 message(s) reported delivered were never stored
//! ```
//!
//! With `--debug`, librdkafka logs them:
//! `IMPLICITACK … implicit-ack [2] 1 message(s) implicitly acked by
//! subsequent batch success (msgids 124..124, last acked 126)`.
//!
//! It exits 1 when the reports and the log disagree (the behaviour to
//! report), 0 when they agree. outboxd treats a report without an offset as
//! a failed delivery (`kafka::Report::Unproven`): the session replays from
//! the slot, so such a message is sent again, never lost.

#![allow(clippy::unwrap_used)]

use std::time::Duration;

use rdkafka::client::ClientContext;
use rdkafka::config::RDKafkaLogLevel;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::mocking::MockCluster;
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::types::{RDKafkaApiKey, RDKafkaRespErr};
use rdkafka::ClientConfig;

/// Prints librdkafka's log lines (with `--debug`: `debug=eos,msg`) to
/// stderr, where `IMPLICITACK` shows.
struct Stderr;

impl ClientContext for Stderr {
    fn log(&self, _level: RDKafkaLogLevel, fac: &str, log_message: &str) {
        eprintln!("librdkafka {fac}: {log_message}");
    }
}

const MESSAGES: usize = 500;

#[tokio::main(flavor = "current_thread")]
async fn main() -> std::process::ExitCode {
    let debug = std::env::args().any(|a| a == "--debug");
    // Three brokers, a partition led by each; the first answers slowly, so
    // Produce requests of its partition overlap in flight.
    let mock = MockCluster::new(3).unwrap();
    let topic = "implicit-ack";
    mock.create_topic(topic, 3, 1).unwrap();
    for p in 0..3 {
        mock.partition_leader(topic, p, Some(p + 1)).unwrap();
    }
    mock.broker_round_trip_time(1, Duration::from_millis(400))
        .unwrap();
    let mut config = ClientConfig::new();
    config
        .set("bootstrap.servers", mock.bootstrap_servers())
        .set("enable.idempotence", "true")
        .set("acks", "all")
        .set("linger.ms", "5");
    if debug {
        config
            .set("debug", "eos,msg")
            .set_log_level(RDKafkaLogLevel::Debug);
    }
    let producer: FutureProducer<Stderr> = config.create_with_context(Stderr).unwrap();
    let mut deliveries = Vec::with_capacity(MESSAGES);
    // Bursts of five messages over twenty keys, every 60 ms; after the
    // first batches, three retriable errors for the next Produce requests,
    // every fifty messages.
    for i in 0..MESSAGES {
        if i % 50 == 0 && i >= 100 {
            mock.request_errors(
                RDKafkaApiKey::Produce,
                &[RDKafkaRespErr::RD_KAFKA_RESP_ERR_NOT_LEADER_FOR_PARTITION; 3],
            );
        }
        let payload = format!("message {i}");
        let key = format!("key-{}", (i * 7) % 20);
        let record = FutureRecord::to(topic).key(&key).payload(&payload);
        deliveries.push(
            producer
                .send_result::<String, String>(record)
                .map_err(|(e, _)| e)
                .unwrap(),
        );
        if i % 5 == 4 {
            tokio::time::sleep(Duration::from_millis(60)).await;
        }
    }
    let (mut with_offset, mut without, mut failed) = (0usize, 0usize, 0usize);
    for d in deliveries {
        match d.await {
            Ok(Ok(delivery)) if delivery.offset >= 0 => with_offset += 1,
            Ok(Ok(_)) => without += 1,
            _ => failed += 1,
        }
    }
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", mock.bootstrap_servers())
        .create()
        .unwrap();
    let mut stored = 0usize;
    for p in 0..3 {
        let (low, high) = consumer
            .fetch_watermarks(topic, p, Duration::from_secs(5))
            .unwrap();
        stored += usize::try_from(high - low).unwrap_or(0);
    }
    println!("delivered with an offset:    {with_offset}");
    println!("delivered without an offset: {without}");
    println!("failed:                      {failed}");
    println!("the partitions hold:         {stored} records");
    let reported = with_offset + without;
    if reported > stored {
        println!(
            "{} message(s) reported delivered were never stored",
            reported - stored
        );
        std::process::ExitCode::from(1)
    } else {
        println!("every message reported delivered is stored");
        std::process::ExitCode::SUCCESS
    }
}
