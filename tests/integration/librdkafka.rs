//! The librdkafka outboxd links (`vendor/rdkafka-sys`, whose PATCHES.md
//! names the changes to it), checked against Apache Kafka through
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

/// One record's shape: key and value (`None`: null) and headers.
type Shape = (Option<Vec<u8>>, Option<Vec<u8>>, Vec<(String, Vec<u8>)>);

/// Records of every shape the patched writer treats apart, read back from
/// Apache Kafka byte for byte. librdkafka as patched here writes a
/// record's fields before its value, and its headers, from a buffer on the
/// stack when each part is at most 1,024 bytes, and field by field
/// otherwise; a value is copied into the request up to 65,535 bytes and
/// referenced past that. Each shape goes through outboxd's own send path
/// (a header list with room for its headers) and through rdkafka's (a
/// header list without), one after the other into one partition.
#[test]
fn records_of_every_shape_read_back_byte_for_byte() {
    use outboxd::kafka::native::{Outgoing, Topics};
    use rdkafka::message::{Header, OwnedHeaders};

    const TIMESTAMP: i64 = 1_700_000_000_000;
    let brokers = broker().brokers.clone();
    let topic = format!("record-shapes-{}", uuid::Uuid::new_v4().simple());
    create_topics_sized(&brokers, std::slice::from_ref(&topic), 1, &[]);
    let headers = |n: usize, each: usize| -> Vec<(String, Vec<u8>)> {
        (0..n)
            .map(|i| (format!("h{i}"), vec![b'a' + (i % 26) as u8; each]))
            .collect()
    };
    // The header count's varint (1 byte) and one header: name "h0" (1 + 2
    // bytes), value (2 bytes of length, then the value).
    let headers_of = |total: usize| vec![("h0".to_owned(), vec![b'x'; total - 1 - 3 - 2])];
    let shapes: Vec<Shape> = vec![
        (
            Some(b"order-1".to_vec()),
            Some(br#"{"a":1}"#.to_vec()),
            headers(6, 20),
        ),
        (
            Some(Vec::new()),
            Some(Vec::new()),
            vec![(String::new(), Vec::new())],
        ),
        (Some(b"k".to_vec()), None, Vec::new()),
        (Some(vec![b'k'; 2_000]), Some(vec![b'v'; 100]), headers(2, 10)),
        // Keys at the bound: with every record's timestamp the batch's
        // first (a delta of 0, 1 byte) and fewer than 64 records in a
        // batch (an offset delta of 1 byte), the fields before a 10-byte
        // value take the key and 8 bytes more (length 2, attributes 1,
        // the deltas 2, key length 2, value length 1): exactly 1,024,
        // then 1,025.
        (Some(vec![b'k'; 1_016]), Some(vec![b'v'; 10]), headers(1, 1)),
        (Some(vec![b'k'; 1_017]), Some(vec![b'v'; 10]), headers(1, 1)),
        (Some(b"big".to_vec()), Some(vec![b'v'; 70_000]), headers(3, 500)),
        (Some(b"edge".to_vec()), Some(vec![b'v'; 300]), headers_of(1_024)),
        (Some(b"edge+1".to_vec()), Some(vec![b'v'; 300]), headers_of(1_025)),
        (Some(b"many".to_vec()), Some(vec![b'v'; 50]), headers(100, 3)),
    ];
    let producer: Arc<BaseProducer> = Arc::new(
        ClientConfig::new()
            .set("bootstrap.servers", &brokers)
            .set("enable.idempotence", "true")
            .set("linger.ms", "5")
            .create()
            .unwrap(),
    );
    let topics = Topics::new(producer.clone());
    for (key, value, hdrs) in &shapes {
        let record = Outgoing {
            topic: &topic,
            partition: Some(0),
            key: key.as_deref().unwrap_or_default(),
            value: value.as_deref(),
            headers: hdrs.as_slice(),
            timestamp_ms: TIMESTAMP,
        };
        topics.produce(&record, 0).unwrap();
    }
    // rdkafka's path, with a null key and a null header value too.
    let mut theirs = shapes.clone();
    theirs.push((None, Some(b"no key".to_vec()), vec![("null".into(), Vec::new())]));
    for (i, (key, value, hdrs)) in theirs.iter().enumerate() {
        let mut owned = OwnedHeaders::new();
        for (name, v) in hdrs {
            let null = i == theirs.len() - 1;
            owned = owned.insert(Header {
                key: name,
                value: (!null).then_some(v.as_slice()),
            });
        }
        let mut record = BaseRecord::<[u8], [u8]>::to(&topic)
            .partition(0)
            .timestamp(TIMESTAMP)
            .headers(owned);
        if let Some(k) = key {
            record = record.key(k.as_slice());
        }
        if let Some(v) = value {
            record = record.payload(v.as_slice());
        }
        producer.send(record).map_err(|(e, _)| e).unwrap();
    }
    producer.flush(Duration::from_secs(60)).unwrap();
    let read = crate::harness::broker::consume_to_end(&brokers, &[&topic], Duration::from_secs(60));
    let expected: Vec<Shape> = shapes.iter().chain(theirs.iter()).cloned().collect();
    assert_eq!(read.len(), expected.len(), "every record read back");
    for (i, (got, (key, value, hdrs))) in read.iter().zip(&expected).enumerate() {
        let what = format!("record {i} ({} header(s))", hdrs.len());
        match key {
            Some(k) => {
                assert!(!got.null_key, "{what}: not a null key");
                assert_eq!(&got.key_bytes, k, "{what}: key");
            }
            None => assert!(got.null_key, "{what}: a null key"),
        }
        match value {
            Some(v) => {
                assert!(!got.null_value, "{what}: not null");
                assert_eq!(&got.value, v, "{what}: value");
            }
            None => assert!(got.null_value, "{what}: a null value"),
        }
        assert_eq!(&got.headers, hdrs, "{what}: headers");
        let null: Vec<String> = if i == expected.len() - 1 {
            vec!["null".into()]
        } else {
            Vec::new()
        };
        assert_eq!(got.null_headers, null, "{what}: null header values");
    }
}
