//! The librdkafka outboxd links (`vendor/rdkafka-sys`, whose PATCHES.md
//! names the one change to it), checked against Apache Kafka through
//! librdkafka's own counters.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rdkafka::config::ClientConfig;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::producer::{BaseProducer, BaseRecord, DeliveryResult, Producer, ProducerContext};
use rdkafka::statistics::Statistics;
use rdkafka::ClientContext;

use crate::harness::broker::{broker, create_topics_sized};

/// Keeps the last statistics librdkafka emitted, and counts deliveries.
#[derive(Default, Clone)]
struct Counters {
    last: Arc<Mutex<Option<Statistics>>>,
    delivered: Arc<Mutex<(usize, usize)>>,
}

impl ClientContext for Counters {
    fn stats(&self, statistics: Statistics) {
        *self.last.lock().unwrap() = Some(statistics);
    }
}

impl ProducerContext for Counters {
    type DeliveryOpaque = ();
    fn delivery(&self, result: &DeliveryResult<'_>, _: ()) {
        let mut d = self.delivered.lock().unwrap();
        match result {
            Ok(_) => d.0 += 1,
            Err(_) => d.1 += 1,
        }
    }
}

/// An idempotent partition sends its next batch only once the request it
/// has in flight is answered. Unpatched, librdkafka's broker thread asked
/// to be woken *now* for that waiting batch (its `linger.ms` had passed)
/// and polled its socket with a zero timeout until the answer came: one
/// wake-up per loop, hundreds per request. Here every queued record is due
/// at once (`linger.ms = 0`) and one partition takes 50,000 records as fast
/// as they can be queued, so a batch always waits behind the request in
/// flight. With the patch the thread sleeps until the answer arrives: a
/// few wake-ups per request (the answer, the queue's signal, the timers).
#[test]
fn a_partition_waiting_for_its_answer_does_not_keep_the_broker_thread_polling() {
    const RECORDS: usize = 50_000;
    let brokers = broker().brokers.clone();
    let topic = format!("waiting-partition-{}", uuid::Uuid::new_v4().simple());
    create_topics_sized(&brokers, std::slice::from_ref(&topic), 1, &[]);
    let counters = Counters::default();
    let producer: BaseProducer<Counters> = ClientConfig::new()
        .set("bootstrap.servers", &brokers)
        .set("enable.idempotence", "true")
        .set("linger.ms", "0")
        .set("statistics.interval.ms", "100")
        .create_with_context(counters.clone())
        .unwrap();
    let value = vec![b'v'; 200];
    let mut queued = 0;
    while queued < RECORDS {
        match producer.send(BaseRecord::<str, [u8]>::to(&topic).key("k").payload(&value)) {
            Ok(()) => queued += 1,
            Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), _)) => {
                producer.poll(Duration::from_millis(5));
            }
            Err((e, _)) => panic!("queueing a record: {e}"),
        }
        if queued % 1_000 == 0 {
            producer.poll(Duration::ZERO);
        }
    }
    producer.flush(Duration::from_secs(120)).unwrap();
    assert_eq!(
        *counters.delivered.lock().unwrap(),
        (RECORDS, 0),
        "every record delivered"
    );
    // Statistics emitted after the last answer.
    *counters.last.lock().unwrap() = None;
    let deadline = Instant::now() + Duration::from_secs(10);
    while counters.last.lock().unwrap().is_none() && Instant::now() < deadline {
        producer.poll(Duration::from_millis(50));
    }
    let stats = counters
        .last
        .lock()
        .unwrap()
        .take()
        .expect("librdkafka emits statistics");
    let leader = stats
        .brokers
        .values()
        .filter(|b| b.nodeid >= 0)
        .max_by_key(|b| b.tx)
        .expect("a broker in the statistics");
    let requests = leader.tx;
    let wakeups = leader
        .wakeups
        .expect("librdkafka counts its broker thread's wake-ups");
    let per_request = wakeups as f64 / requests.max(1) as f64;
    eprintln!("{RECORDS} records: {requests} requests, {wakeups} broker thread wake-ups ({per_request:.1} per request)");
    assert!(requests >= 10, "the records went in several requests: {requests}");
    assert!(
        per_request < 20.0,
        "the broker thread woke {per_request:.1} times per request ({wakeups} for {requests}): \
         it polls while a batch waits for the answer in flight (is vendor/rdkafka-sys's patch applied?)"
    );
}
