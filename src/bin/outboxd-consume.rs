//! Prints the records of one or more topics from the beginning, with their
//! key and headers: a way to look at what outboxd published.
//!
//! ```sh
//! cargo run --bin outboxd-consume -- --brokers localhost:9092 order.events
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
    /// Stop after this many records; exit non-zero if fewer arrive.
    #[arg(long)]
    count: Option<usize>,
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
        // outboxd creates a topic with its first event: wait for it.
        let waiting = Instant::now();
        loop {
            let md = consumer.fetch_metadata(Some(topic), Duration::from_secs(10))?;
            let partitions: Vec<i32> = md
                .topics()
                .iter()
                .filter(|t| t.name() == topic && t.error().is_none())
                .flat_map(|t| t.partitions().iter().map(|p| p.id()))
                .collect();
            for p in &partitions {
                tpl.add_partition_offset(topic, *p, Offset::Beginning)?;
            }
            if !partitions.is_empty() || waiting.elapsed() > Duration::from_secs(args.idle_secs) {
                break;
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }
    consumer.assign(&tpl)?;
    let mut seen = 0;
    let mut last = Instant::now();
    let want = args.count.unwrap_or(usize::MAX);
    while seen < want && last.elapsed() < Duration::from_secs(args.idle_secs) {
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
    if let Some(want) = args.count.filter(|want| seen < *want) {
        let idle = args.idle_secs;
        return Err(
            format!("expected {want} record(s), {seen} arrived within {idle}s of the last one").into(),
        );
    }
    Ok(())
}
