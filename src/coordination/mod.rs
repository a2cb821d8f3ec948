//! Sources spread over replicas: assignment through a Kafka consumer group.
//!
//! # Shape
//!
//! With `[coordination]` ([`crate::config::coordination`]) and more than
//! one source, each replica joins a Kafka consumer group instead of trying
//! every source. The sources of one weight form a *class*: the class's
//! sources, sorted by name, are the partitions of one small coordination
//! topic (partition `i` is the `i`-th source), and one consumer per class
//! joins the class's group with the cooperative-sticky assignor. The
//! replica assigned a source's partition is the one that *tries* to lead
//! it; nothing is ever written to or read from these topics, they only
//! carry the group's membership.
//!
//! * The **PostgreSQL lease stays the fence.** Assignment only decides who
//!   starts a relay; the relay still takes the source's lease before it
//!   streams and checks it before every send. A split or slow rebalance
//!   can put two relays on one source, one of them standing by, never two
//!   publishing.
//! * **Sticky and incremental.** The cooperative protocol revokes only the
//!   partitions that move, and assigns them to their new owner only in the
//!   next round, after the old owner has answered the revoke. The answer
//!   waits for the supervisor to drain the moved sources (every
//!   acknowledged LSN confirmed, the lease released with the relay), so a
//!   moved source is drained on its old owner before the new one starts,
//!   and the lease guards the same order again.
//! * **Weights.** Each class is balanced on its own, so heavy sources
//!   spread over the replicas whatever the light ones do. Counts within a
//!   class differ by at most one between replicas.
//! * **The topics are named by the class's members** (a digest of the
//!   sorted names): replicas that run different files (a rollout, a
//!   reload) never read one partition as two sources. A changed set of
//!   sources moves the group to a new topic, which reassigns every source
//!   once; old topics hold no data and may be deleted.
//!
//! # Failure
//!
//! A replica that stops (SIGKILL, a crash, a lost network) leaves the group
//! after `session_timeout`; its sources are assigned to the others, whose
//! relays stand by until its lease has expired (`postgres.leader_timeout`;
//! at once when the process died and its connection closed). A replica
//! whose session expired (a SIGSTOP, a long pause) hears a revoke with
//! `lost` when it wakes: its relays are stopped, and their fenced lease
//! already kept them from publishing.
//!
//! The consumer's thread answers the revoke callback only once the drain is
//! done; `max.poll.interval.ms` is set above the drain's bound so the group
//! does not expel a replica for draining.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::{ClientContext, DefaultClientContext};
use rdkafka::config::{ClientConfig, RDKafkaLogLevel};
use rdkafka::consumer::{BaseConsumer, Consumer, ConsumerContext, Rebalance};
use rdkafka::error::KafkaError;
use rdkafka::types::RDKafkaErrorCode;
use rdkafka::TopicPartitionList;
use serde::Serialize;
use tokio::sync::mpsc;

use crate::config::{CoordinationConfig, KafkaConfig};
use crate::kafka::sink::describe_config_error;

/// The sources of one weight: one consumer group over one topic.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Class {
    pub weight: u32,
    /// The consumer group: `<group>` for weight 1, `<group>.w<weight>`
    /// for the others.
    pub group: String,
    /// `<group>.sources.w<weight>.<digest of the sorted names>`.
    pub topic: String,
    /// Sorted: partition `i` is `sources[i]`.
    pub sources: Vec<String>,
}

/// The classes of `sources` (name, weight), lightest first.
pub fn classes(group: &str, sources: &[(String, u32)]) -> Vec<Class> {
    let mut by_weight: BTreeMap<u32, Vec<String>> = BTreeMap::new();
    for (name, weight) in sources {
        by_weight.entry(*weight).or_default().push(name.clone());
    }
    by_weight
        .into_iter()
        .map(|(weight, mut names)| {
            names.sort();
            names.dedup();
            let digest = fnv1a(names.join("\n").as_bytes());
            Class {
                weight,
                group: if weight == 1 {
                    group.to_owned()
                } else {
                    format!("{group}.w{weight}")
                },
                topic: format!("{group}.sources.w{weight}.{digest:016x}"),
                sources: names,
            }
        })
        .collect()
}

/// FNV-1a, 64 bits: a digest every replica computes alike, on any
/// platform and release (the standard library's hasher promises neither).
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// What the group decided, for the supervisor.
#[derive(Debug)]
pub enum Event {
    /// These sources of the group `group` are this replica's now: start
    /// them. Sent after every rebalance of the group, also when it assigns
    /// nothing new (after a lost session, that says which sources are no
    /// longer this replica's).
    Assigned { group: String, sources: Vec<String> },
    /// These sources are no longer this replica's: send on `done` when the
    /// event is picked up, drain them, then drop `done`. The group assigns
    /// them elsewhere only after.
    Revoked {
        sources: Vec<String>,
        /// The session had expired: the group may have assigned them to
        /// another replica already.
        lost: bool,
        done: std::sync::mpsc::SyncSender<()>,
    },
    /// The group cannot be joined with these settings (the consumer could
    /// not be made, or not subscribe): this replica would never lead
    /// anything, so its sources fail with the error.
    Failed(String),
}

/// The group as this replica sees it, for `/status` and the metrics.
#[derive(Clone, Debug, Default, Serialize, serde::Deserialize, PartialEq)]
pub struct Status {
    pub group: String,
    pub replica: String,
    /// The sources assigned to this replica.
    pub assigned: BTreeSet<String>,
    /// Rebalances this replica took part in (an assignment or a revoke
    /// that changed what it holds), since it started.
    pub rebalances: u64,
    pub classes: Vec<ClassStatus>,
}

impl Status {
    /// Why this replica is not a healthy member of its group: a group it
    /// holds no place in (yet: a replica is ready once the group has
    /// assigned it its share, so a rollout waits for it; or no longer: its
    /// session expired), with the consumer's last error. Empty when it is a
    /// member, also while it leads nothing because others lead every
    /// source.
    pub fn not_ready_reasons(&self) -> Vec<String> {
        self.classes
            .iter()
            .filter(|c| !c.member)
            .map(|c| match &c.error {
                Some(e) => format!("not a member of the replicas' group {}: {e}", c.group),
                None => format!("not a member of the replicas' group {} (joining)", c.group),
            })
            .collect()
    }
}

/// One class's group.
#[derive(Clone, Debug, Default, Serialize, serde::Deserialize, PartialEq)]
pub struct ClassStatus {
    pub group: String,
    pub topic: String,
    pub weight: u32,
    pub sources: usize,
    /// Whether the replica holds a place in the group (it has been assigned
    /// a share since it joined or last lost its session).
    pub member: bool,
    /// The last error of the group's consumer, until it recovers.
    pub error: Option<String>,
}

/// The status, shared between the consumer threads and the HTTP server.
#[derive(Debug, Default)]
pub struct Board {
    status: Mutex<Status>,
}

impl Board {
    pub fn status(&self) -> Status {
        self.lock().clone()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Status> {
        self.status
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn class(&self, group: &str, f: impl FnOnce(&mut ClassStatus)) {
        if let Some(c) = self.lock().classes.iter_mut().find(|c| c.group == group) {
            f(c);
        }
    }

    /// The coordination metrics, in the text exposition format.
    pub fn metrics_text(&self) -> String {
        self.status().metrics_text()
    }
}

impl Status {
    /// Its metrics, in the text exposition format (empty, with a warning,
    /// should the `prometheus` crate refuse them).
    pub fn metrics_text(&self) -> String {
        let families = match self.metric_families() {
            Ok(f) => f,
            Err(e) => {
                tracing::warn!(error = %e, "the coordination metrics could not be gathered");
                return String::new();
            }
        };
        let mut buf = Vec::new();
        if let Err(e) = prometheus::Encoder::encode(&prometheus::TextEncoder::new(), &families, &mut buf) {
            tracing::warn!(error = %e, "the coordination metrics could not be encoded");
            return String::new();
        }
        String::from_utf8(buf).unwrap_or_default()
    }

    fn metric_families(&self) -> prometheus::Result<Vec<prometheus::proto::MetricFamily>> {
        let registry = prometheus::Registry::new();
        let rebalances = prometheus::IntCounter::new(
            "outboxd_coordination_rebalances_total",
            "Rebalances of the replicas' group that changed what this replica leads.",
        )?;
        rebalances.inc_by(self.rebalances);
        registry.register(Box::new(rebalances))?;
        let assigned = prometheus::IntGauge::new(
            "outboxd_coordination_assigned_sources",
            "Sources the replicas' group assigns to this replica.",
        )?;
        assigned.set(i64::try_from(self.assigned.len()).unwrap_or(i64::MAX));
        registry.register(Box::new(assigned))?;
        let member = prometheus::IntGaugeVec::new(
            prometheus::Opts::new(
                "outboxd_coordination_member",
                "1 while this replica holds a place in the group of a weight's sources.",
            ),
            &["weight"],
        )?;
        for c in &self.classes {
            member
                .with_label_values(&[c.weight.to_string()])
                .set(i64::from(c.member));
        }
        registry.register(Box::new(member))?;
        Ok(registry.gather())
    }
}

/// The group's consumers, one thread each.
#[derive(Debug)]
pub struct Coordinator {
    closing: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
    board: Arc<Board>,
}

/// The settings a coordinator runs with.
#[derive(Clone, Debug)]
pub struct Settings {
    pub config: CoordinationConfig,
    pub kafka: KafkaConfig,
    /// How long a revoke may wait for its drain (the supervisor's bound).
    pub drain_bound: Duration,
}

impl Coordinator {
    /// Joins the group of each class on a thread of its own; what the
    /// group decides arrives on `events`.
    pub fn spawn(
        settings: &Settings,
        classes: Vec<Class>,
        events: mpsc::UnboundedSender<Event>,
    ) -> Coordinator {
        let replica = settings.config.replica_name();
        let board = Arc::new(Board::default());
        {
            let mut s = board.lock();
            s.group = settings.config.group.clone();
            s.replica = replica.clone();
            s.classes = classes
                .iter()
                .map(|c| ClassStatus {
                    group: c.group.clone(),
                    topic: c.topic.clone(),
                    weight: c.weight,
                    sources: c.sources.len(),
                    member: false,
                    error: None,
                })
                .collect();
        }
        let closing = Arc::new(AtomicBool::new(false));
        let threads = classes
            .into_iter()
            .filter_map(|class| {
                let context = GroupContext {
                    class: class.clone(),
                    events: events.clone(),
                    closing: closing.clone(),
                    board: board.clone(),
                    drain_bound: settings.drain_bound,
                };
                let settings = settings.clone();
                let replica = replica.clone();
                let name = format!("outboxd-coord-w{}", class.weight);
                let runtime = tokio::runtime::Handle::current();
                match std::thread::Builder::new()
                    .name(name)
                    .spawn(move || member(&settings, &replica, &class, context, runtime))
                {
                    Ok(t) => Some(t),
                    Err(e) => {
                        tracing::error!(error = %e, "cannot start the coordination thread; this replica leads none of its sources");
                        None
                    }
                }
            })
            .collect();
        Coordinator {
            closing,
            threads,
            board,
        }
    }

    pub fn board(&self) -> Arc<Board> {
        self.board.clone()
    }

    /// Leaves the group (the supervisor has drained every source first):
    /// the other replicas are assigned this one's sources at once.
    pub async fn close(self) {
        self.closing.store(true, Ordering::SeqCst);
        let threads = self.threads;
        let _ = tokio::task::spawn_blocking(move || {
            for t in threads {
                let _ = t.join();
            }
        })
        .await;
    }
}

/// How often the consumer's thread polls (and sees `closing`).
const POLL: Duration = Duration::from_millis(200);
/// How long to wait before trying again to set the group up.
const RETRY: Duration = Duration::from_secs(5);
/// How long a revoke may wait, beyond a drain's bound, for the supervisor
/// to pick it up.
const PICK_UP_MARGIN: Duration = Duration::from_secs(30);

/// `max.poll.interval.ms`: a revoke waits for its pick-up and its drain,
/// and the group must not expel a replica meanwhile (librdkafka also wants
/// it at least `session.timeout.ms`).
fn max_poll_interval(settings: &Settings) -> Duration {
    (settings.drain_bound * 2 + PICK_UP_MARGIN * 2).max(settings.config.session_timeout.0)
}

/// One class's member: creates its topic, joins the group, polls until
/// closing. Errors are logged and retried: a replica that cannot join leads
/// nothing, and the others lead its share.
fn member(
    settings: &Settings,
    replica: &str,
    class: &Class,
    context: GroupContext,
    runtime: tokio::runtime::Handle,
) {
    let closing = context.closing.clone();
    let board = context.board.clone();
    let events = context.events.clone();
    let consumer: BaseConsumer<GroupContext> = match consumer_config(settings, replica, class)
        .create_with_context(context)
    {
        Ok(c) => c,
        Err(e) => {
            let error = format!(
                "cannot join the replicas' group {}: {}; fix [coordination] or kafka.options and start outboxd again",
                class.group,
                describe_config_error(&e, &settings.kafka)
            );
            board.class(&class.group, |c| c.error = Some(error.clone()));
            let _ = events.send(Event::Failed(error));
            return;
        }
    };
    // The topic first: a subscription to a topic that does not exist yet
    // is assigned nothing until the next metadata refresh.
    loop {
        if closing.load(Ordering::SeqCst) {
            return;
        }
        match ensure_topic(settings, class, &consumer, &runtime) {
            Ok(()) => break,
            Err(error) => {
                tracing::warn!(group = %class.group, topic = %class.topic, %error, "cannot set up the coordination topic; retrying in 5s (this replica leads none of these sources meanwhile)");
                board.class(&class.group, |c| c.error = Some(error));
                sleep_unless(&closing, RETRY);
            }
        }
    }
    if let Err(e) = consumer.subscribe(&[&class.topic]) {
        let error = format!(
            "cannot join the replicas' group {} over {}: {e}",
            class.group, class.topic
        );
        board.class(&class.group, |c| c.error = Some(error.clone()));
        let _ = events.send(Event::Failed(error));
        return;
    }
    tracing::info!(group = %class.group, topic = %class.topic, replica, sources = ?class.sources, "joined the replicas' group; waiting for an assignment");
    // Set when the topic was reported gone (an operator cleaning up old
    // coordination topics): librdkafka says so once, and the group assigns
    // nothing until it is back, so it is made again every RETRY until it
    // shows in the metadata.
    let mut missing: Option<Instant> = None;
    while !closing.load(Ordering::SeqCst) {
        match consumer.poll(POLL) {
            None | Some(Ok(_)) => {}
            Some(Err(e)) => {
                tracing::warn!(group = %class.group, error = %e, "the replicas' group reported an error");
                board.class(&class.group, |c| c.error = Some(e.to_string()));
                let gone = matches!(
                    e.rdkafka_error_code(),
                    Some(RDKafkaErrorCode::UnknownTopicOrPartition | RDKafkaErrorCode::UnknownTopic)
                );
                if gone && missing.is_none() {
                    missing = Some(Instant::now() - RETRY);
                }
            }
        }
        if missing.is_some_and(|t| t.elapsed() >= RETRY) {
            match ensure_topic(settings, class, &consumer, &runtime) {
                Ok(()) => {
                    tracing::warn!(group = %class.group, topic = %class.topic, "the coordination topic was gone and is there again; the group assigns the sources anew");
                    missing = None;
                }
                Err(error) => {
                    tracing::warn!(group = %class.group, %error, "the coordination topic is gone and cannot be made again yet; retrying in 5s");
                    board.class(&class.group, |c| c.error = Some(error));
                    missing = Some(Instant::now());
                }
            }
        }
    }
    // Dropping the consumer leaves the group; the revoke it hears then is
    // answered at once (the supervisor has drained every source).
    drop(consumer);
    board.class(&class.group, |c| c.member = false);
    tracing::info!(group = %class.group, "left the replicas' group");
}

fn sleep_unless(closing: &AtomicBool, total: Duration) {
    let end = Instant::now() + total;
    while !closing.load(Ordering::SeqCst) && Instant::now() < end {
        std::thread::sleep(POLL);
    }
}

/// The brokers and the connection settings of `kafka.options` (security,
/// SASL, TLS), without what only a producer knows.
fn connection(kafka: &KafkaConfig) -> ClientConfig {
    let mut c = ClientConfig::new();
    c.set("bootstrap.servers", &kafka.brokers);
    for (k, v) in &kafka.options {
        if !crate::kafka::sink::PRODUCER_ONLY.contains(&k.as_str()) {
            c.set(k, v);
        }
    }
    c
}

/// A consumer of the group: the connection settings of `kafka.options`,
/// cooperative-sticky, no offsets.
fn consumer_config(settings: &Settings, replica: &str, class: &Class) -> ClientConfig {
    let mut c = connection(&settings.kafka);
    let ms = |d: Duration| d.as_millis().min(i32::MAX as u128).to_string();
    c.set("client.id", format!("outboxd-{replica}"))
        .set("group.id", &class.group)
        .set("group.protocol", "classic")
        .set("partition.assignment.strategy", "cooperative-sticky")
        .set("session.timeout.ms", ms(settings.config.session_timeout.0))
        .set("heartbeat.interval.ms", ms(settings.config.heartbeat_interval.0))
        .set("max.poll.interval.ms", ms(max_poll_interval(settings)))
        .set("enable.auto.commit", "false")
        .set("enable.auto.offset.store", "false")
        .set("enable.partition.eof", "false")
        .set("auto.offset.reset", "latest")
        .set("topic.metadata.refresh.interval.ms", "10000")
        .set_log_level(RDKafkaLogLevel::Warning);
    c
}

/// Creates the class's topic (one partition per source) unless it
/// exists, and checks its partitions.
fn ensure_topic(
    settings: &Settings,
    class: &Class,
    consumer: &BaseConsumer<GroupContext>,
    runtime: &tokio::runtime::Handle,
) -> Result<(), String> {
    let want = class.sources.len();
    let timeout = settings.kafka.admin_timeout.0;
    let partitions = |consumer: &BaseConsumer<GroupContext>| -> Result<Option<usize>, String> {
        let md = consumer
            .fetch_metadata(Some(&class.topic), timeout)
            .map_err(|e| format!("cannot read the metadata of {}: {e}", class.topic))?;
        Ok(md
            .topics()
            .iter()
            .find(|t| t.name() == class.topic && t.error().is_none())
            .map(|t| t.partitions().len())
            .filter(|n| *n > 0))
    };
    if partitions(consumer)?.is_none() {
        let admin: AdminClient<DefaultClientContext> = connection(&settings.kafka).create().map_err(|e| {
            format!(
                "cannot create an admin client: {}",
                describe_config_error(&e, &settings.kafka)
            )
        })?;
        let topic = NewTopic::new(
            &class.topic,
            i32::try_from(want).unwrap_or(i32::MAX),
            TopicReplication::Fixed(settings.kafka.topic_replication_factor),
        );
        let opts = AdminOptions::new().operation_timeout(Some(timeout));
        let results = runtime
            .block_on(admin.create_topics([&topic], &opts))
            .map_err(|e| format!("cannot create {}: {e}", class.topic))?;
        for r in results {
            match r {
                Ok(_) => tracing::info!(topic = %class.topic, partitions = want, "created the coordination topic"),
                Err((_, RDKafkaErrorCode::TopicAlreadyExists)) => {}
                Err((_, code)) => {
                    return Err(format!(
                        "cannot create {} ({code}): grant outboxd's principal CREATE and DESCRIBE on topics {}.sources.*, or create it with {want} partitions",
                        class.topic, settings.config.group
                    ))
                }
            }
        }
    }
    let deadline = Instant::now() + timeout;
    loop {
        match partitions(consumer)? {
            Some(n) if n == want => return Ok(()),
            Some(n) => {
                return Err(format!(
                    "the coordination topic {} has {n} partitions, not {want} (one per source of weight {}): it was made by hand; delete it and outboxd makes it",
                    class.topic, class.weight
                ))
            }
            None if Instant::now() < deadline => std::thread::sleep(POLL),
            None => return Err(format!("the coordination topic {} does not show up in the metadata", class.topic)),
        }
    }
}

/// The consumer's context: turns rebalances into [`Event`]s.
struct GroupContext {
    class: Class,
    events: mpsc::UnboundedSender<Event>,
    closing: Arc<AtomicBool>,
    board: Arc<Board>,
    drain_bound: Duration,
}

impl GroupContext {
    fn names(&self, tpl: &TopicPartitionList) -> Vec<String> {
        tpl.elements()
            .iter()
            .filter(|e| e.topic() == self.class.topic)
            .filter_map(|e| usize::try_from(e.partition()).ok())
            .filter_map(|p| self.class.sources.get(p).cloned())
            .collect()
    }
}

impl ClientContext for GroupContext {
    fn error(&self, error: KafkaError, reason: &str) {
        tracing::warn!(group = %self.class.group, %error, reason, "the replicas' group's consumer reported an error");
        self.board.class(&self.class.group, |c| {
            c.error = Some(format!("{error}: {reason}"))
        });
    }
}

impl ConsumerContext for GroupContext {
    /// A revoke is answered only once the sources are drained.
    fn pre_rebalance(&self, consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        let Rebalance::Revoke(tpl) = rebalance else { return };
        let sources = self.names(tpl);
        let lost = consumer.assignment_lost();
        {
            let mut s = self.board.lock();
            for name in &sources {
                s.assigned.remove(name);
            }
            if !sources.is_empty() {
                s.rebalances += 1;
            }
            if lost {
                if let Some(c) = s.classes.iter_mut().find(|c| c.group == self.class.group) {
                    c.member = false;
                }
            }
        }
        if sources.is_empty() || self.closing.load(Ordering::SeqCst) {
            return;
        }
        let (done, drained) = std::sync::mpsc::sync_channel(1);
        if lost {
            // The group may have moved them already; the supervisor keeps
            // them streaming under their leases and drains nothing now, so
            // the rejoin does not wait.
            tracing::info!(group = %self.class.group, ?sources, "this replica's session in the group expired; rejoining");
            let _ = self.events.send(Event::Revoked { sources, lost, done });
            return;
        }
        tracing::info!(group = %self.class.group, ?sources, "revoked: draining these sources before the group moves them");
        if self.events.send(Event::Revoked { sources, lost, done }).is_err() {
            return; // the supervisor is gone: nothing runs
        }
        let started = Instant::now();
        // The supervisor may be draining something else first (a pause, a
        // reload, another weight's revoke): the drain's bound counts from
        // when it picks the event up.
        use std::sync::mpsc::RecvTimeoutError::{Disconnected, Timeout};
        let answered = match drained.recv_timeout(self.drain_bound + PICK_UP_MARGIN) {
            Ok(()) => drained.recv_timeout(self.drain_bound),
            other => other,
        };
        match answered {
            Ok(()) | Err(Disconnected) => {
                tracing::info!(group = %self.class.group, took = ?started.elapsed(), "revoke answered");
            }
            Err(Timeout) => {
                tracing::warn!(group = %self.class.group, "a revoked source did not drain in time; the group moves it anyway (its lease keeps the next owner standing by until it ends)");
            }
        }
    }

    fn post_rebalance(&self, _consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        match rebalance {
            Rebalance::Assign(tpl) => {
                let sources = self.names(tpl);
                let group = self.class.group.clone();
                {
                    let mut s = self.board.lock();
                    s.assigned.extend(sources.iter().cloned());
                    if !sources.is_empty() {
                        s.rebalances += 1;
                    }
                    if let Some(c) = s.classes.iter_mut().find(|c| c.group == self.class.group) {
                        c.member = true;
                        c.error = None;
                    }
                }
                if !sources.is_empty() {
                    tracing::info!(group = %self.class.group, ?sources, "assigned: leading these sources");
                }
                let _ = self.events.send(Event::Assigned { group, sources });
            }
            Rebalance::Revoke(_) => {}
            Rebalance::Error(e) => {
                tracing::warn!(group = %self.class.group, error = %e, "the replicas' group failed a rebalance; it retries");
                self.board
                    .class(&self.class.group, |c| c.error = Some(e.to_string()));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(name: &str, w: u32) -> (String, u32) {
        (name.to_owned(), w)
    }

    #[test]
    fn classes_sort_by_weight_and_name_and_name_their_topic_by_their_members() {
        let c = classes("g", &[s("b", 1), s("heavy", 3), s("a", 1)]);
        assert_eq!(c.len(), 2);
        assert_eq!(c[0].group, "g");
        assert_eq!(c[0].sources, ["a", "b"]);
        assert_eq!(c[1].group, "g.w3");
        assert_eq!(c[1].sources, ["heavy"]);
        assert!(c[0].topic.starts_with("g.sources.w1."), "{}", c[0].topic);
        // The file's order does not matter; the members do.
        let again = classes("g", &[s("a", 1), s("heavy", 3), s("b", 1)]);
        assert_eq!(c, again);
        let other = classes("g", &[s("a", 1), s("c", 1)]);
        assert_ne!(c[0].topic, other[0].topic);
    }

    #[test]
    fn the_digest_is_the_same_on_every_replica_and_release() {
        // FNV-1a of known input: a changed function would split replicas
        // of two releases into two topics.
        assert_eq!(fnv1a(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a(b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(
            classes("g", &[s("a", 1)])[0].topic,
            "g.sources.w1.af63dc4c8601ec8c"
        );
    }

    #[test]
    fn metrics_name_each_weight() {
        let b = Board::default();
        b.lock().classes.push(ClassStatus {
            weight: 2,
            member: true,
            ..ClassStatus::default()
        });
        b.lock().assigned.insert("x".into());
        let text = b.metrics_text();
        assert!(
            text.contains("outboxd_coordination_member{weight=\"2\"} 1"),
            "{text}"
        );
        assert!(text.contains("outboxd_coordination_assigned_sources 1"), "{text}");
    }
}
