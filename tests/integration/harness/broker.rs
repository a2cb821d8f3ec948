//! Apache Kafka for the test run.
//!
//! Every broker here is a real Apache Kafka 4.x node in KRaft mode, started
//! through `scripts/kafka.sh` (the same path the demo, the benchmark and the
//! image check use). Its data lives on disk in a temporary directory, so a
//! node that is killed and restarted keeps its log, as a production broker
//! does.
//!
//! * [`broker`]: one combined broker+controller node per test process,
//!   started on first use and shared by the tests. Set
//!   `OUTBOXD_TEST_KAFKA_BROKERS` to run against an existing Kafka instead.
//! * [`dedicated`]: a single node of a test's own, for tests that stop and
//!   restart the broker.
//! * [`cluster`]: a controller and `n` brokers, replication factor `n` and
//!   `min.insync.replicas = 2` by default, for leader failover.
//!
//! A watchdog per JVM kills it, and removes the node's directory, as soon as
//! the test process exits however it exits. If a broker cannot start, every
//! test that needs it fails with the reason and the broker's log; none skip.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{Headers, Message};
use rdkafka::types::RDKafkaErrorCode;
use rdkafka::{ClientConfig, Offset, TopicPartitionList};

use super::postgres::free_port;
use super::spawn_watchdog;

/// How long a node may take from `run` to "Kafka Server started".
const START_TIMEOUT: Duration = Duration::from_secs(120);

/// One KRaft node: its directory, its client port (brokers only) and the
/// running JVM, if any.
#[derive(Debug)]
pub struct KafkaNode {
    pub node_id: u32,
    pub dir: PathBuf,
    pub port: Option<u16>,
    child: Mutex<Option<Child>>,
}

/// A set of running nodes and the bootstrap list for clients.
#[derive(Debug)]
pub struct Broker {
    pub brokers: String,
    nodes: Vec<KafkaNode>,
}

static BROKER: OnceLock<Result<Broker, String>> = OnceLock::new();

/// The shared broker, started on first use.
pub fn broker() -> &'static Broker {
    match BROKER.get_or_init(start_shared) {
        Ok(b) => b,
        Err(e) => panic!("the test Kafka broker could not start: {e}"),
    }
}

fn start_shared() -> Result<Broker, String> {
    if let Ok(brokers) = std::env::var("OUTBOXD_TEST_KAFKA_BROKERS") {
        return Ok(Broker {
            brokers,
            nodes: Vec::new(),
        });
    }
    start_single()
}

/// A single broker of a test's own, which it may kill and restart.
pub fn dedicated() -> Broker {
    start_single().unwrap_or_else(|e| panic!("a dedicated test broker could not start: {e}"))
}

/// A controller and `brokers` broker nodes. `settings` are extra
/// `server.properties` lines for the brokers (they win over the defaults).
pub fn cluster(brokers: u32, settings: &[&str]) -> Broker {
    start_cluster(brokers, settings)
        .unwrap_or_else(|e| panic!("a {brokers}-broker test cluster could not start: {e}"))
}

/// The repository's `scripts/kafka.sh`.
pub fn kafka_script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/kafka.sh")
}

/// The Apache Kafka version the harness runs (from the broker pom).
pub fn kafka_version() -> &'static str {
    static VERSION: OnceLock<String> = OnceLock::new();
    VERSION.get_or_init(|| {
        let out = Command::new(kafka_script())
            .arg("version")
            .output()
            .expect("run scripts/kafka.sh version");
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    })
}

fn temp_dir(what: &str) -> Result<PathBuf, String> {
    let dir = std::env::temp_dir().join(format!(
        "outboxd-kafka-{what}-{}-{}",
        std::process::id(),
        uuid::Uuid::new_v4().simple()
    ));
    std::fs::create_dir_all(&dir).map_err(|e| format!("create {}: {e}", dir.display()))?;
    Ok(dir)
}

fn start_single() -> Result<Broker, String> {
    let dir = temp_dir("single")?;
    let port = free_port();
    let node = KafkaNode::init(&dir, 1, "broker,controller", Some(port), &[], None, &[])?;
    node.start()?;
    Ok(Broker {
        brokers: format!("127.0.0.1:{port}"),
        nodes: vec![node],
    })
}

fn start_cluster(n: u32, settings: &[&str]) -> Result<Broker, String> {
    let root = temp_dir("cluster")?;
    spawn_dir_cleanup(&root);
    let cport = free_port();
    let voters = format!("100@127.0.0.1:{cport}");
    let cluster_id = {
        // 16 random bytes, unpadded base64url: a UUID's bytes will do.
        let b = uuid::Uuid::new_v4().into_bytes();
        base64url(&b)
    };
    let rf = n.min(3);
    let mut defaults = vec![
        format!("default.replication.factor={rf}"),
        format!("min.insync.replicas={}", rf.min(2)),
        format!("offsets.topic.replication.factor={rf}"),
        format!("transaction.state.log.replication.factor={rf}"),
        format!("transaction.state.log.min.isr={}", rf.min(2)),
        // Leaders move back to the preferred replica quickly after a restart.
        "leader.imbalance.check.interval.seconds=5".to_owned(),
    ];
    defaults.extend(settings.iter().map(|s| (*s).to_owned()));
    let controller_dir = root.join("controller");
    // With eligible leader replicas (on by default since Kafka 4.1) the
    // controller writes the cluster-wide min.insync.replicas default from
    // its own config, and that default wins over the brokers' static one.
    let controller_settings = [format!("min.insync.replicas={}", rf.min(2))];
    let controller_refs: Vec<&str> = controller_settings.iter().map(String::as_str).collect();
    let controller = KafkaNode::init(
        &controller_dir,
        100,
        "controller",
        None,
        &[("--controller-port", cport.to_string())],
        Some((&voters, &cluster_id)),
        &controller_refs,
    )?;
    let mut nodes = Vec::new();
    // Format in parallel: each format is a JVM start of its own.
    let handles: Vec<_> = (1..=n)
        .map(|id| {
            let dir = root.join(format!("broker-{id}"));
            let voters = voters.clone();
            let cluster_id = cluster_id.clone();
            let defaults = defaults.clone();
            let port = free_port();
            std::thread::spawn(move || {
                let refs: Vec<&str> = defaults.iter().map(String::as_str).collect();
                KafkaNode::init(
                    &dir,
                    id,
                    "broker",
                    Some(port),
                    &[],
                    Some((&voters, &cluster_id)),
                    &refs,
                )
            })
        })
        .collect();
    controller.spawn()?;
    nodes.push(controller);
    for h in handles {
        let node = h.join().map_err(|_| "a format thread panicked".to_owned())??;
        node.spawn()?;
        nodes.push(node);
    }
    for node in &nodes {
        node.wait_started()?;
    }
    let brokers = nodes
        .iter()
        .filter_map(|n| n.port.map(|p| format!("127.0.0.1:{p}")))
        .collect::<Vec<_>>()
        .join(",");
    let b = Broker { brokers, nodes };
    b.wait_brokers_registered(n as usize, START_TIMEOUT)?;
    Ok(b)
}

/// Base64 with the URL-safe alphabet and no padding.
pub fn base64url(bytes: &[u8]) -> String {
    const A: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
    let mut out = String::new();
    for chunk in bytes.chunks(3) {
        let n = chunk
            .iter()
            .enumerate()
            .fold(0u32, |acc, (i, b)| acc | (u32::from(*b) << (16 - 8 * i)));
        for i in 0..=chunk.len() {
            out.push(A[((n >> (18 - 6 * i)) & 63) as usize] as char);
        }
    }
    out
}

impl KafkaNode {
    /// Writes `server.properties` and formats the storage (`kafka.sh init`).
    fn init(
        dir: &Path,
        node_id: u32,
        roles: &str,
        port: Option<u16>,
        options: &[(&str, String)],
        quorum: Option<(&str, &str)>,
        settings: &[&str],
    ) -> Result<KafkaNode, String> {
        let mut cmd = Command::new(kafka_script());
        cmd.arg("init")
            .arg(dir)
            .args(["--node-id", &node_id.to_string(), "--roles", roles]);
        if let Some(p) = port {
            cmd.args(["--port", &p.to_string()]);
        }
        for (k, v) in options {
            cmd.args([*k, v.as_str()]);
        }
        if let Some((voters, cluster_id)) = quorum {
            cmd.args(["--voters", voters, "--cluster-id", cluster_id]);
        }
        for s in settings {
            cmd.args(["--set", s]);
        }
        let out = cmd
            .stdin(Stdio::null())
            .output()
            .map_err(|e| format!("cannot run scripts/kafka.sh: {e}"))?;
        if !out.status.success() {
            return Err(format!(
                "scripts/kafka.sh init failed:\n{}",
                String::from_utf8_lossy(&out.stderr)
            ));
        }
        spawn_dir_cleanup(dir);
        Ok(KafkaNode {
            node_id,
            dir: dir.to_owned(),
            port,
            child: Mutex::new(None),
        })
    }

    fn log_file(&self) -> PathBuf {
        self.dir.join("server.log")
    }

    /// Starts the JVM (`kafka.sh run` execs java, so the child is the JVM).
    fn spawn(&self) -> Result<(), String> {
        let log = std::fs::File::create(self.log_file()).map_err(|e| e.to_string())?;
        let child = Command::new(kafka_script())
            .arg("run")
            .arg(&self.dir)
            .stdin(Stdio::null())
            .stdout(log.try_clone().map_err(|e| e.to_string())?)
            .stderr(log)
            .spawn()
            .map_err(|e| format!("cannot run scripts/kafka.sh: {e}"))?;
        spawn_kill_watchdog(child.id());
        *self.child.lock().map_err(|e| e.to_string())? = Some(child);
        Ok(())
    }

    /// Waits for the node's "Kafka Server started" line.
    fn wait_started(&self) -> Result<(), String> {
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            let log = std::fs::read_to_string(self.log_file()).unwrap_or_default();
            if log.contains("Kafka Server started") {
                // The JVM says which Kafka it is; it must be the pom's.
                let want = format!("Kafka version: {}", kafka_version());
                return if log.contains(&want) {
                    Ok(())
                } else {
                    Err(format!("node {} does not log {want:?}:\n{log}", self.node_id))
                };
            }
            let exited = self
                .child
                .lock()
                .map_err(|e| e.to_string())?
                .as_mut()
                .map(|c| c.try_wait().ok().flatten().is_some())
                .unwrap_or(true);
            if exited || Instant::now() > deadline {
                let tail: Vec<&str> = log.lines().rev().take(40).collect();
                let tail: Vec<&str> = tail.into_iter().rev().collect();
                return Err(format!(
                    "Kafka node {} in {} {} :\n{}",
                    self.node_id,
                    self.dir.display(),
                    if exited {
                        "exited during start-up"
                    } else {
                        "was not ready in time"
                    },
                    tail.join("\n")
                ));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn start(&self) -> Result<(), String> {
        self.spawn()?;
        self.wait_started()
    }

    /// SIGKILL, as a crash or an OOM kill would do it.
    fn kill(&self) {
        if let Ok(mut guard) = self.child.lock() {
            if let Some(mut c) = guard.take() {
                let _ = c.kill();
                let _ = c.wait();
            }
        }
    }

    fn is_running(&self) -> bool {
        self.child.lock().map(|g| g.is_some()).unwrap_or(false)
    }
}

impl Broker {
    fn broker_node(&self, node_id: u32) -> &KafkaNode {
        self.nodes
            .iter()
            .find(|n| n.node_id == node_id && n.port.is_some())
            .unwrap_or_else(|| panic!("no broker with node id {node_id} in this cluster"))
    }

    /// The process ids of the running JVMs (the benchmark reads their CPU).
    #[allow(dead_code)]
    pub fn pids(&self) -> Vec<u32> {
        self.nodes
            .iter()
            .filter_map(|n| n.child.lock().ok().and_then(|c| c.as_ref().map(Child::id)))
            .collect()
    }

    /// Kills every broker process with SIGKILL (fault tests). The data on
    /// disk stays, as after a crash.
    pub fn kill(&self) {
        for n in self.nodes.iter().filter(|n| n.port.is_some()) {
            n.kill();
        }
    }

    /// Starts the killed brokers again, on the same ports, and waits.
    pub fn restart(&self) {
        for n in self.nodes.iter().filter(|n| n.port.is_some() && !n.is_running()) {
            n.start().expect("restart the test broker");
        }
    }

    /// Sends `signal` (`STOP`, `CONT`) to every broker process: a broker
    /// that hangs without closing its connections.
    pub fn signal(&self, signal: &str) {
        for n in self.nodes.iter().filter(|n| n.port.is_some()) {
            let pid = n.child.lock().ok().and_then(|c| c.as_ref().map(Child::id));
            if let Some(pid) = pid {
                let status = Command::new("kill")
                    .args([format!("-{signal}"), pid.to_string()])
                    .status()
                    .expect("kill");
                assert!(status.success(), "kill -{signal} {pid}");
            }
        }
    }

    /// SIGKILL to one broker of a cluster.
    pub fn kill_node(&self, node_id: u32) {
        self.broker_node(node_id).kill();
    }

    /// Starts one killed broker of a cluster again and waits until it runs.
    pub fn restart_node(&self, node_id: u32) {
        self.broker_node(node_id)
            .start()
            .unwrap_or_else(|e| panic!("restart broker {node_id}: {e}"));
    }

    /// A partition's metadata as the cluster reports it now.
    fn partition<T>(
        &self,
        topic: &str,
        partition: i32,
        read: impl FnOnce(&rdkafka::metadata::MetadataPartition) -> T,
    ) -> Option<T> {
        let md = metadata_client(&self.brokers)
            .fetch_metadata(Some(topic), Duration::from_secs(10))
            .ok()?;
        let t = md.topics().iter().find(|t| t.name() == topic)?;
        t.partitions().iter().find(|p| p.id() == partition).map(read)
    }

    /// The leader of `topic`/`partition` as the cluster reports it now.
    pub fn leader_of(&self, topic: &str, partition: i32) -> Option<u32> {
        self.partition(topic, partition, |p| u32::try_from(p.leader()).ok())
            .flatten()
    }

    /// The in-sync replica count of `topic`/`partition` as reported now.
    pub fn isr_count(&self, topic: &str, partition: i32) -> Option<usize> {
        self.partition(topic, partition, |p| p.isr().len())
    }

    fn wait_brokers_registered(&self, n: usize, timeout: Duration) -> Result<(), String> {
        let consumer = metadata_client(&self.brokers);
        let deadline = Instant::now() + timeout;
        loop {
            if let Ok(md) = consumer.fetch_metadata(None, Duration::from_secs(5)) {
                if md.brokers().len() >= n {
                    return Ok(());
                }
            }
            if Instant::now() > deadline {
                return Err(format!("fewer than {n} brokers registered within {timeout:?}"));
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }
}

fn metadata_client(brokers: &str) -> BaseConsumer {
    ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("topic.metadata.refresh.interval.ms", "1000")
        .create()
        .expect("metadata client")
}

/// Kills `pid` with SIGKILL as soon as this test process is gone.
fn spawn_kill_watchdog(pid: u32) {
    spawn_watchdog(&format!("kill -9 {pid} 2>/dev/null"));
}

/// Removes `dir` as soon as this test process is gone (after the JVMs die).
fn spawn_dir_cleanup(dir: &Path) {
    spawn_watchdog(&format!("sleep 2; rm -rf '{}'", dir.display()));
}

/// Creates `topics` with 3 partitions and waits until each partition has a
/// leader. Debezium's Java producer, writing to a topic Connect has just
/// created on Kafka 4.4, was seen stuck for good on
/// OUT_OF_ORDER_SEQUENCE_NUMBER (the same moment outboxd's readiness check
/// guards), so the tests create the topics first, as a careful deployment
/// with auto-creation off does.
pub fn create_topics(brokers: &str, topics: &[String]) {
    create_topics_with(brokers, topics, &[]);
}

/// [`create_topics`] with topic settings (`message.timestamp.type`, ...).
pub fn create_topics_with(brokers: &str, topics: &[String], settings: &[(&str, &str)]) {
    create_topics_sized(brokers, topics, 3, settings);
}

/// [`create_topics_with`] with `partitions` partitions each (a progress
/// topic has one).
pub fn create_topics_sized(brokers: &str, topics: &[String], partitions: i32, settings: &[(&str, &str)]) {
    use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
    use rdkafka::client::DefaultClientContext;
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .create()
        .unwrap();
    let new: Vec<NewTopic> = topics
        .iter()
        .map(|t| {
            settings.iter().fold(
                NewTopic::new(t, partitions, TopicReplication::Fixed(1)),
                |n, (k, v)| n.set(k, v),
            )
        })
        .collect();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    for r in rt
        .block_on(admin.create_topics(&new, &AdminOptions::new()))
        .unwrap()
    {
        r.unwrap();
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    for t in topics {
        loop {
            let md = admin
                .inner()
                .fetch_metadata(Some(t), Duration::from_secs(5))
                .unwrap();
            let ready = md.topics().iter().any(|m| {
                m.name() == t
                    && m.partitions().len() == partitions as usize
                    && m.partitions().iter().all(|p| p.leader() >= 0)
            });
            if ready {
                break;
            }
            assert!(Instant::now() < deadline, "topic {t} has no leaders");
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

/// One consumed record, with everything the tests compare.
#[derive(Clone, Debug)]
pub struct Consumed {
    pub topic: String,
    pub partition: i32,
    /// The key as text (lossy); `key_bytes` holds it as sent.
    pub key: String,
    pub key_bytes: Vec<u8>,
    pub value: Vec<u8>,
    /// The value is null (a tombstone), not merely empty.
    pub null_value: bool,
    /// The key is null, not merely empty.
    pub null_key: bool,
    /// Null header values read as empty in `headers`; these are the
    /// names of those that were null.
    pub null_headers: Vec<String>,
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

/// The topics whose name starts with `prefix`.
pub fn topics_with_prefix(brokers: &str, prefix: &str) -> Vec<String> {
    let consumer = metadata_client(brokers);
    let md = consumer
        .fetch_metadata(None, Duration::from_secs(10))
        .expect("cluster metadata");
    md.topics()
        .iter()
        .map(|t| t.name().to_owned())
        .filter(|t| t.starts_with(prefix))
        .collect()
}

/// The records `topic` holds: the sum of its partitions' high watermarks
/// (from offset 0; the tests' topics are never truncated).
pub fn record_count(brokers: &str, topic: &str) -> usize {
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .create()
        .expect("consumer");
    let md = consumer
        .fetch_metadata(Some(topic), Duration::from_secs(10))
        .expect("topic metadata");
    md.topics()
        .iter()
        .filter(|t| t.name() == topic)
        .flat_map(|t| t.partitions().iter().map(|p| p.id()))
        .map(|p| {
            let (_, high) = consumer
                .fetch_watermarks(topic, p, Duration::from_secs(10))
                .expect("watermarks");
            usize::try_from(high).unwrap_or(0)
        })
        .sum()
}

/// Reads every partition of `topics` from the beginning until `want`
/// records have arrived (or `timeout`), in partition-offset order.
/// Transactional records count once committed (`read_committed`).
pub fn consume(brokers: &str, topics: &[&str], want: usize, timeout: Duration) -> Vec<Consumed> {
    consume_isolated(brokers, topics, want, timeout, "read_committed")
}

/// As [`consume`], but also reading records of open and aborted
/// transactions (`read_uncommitted`).
pub fn consume_uncommitted(brokers: &str, topics: &[&str], want: usize, timeout: Duration) -> Vec<Consumed> {
    consume_isolated(brokers, topics, want, timeout, "read_uncommitted")
}

fn consume_isolated(
    brokers: &str,
    topics: &[&str],
    want: usize,
    timeout: Duration,
    isolation: &str,
) -> Vec<Consumed> {
    read(brokers, topics, timeout, isolation, |_, out| out.len() >= want)
}

/// Reads every partition of `topics` from the beginning up to the high
/// watermark each had when the read began, or until `timeout`. For
/// records Kafka has already acknowledged (a relay that confirmed an LSN
/// has had every event before it acknowledged), this reads all of them,
/// however slow the machine, and no more than needed. Only for topics
/// without transactions: their commit markers hold offsets no record is
/// read at.
pub fn consume_to_end(brokers: &str, topics: &[&str], timeout: Duration) -> Vec<Consumed> {
    let mut ends: Option<Vec<(String, i32, i64)>> = None;
    read(brokers, topics, timeout, "read_uncommitted", |consumer, _| {
        let ends = ends.get_or_insert_with(|| {
            let assigned = consumer.assignment().expect("assignment");
            assigned
                .elements()
                .iter()
                .map(|e| {
                    // A partition whose leader is still being elected (a
                    // topic just created) answers after a moment.
                    let mut tries = 0;
                    let (_, high) = loop {
                        match consumer.fetch_watermarks(e.topic(), e.partition(), Duration::from_secs(10)) {
                            Ok(w) => break w,
                            Err(err) if tries < 50 => {
                                tries += 1;
                                eprintln!("watermarks of {} [{}]: {err}; again", e.topic(), e.partition());
                                std::thread::sleep(Duration::from_millis(200));
                            }
                            Err(err) => panic!("watermarks: {err}"),
                        }
                    };
                    (e.topic().to_owned(), e.partition(), high)
                })
                .collect()
        });
        let position = consumer.position().expect("position");
        ends.iter().all(|(topic, partition, high)| {
            *high == 0
                || position
                    .find_partition(topic, *partition)
                    .is_some_and(|e| matches!(e.offset(), Offset::Offset(next) if next >= *high))
        })
    })
}

/// Reads `topics` from the beginning until `done` holds (checked before
/// each poll) or `timeout`.
fn read(
    brokers: &str,
    topics: &[&str],
    timeout: Duration,
    isolation: &str,
    mut done: impl FnMut(&BaseConsumer, &[Consumed]) -> bool,
) -> Vec<Consumed> {
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("isolation.level", isolation)
        .set("group.id", format!("outboxd-test-{}", uuid::Uuid::new_v4()))
        .set("enable.auto.commit", "false")
        .set("enable.partition.eof", "false")
        .create()
        .expect("consumer");
    let deadline = Instant::now() + timeout;
    let mut tpl = TopicPartitionList::new();
    for topic in topics {
        // A topic outboxd has not created yet has no partitions: wait for it.
        loop {
            let partitions: Vec<i32> = consumer
                .fetch_metadata(Some(topic), Duration::from_secs(10))
                .ok()
                .and_then(|md| {
                    md.topics()
                        .iter()
                        .find(|t| t.name() == *topic && t.error().is_none())
                        .map(|t| t.partitions().iter().map(|p| p.id()).collect())
                })
                .unwrap_or_default();
            if !partitions.is_empty() {
                for p in partitions {
                    tpl.add_partition_offset(topic, p, Offset::Beginning)
                        .expect("partition");
                }
                break;
            }
            if Instant::now() > deadline {
                return Vec::new();
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }
    consumer.assign(&tpl).expect("assign");
    let mut out = Vec::new();
    while !done(&consumer, &out) && Instant::now() < deadline {
        match consumer.poll(Duration::from_millis(200)) {
            Some(Ok(m)) => out.push(Consumed {
                topic: m.topic().to_owned(),
                partition: m.partition(),
                key: m
                    .key()
                    .map(|k| String::from_utf8_lossy(k).into_owned())
                    .unwrap_or_default(),
                key_bytes: m.key().unwrap_or_default().to_vec(),
                value: m.payload().unwrap_or_default().to_vec(),
                null_value: m.payload().is_none(),
                null_key: m.key().is_none(),
                null_headers: m
                    .headers()
                    .map(|h| {
                        h.iter()
                            .filter(|h| h.value.is_none())
                            .map(|h| h.key.to_owned())
                            .collect()
                    })
                    .unwrap_or_default(),
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
            // A cluster with brokers down reports them; the read goes on.
            Some(Err(rdkafka::error::KafkaError::MessageConsumption(
                RDKafkaErrorCode::BrokerTransportFailure
                | RDKafkaErrorCode::AllBrokersDown
                | RDKafkaErrorCode::NotLeaderForPartition
                | RDKafkaErrorCode::LeaderNotAvailable,
            ))) => {}
            Some(Err(e)) => panic!("consume error: {e}"),
            None => {}
        }
    }
    out
}
