//! A real Kafka-protocol broker for the test run.
//!
//! By default the harness starts `tansu` (a Kafka-compatible broker with
//! in-memory storage) on a free port, once per test process, and a watchdog
//! kills it when the process exits. Set `OUTBOXD_TEST_KAFKA_BROKERS` to run
//! the tests against an existing Kafka instead. If the broker cannot start,
//! every test that needs it fails with the reason; none skip.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{Headers, Message};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};

use super::postgres::free_port;

#[derive(Debug)]
pub struct Broker {
    pub brokers: String,
    /// The child process, when the harness started it (not for an external broker).
    child: Mutex<Option<Child>>,
    spec: Option<(PathBuf, u16, PathBuf)>,
}

static BROKER: OnceLock<Result<Broker, String>> = OnceLock::new();

/// The shared broker, started on first use.
pub fn broker() -> &'static Broker {
    match BROKER.get_or_init(start) {
        Ok(b) => b,
        Err(e) => panic!("the test Kafka broker could not start: {e}"),
    }
}

fn find_tansu() -> Result<PathBuf, String> {
    if let Some(p) = std::env::var_os("OUTBOXD_TANSU") {
        return Ok(PathBuf::from(p));
    }
    let home = std::env::var_os("HOME").map(PathBuf::from).unwrap_or_default();
    let candidates = [
        home.join(".cargo/bin/tansu"),
        PathBuf::from("/usr/local/bin/tansu"),
    ];
    candidates.into_iter().find(|p| p.exists()).ok_or_else(|| {
        "tansu is not installed: run scripts/setup.sh (cargo install tansu --version 0.6.0 --locked --features dynostore), \
         or set OUTBOXD_TEST_KAFKA_BROKERS to an existing Kafka"
            .to_owned()
    })
}

fn start() -> Result<Broker, String> {
    if let Ok(brokers) = std::env::var("OUTBOXD_TEST_KAFKA_BROKERS") {
        return Ok(Broker {
            brokers,
            child: Mutex::new(None),
            spec: None,
        });
    }
    start_tansu()
}

/// A broker of its own that a fault test may kill and restart (always
/// tansu: an external Kafka cannot be stopped by the tests).
pub fn dedicated() -> Broker {
    start_tansu().unwrap_or_else(|e| panic!("a dedicated test broker could not start: {e}"))
}

fn start_tansu() -> Result<Broker, String> {
    let bin = find_tansu()?;
    let port = free_port();
    let log = std::env::temp_dir().join(format!("outboxd-tansu-{}-{port}.log", std::process::id()));
    let broker = Broker {
        brokers: format!("127.0.0.1:{port}"),
        child: Mutex::new(None),
        spec: Some((bin, port, log)),
    };
    broker.start_process()?;
    Ok(broker)
}

impl Broker {
    fn start_process(&self) -> Result<(), String> {
        let Some((bin, port, log)) = &self.spec else {
            return Err("an external broker cannot be started by the tests".into());
        };
        let url = format!("tcp://127.0.0.1:{port}");
        let log_file = std::fs::File::create(log).map_err(|e| e.to_string())?;
        let child = Command::new(bin)
            .args([
                "broker",
                "--listener-url",
                &url,
                "--advertised-listener-url",
                &url,
            ])
            .args(["--storage-engine", "memory://tansu/"])
            .stdin(Stdio::null())
            .stdout(log_file.try_clone().map_err(|e| e.to_string())?)
            .stderr(log_file)
            .spawn()
            .map_err(|e| format!("cannot run {}: {e}", bin.display()))?;
        let pid = child.id();
        // Kill the broker when the test process goes away, however it goes.
        let _ = Command::new("sh")
            .arg("-c")
            .arg(format!(
                "while kill -0 {} 2>/dev/null; do sleep 0.5; done; kill -9 {pid} 2>/dev/null",
                std::process::id()
            ))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn();
        *self.child.lock().map_err(|e| e.to_string())? = Some(child);
        let deadline = Instant::now() + Duration::from_secs(30);
        while std::net::TcpStream::connect(("127.0.0.1", *port)).is_err() {
            if Instant::now() > deadline {
                let text = std::fs::read_to_string(log).unwrap_or_default();
                return Err(format!("tansu did not listen on {port} within 30s:\n{text}"));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(())
    }

    /// Stops the broker process (fault tests). Its in-memory data is lost.
    pub fn kill(&self) {
        if let Ok(mut guard) = self.child.lock() {
            if let Some(mut c) = guard.take() {
                let _ = c.kill();
                let _ = c.wait();
            }
        }
    }

    /// Starts the broker process again after [`Broker::kill`], on the same port.
    pub fn restart(&self) {
        self.start_process().expect("restart the test broker");
    }
}

/// One consumed record, with everything the tests compare.
#[derive(Clone, Debug)]
pub struct Consumed {
    pub topic: String,
    pub key: String,
    pub value: Vec<u8>,
    pub headers: Vec<(String, Vec<u8>)>,
    pub timestamp_ms: Option<i64>,
}

impl Consumed {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .and_then(|(_, v)| std::str::from_utf8(v).ok())
    }
}

/// Reads every partition of `topics` from the beginning until `want`
/// records have arrived (or `timeout`), in partition-offset order.
pub fn consume(brokers: &str, topics: &[&str], want: usize, timeout: Duration) -> Vec<Consumed> {
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("group.id", format!("outboxd-test-{}", uuid::Uuid::new_v4()))
        .set("enable.auto.commit", "false")
        .set("enable.partition.eof", "false")
        .create()
        .expect("consumer");
    let mut tpl = TopicPartitionList::new();
    for topic in topics {
        let md = consumer
            .fetch_metadata(Some(topic), Duration::from_secs(10))
            .expect("topic metadata");
        for t in md.topics() {
            for p in t.partitions() {
                tpl.add_partition_offset(topic, p.id(), Offset::Beginning)
                    .expect("partition");
            }
        }
    }
    consumer.assign(&tpl).expect("assign");
    let mut out = Vec::new();
    let deadline = Instant::now() + timeout;
    while out.len() < want && Instant::now() < deadline {
        match consumer.poll(Duration::from_millis(200)) {
            Some(Ok(m)) => out.push(Consumed {
                topic: m.topic().to_owned(),
                key: m
                    .key()
                    .map(|k| String::from_utf8_lossy(k).into_owned())
                    .unwrap_or_default(),
                value: m.payload().unwrap_or_default().to_vec(),
                headers: m
                    .headers()
                    .map(|h| {
                        h.iter()
                            .map(|h| (h.key.to_owned(), h.value.unwrap_or_default().to_vec()))
                            .collect()
                    })
                    .unwrap_or_default(),
                timestamp_ms: m.timestamp().to_millis(),
            }),
            Some(Err(e)) => panic!("consume error: {e}"),
            None => {}
        }
    }
    out
}
