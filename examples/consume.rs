//! Prints the records of one or more topics from the beginning, with their
//! key and headers: a way to look at what outboxd published.
//!
//! ```sh
//! cargo run --example consume -- --brokers localhost:9092 order.events
//! ```

use std::time::{Duration, Instant};

use clap::Parser;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{Headers, Message};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};

/// Print records from Kafka topics, oldest first.
#[derive(Debug, Parser)]
struct Args {
    /// Bootstrap brokers.
    #[arg(long, default_value = "localhost:9092")]
    brokers: String,
    /// Stop after this many records.
    #[arg(long, default_value_t = usize::MAX)]
    count: usize,
    /// Stop when no record arrived for this many seconds.
    #[arg(long, default_value_t = 5)]
    idle_secs: u64,
    /// Topics to read.
    #[arg(required = true)]
    topics: Vec<String>,
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", &args.brokers)
        .set("group.id", "outboxd-consume-example")
        .set("enable.auto.commit", "false")
        .create()?;
    let mut tpl = TopicPartitionList::new();
    for topic in &args.topics {
        let md = consumer.fetch_metadata(Some(topic), Duration::from_secs(10))?;
        for t in md.topics() {
            for p in t.partitions() {
                tpl.add_partition_offset(topic, p.id(), Offset::Beginning)?;
            }
        }
    }
    consumer.assign(&tpl)?;
    let mut seen = 0;
    let mut last = Instant::now();
    while seen < args.count && last.elapsed() < Duration::from_secs(args.idle_secs) {
        let Some(m) = consumer.poll(Duration::from_millis(200)) else {
            continue;
        };
        let m = m?;
        last = Instant::now();
        seen += 1;
        let headers: Vec<String> = m
            .headers()
            .map(|h| {
                h.iter()
                    .map(|h| {
                        format!(
                            "{}={}",
                            h.key,
                            String::from_utf8_lossy(h.value.unwrap_or_default())
                        )
                    })
                    .collect()
            })
            .unwrap_or_default();
        println!(
            "{} [{}] @{} key={} headers={{{}}}\n  {}",
            m.topic(),
            m.partition(),
            m.offset(),
            String::from_utf8_lossy(m.key().unwrap_or_default()),
            headers.join(", "),
            String::from_utf8_lossy(m.payload().unwrap_or_default())
        );
    }
    eprintln!("{seen} record(s)");
    Ok(())
}
