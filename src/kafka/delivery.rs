//! Delivery reports, handed over in batches, and the thread that serves
//! librdkafka's event queue.
//!
//! librdkafka reports deliveries on its main queue, in events that each
//! carry the reports of one produce response. rdkafka's `FutureProducer`
//! turns every report into a oneshot channel whose waker then wakes the
//! relay's task: per record a channel, a boxed sender, a boxed future in
//! the relay's set, and a wake-up across threads. Here a record carries a
//! number (its ticket, librdkafka's delivery opaque: no allocation), and
//! the reports served in one poll go into one shared queue. The relay's
//! task is woken once for whatever arrived while it was busy and takes the
//! whole batch ([`ReportQueue::take`]).
//!
//! Callers that want one future per record (polling mode, replay, a test)
//! send with [`Producer::send_awaited`]: an odd ticket, whose report goes
//! to its own oneshot ([`Awaited`]).
//!
//! **The poller.** rdkafka's producers serve the queue from a thread that
//! calls `poll(100 ms)` in a loop. Each call waits in steps of whole
//! milliseconds until its deadline, so its last step waits 0 ms: for the
//! last millisecond of every 100 the thread spins, about 1% of a core even
//! when nothing is sent (measured: 180 ms of CPU in 20 idle seconds, four
//! fifths of an idle outboxd's). This poller waits in one-second windows
//! while records flow (0.1% at most), and once nothing was in flight for a
//! few seconds, it parks until a send wakes it, serving a pending log or
//! error event every [`IDLE_TICK`].
//!
//! **Dropping** a [`Producer`] purges what it still queued or has in
//! flight, at once and on the dropping thread, so that nothing it held
//! lands after a replay by its successor. The poller then ends within its
//! window; librdkafka's handle is freed with the last reference to it (the
//! poller's, or that of a blocking call still running, such as a commit).
//!
//! # Lanes: one producer, several senders
//!
//! Every sender (a relay's session, a polling round, a command) sends on a
//! [`Lane`] of its own: its reports go to the lane's [`ReportQueue`] (the
//! lane's number is in the upper bits of each ticket), so several sessions
//! of several sources can share one producer, each hearing only its own
//! reports. A lane that is dropped stops hearing; reports for it are dropped.
//!
//! **A failure purges the shared producer's queue.** A relay that hears of
//! a failed delivery replays from its slot, and a record of its own that
//! librdkafka still queued behind the failed one must not land ahead of
//! that replay (the failed record would then reach its partition after a
//! later one). A producer of its own is simply dropped, which purges it. A
//! shared one cannot be purged for one lane alone, so a producer created
//! with [`Sharing::PurgeOnFailure`] purges its whole queue the moment a
//! delivery fails ([`Report::is_failure`]): the delivery callback wakes a
//! thread of the producer's own (the purger), which purges at once, while
//! librdkafka is still busy with the failure (an epoch bump, a round trip
//! at least). Not the poller itself: rdkafka's `poll` keeps serving until
//! its window ends, up to a second later, and the failed lane's queued
//! records would go out meanwhile. Records already in a request go on and
//! report as they will; every queued record of every lane reports
//! `PurgeQueue`.
//!
//! The other lanes lose nothing by it: such a record was never sent, and its
//! report gives it back whole. What they must not do is send anything new
//! before they have sent those again, or a later record could pass an earlier
//! one in its partition. So each purge moves the producer to its next
//! **generation**, under a lock every send takes (shared) and the purge
//! takes alone: a send on a lane of an older generation is refused
//! ([`Stale`]), and the lane's owner first hears every report of what it
//! sent, re-sends what came back purged in its order, and only then takes
//! the new generation ([`Lane::adopt`]). A send never waits for the lock:
//! during a purge it is refused as stale too (a purge waits for every
//! broker thread, which may be stuck resolving a host name), and the lane
//! waits for the purge asynchronously ([`Producer::quiet_generation`]). Within a partition, what librdkafka
//! transmitted before the purge precedes what it still queued, so a lane's
//! stored records are a prefix of each partition's, and the re-sent rest
//! follows them (`crate::relay` does this for its sessions; a polling round
//! ends and the next one sends its rows again).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use futures::channel::oneshot;
use rdkafka::client::ClientContext;
use rdkafka::config::ClientConfig;
use rdkafka::error::{KafkaError, KafkaResult, RDKafkaErrorCode};
use rdkafka::message::{Message, OwnedMessage};

use rdkafka::producer::{BaseProducer, DeliveryResult, Producer as _, ProducerContext, PurgeConfig};

use crate::kafka::native::{Outgoing, Topics};
use crate::kafka::FastMap;

/// A delivery report, read so that an acknowledgement without an offset
/// is never taken for a stored record.
///
/// librdkafka's idempotent producer acknowledges messages *implicitly*
/// (`rd_kafka_dr_implicit_ack`) when a later Produce request of their
/// partition succeeds while theirs waits for a retry: the broker accepted
/// a later sequence, so librdkafka infers that the earlier ones were
/// stored. Apache Kafka accepts a later sequence when it holds no producer
/// state for the partition (a new partition, expired producer state), and
/// then the earlier records were never written. Such reports carry no
/// offset. A record that Kafka stored always has one (`acks=all`), so a
/// report without an offset is not proof of durability: every producer
/// path of outboxd treats it as a failed delivery, which replays (a
/// duplicate at worst, never a loss).
#[derive(Debug)]
pub enum Report {
    /// Stored at this partition and offset.
    Stored { partition: i32, offset: i64 },
    /// Refused or failed; librdkafka hands the message back.
    Failed(KafkaError, OwnedMessage),
    /// Reported delivered without an offset: not proven stored.
    Unproven { partition: i32 },
    /// The producer went away before it reported.
    Canceled,
}

impl Report {
    /// A delivery that failed on its own: refused, timed out, or reported
    /// without proof that it was stored. A record purged from the queue
    /// (never sent) is not such a failure, and neither is a producer that
    /// went away.
    pub fn is_failure(&self) -> bool {
        match self {
            Report::Stored { .. } | Report::Canceled => false,
            Report::Unproven { .. } => true,
            Report::Failed(e, _) => !is_purge(e),
        }
    }

    /// A record that a purge of the queue took back before it was sent.
    pub fn was_purged_unsent(&self) -> bool {
        matches!(self, Report::Failed(e, _) if e.rdkafka_error_code() == Some(RDKafkaErrorCode::PurgeQueue))
    }

    fn of(result: &DeliveryResult<'_>) -> Report {
        match result {
            Ok(m) if m.offset() >= 0 => Report::Stored {
                partition: m.partition(),
                offset: m.offset(),
            },
            Ok(m) => Report::Unproven {
                partition: m.partition(),
            },
            Err((e, m)) => Report::Failed(e.clone(), m.detach()),
        }
    }
}

/// Whether librdkafka failed a record because it was purged (queued or in
/// flight), not because Kafka refused it or it timed out.
fn is_purge(e: &KafkaError) -> bool {
    matches!(
        e.rdkafka_error_code(),
        Some(RDKafkaErrorCode::PurgeQueue | RDKafkaErrorCode::PurgeInflight)
    )
}

/// A record's number: its lane in the upper [`LANE_BITS`] bits, then a
/// sequence, and the lowest bit even for reports taken in batches, odd for
/// reports awaited one by one.
pub type Ticket = usize;

/// A lane's number, in the upper bits of its tickets.
type LaneId = u32;

/// Bits of a ticket that hold its lane; the other 40 hold the sequence
/// and the awaited bit (2^39 records before the sequence wraps, and a
/// lane number repeats only after 2^24 lanes).
const LANE_BITS: u32 = 24;
const SEQ_BITS: u32 = usize::BITS - LANE_BITS;
const _: () = assert!(usize::BITS == 64, "tickets need a 64-bit usize");

/// The lane a ticket belongs to.
fn lane_of(ticket: Ticket) -> LaneId {
    (ticket >> SEQ_BITS) as LaneId
}

/// Reports of batched sends, waiting for the relay to take them.
#[derive(Clone, Debug, Default)]
pub struct ReportQueue {
    shared: Arc<Shared>,
}

#[derive(Debug, Default)]
struct Shared {
    ready: Mutex<Vec<(Ticket, Report)>>,
    /// A permit whenever `ready` gained a report since the last take.
    arrived: tokio::sync::Notify,
    waiters: Mutex<HashMap<Ticket, oneshot::Sender<Report>>>,
}

impl ReportQueue {
    /// Waits until a report may have arrived since the last [`take`]
    /// (cancel-safe: a report that arrives meanwhile leaves a permit).
    ///
    /// [`take`]: ReportQueue::take
    pub async fn arrived(&self) {
        self.shared.arrived.notified().await;
    }

    /// Moves every report that arrived into `into`, in arrival order.
    pub fn take(&self, into: &mut std::collections::VecDeque<(Ticket, Report)>) {
        let mut ready = lock(&self.shared.ready);
        into.extend(ready.drain(..));
    }

    pub(crate) fn deliver(&self, ticket: Ticket, report: Report) {
        if ticket & 1 == 1 {
            let waiter = lock(&self.shared.waiters).remove(&ticket);
            if let Some(w) = waiter {
                // Its receiver may be gone: nobody waits any more.
                let _ = w.send(report);
            }
            return;
        }
        self.shared
            .ready
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .push((ticket, report));
        self.shared.arrived.notify_one();
    }
}

/// A new ticket of `lane`. One sequence for the whole process: a ticket
/// never repeats, not even across lanes, so no report can retire another
/// record.
pub(crate) fn lane_ticket(lane: LaneId, awaited: bool) -> Ticket {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    let seq = NEXT.fetch_add(1, Ordering::Relaxed) & ((1 << (SEQ_BITS - 1)) - 1);
    ((lane as usize) << SEQ_BITS) | (seq << 1) | usize::from(awaited)
}

/// A new ticket of lane 0 (tests of report handling).
#[cfg(test)]
pub(crate) fn ticket(awaited: bool) -> Ticket {
    lane_ticket(0, awaited)
}

/// A lock that a panic elsewhere does not poison for good: what it guards
/// stays consistent between statements.
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// One record's delivery, awaited on its own.
#[derive(Debug)]
pub struct Awaited(oneshot::Receiver<Report>);

impl std::future::Future for Awaited {
    type Output = Report;

    fn poll(mut self: std::pin::Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> std::task::Poll<Report> {
        std::pin::Pin::new(&mut self.0)
            .poll(cx)
            .map(|r| r.unwrap_or(Report::Canceled))
    }
}

/// Whether a producer is shared by lanes that replay on their own.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sharing {
    /// One owner, which drops the producer after a failure (the drop
    /// purges it). Transactional producers are always owned: a Kafka
    /// transaction hears its refusals out before anything is purged.
    Owned,
    /// Shared: a failed delivery purges the queue at once (see the module
    /// doc), and every lane re-sends what came back purged.
    PurgeOnFailure,
}

/// librdkafka's callbacks: each delivery report goes to its lane's
/// [`ReportQueue`]; logs and errors as rdkafka's default context handles
/// them.
#[derive(Debug)]
pub struct Reports {
    lanes: RwLock<FastMap<LaneId, ReportQueue>>,
    sharing: Sharing,
    /// A delivery failed since the purger last looked: purge the queue.
    purge_wanted: AtomicBool,
    /// The purger thread, woken by a failed delivery.
    purger: std::sync::OnceLock<std::thread::Thread>,
}

impl Reports {
    fn route(&self, ticket: Ticket, report: Report) {
        let lanes = self
            .lanes
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        // A lane that is gone hears nothing more (its awaited senders, if
        // any, were told Canceled when it went).
        if let Some(queue) = lanes.get(&lane_of(ticket)) {
            queue.deliver(ticket, report);
        }
    }
}

impl ClientContext for Reports {}

impl ProducerContext for Reports {
    type DeliveryOpaque = usize;

    fn delivery(&self, result: &DeliveryResult<'_>, ticket: usize) {
        let report = Report::of(result);
        if self.sharing == Sharing::PurgeOnFailure && report.is_failure() {
            self.purge_wanted.store(true, Ordering::SeqCst);
            if let Some(purger) = self.purger.get() {
                purger.unpark();
            }
        }
        self.route(ticket, report);
    }
}

/// A send on a lane of an older generation: the producer purged its queue
/// since the lane last took a generation. Hear every report of what the
/// lane sent, re-send what came back purged, then [`Lane::adopt`] the
/// generation read before that and send again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stale;

/// How long the poller waits in one call while records are in flight: its
/// spin at the end of each window costs at most a thousandth of this.
const BUSY_WINDOW: Duration = Duration::from_secs(1);

/// How often an idle poller serves an event that is not a delivery report
/// (a log line, a client error).
pub const IDLE_TICK: Duration = Duration::from_millis(100);

/// How long the poller keeps waiting in `poll` after the last record in
/// flight, before it parks.
const QUIET: Duration = Duration::from_secs(5);

/// A producer with its own poller thread; senders use it through
/// [`Lane`]s.
pub struct Producer {
    inner: Arc<BaseProducer<Reports>>,
    /// librdkafka's handles of the topics sent to (see
    /// [`crate::kafka::native`]).
    topics: Topics<Reports>,
    /// The generation, and the lock that orders sends and purges.
    gate: Arc<Gate>,
    next_lane: AtomicU32,
    stop: Arc<AtomicBool>,
    /// The poller is parked (or about to park): a send must wake it.
    parked: Arc<AtomicBool>,
    poller: std::thread::Thread,
}

impl std::fmt::Debug for Producer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Producer").finish_non_exhaustive()
    }
}

impl Producer {
    /// Creates the producer and starts its poller.
    pub fn create(config: &ClientConfig, sharing: Sharing) -> KafkaResult<Arc<Producer>> {
        let context = Reports {
            lanes: RwLock::default(),
            sharing,
            purge_wanted: AtomicBool::new(false),
            purger: std::sync::OnceLock::new(),
        };
        let inner: Arc<BaseProducer<Reports>> = Arc::new(config.create_with_context(context)?);
        let stop = Arc::new(AtomicBool::new(false));
        let parked = Arc::new(AtomicBool::new(false));
        let gate = Arc::new(Gate::default());
        let spawn = |name: &str, work: Box<dyn FnOnce() + Send>| {
            std::thread::Builder::new()
                .name(name.into())
                .spawn(work)
                .map(|h| h.thread().clone())
                .map_err(|e| {
                    KafkaError::ClientCreation(format!("cannot start the producer's {name} thread: {e}"))
                })
        };
        let poller = {
            let poller = Poller {
                producer: inner.clone(),
                stop: stop.clone(),
                parked: parked.clone(),
            };
            spawn("outboxd-producer", Box::new(move || poller.serve()))?
        };
        if sharing == Sharing::PurgeOnFailure {
            let (producer, gate, stop) = (inner.clone(), gate.clone(), stop.clone());
            let purger = spawn(
                "outboxd-purger",
                Box::new(move || purge_after_failures(&producer, &gate, &stop)),
            )?;
            let _ = inner.context().purger.set(purger);
        }
        Ok(Arc::new(Producer {
            topics: Topics::new(inner.clone()),
            inner,
            gate,
            next_lane: AtomicU32::new(0),
            stop,
            parked,
            poller,
        }))
    }

    /// A new lane on this producer, whose reports go to `queue`. Lanes
    /// that share a queue (a transactional sink's two producers) hear in
    /// one place.
    pub fn lane(self: &Arc<Self>, queue: ReportQueue) -> Lane {
        let id = self.next_lane.fetch_add(1, Ordering::Relaxed) & ((1 << LANE_BITS) - 1);
        self.inner
            .context()
            .lanes
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .insert(id, queue.clone());
        Lane {
            generation: self.generation(),
            producer: self.clone(),
            id,
            queue,
        }
    }

    /// Purges so far: the current generation.
    pub fn generation(&self) -> u64 {
        self.gate.generation.load(Ordering::SeqCst)
    }

    /// The generation once no purge is under way (a send during one is
    /// refused as stale), waiting for it without blocking a thread.
    pub async fn quiet_generation(&self) -> u64 {
        while self.gate.purging.load(Ordering::SeqCst) {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        self.generation()
    }

    /// Whether failed deliveries purge this producer's queue.
    pub fn sharing(&self) -> Sharing {
        self.inner.context().sharing
    }

    /// librdkafka's handle, for calls that block (run them off the async
    /// threads).
    pub fn handle(&self) -> Arc<BaseProducer<Reports>> {
        self.inner.clone()
    }

    /// Enqueues a record under `ticket`, unless the producer purged since
    /// generation `seen`; `Ok(Err(_))`: librdkafka would not enqueue it.
    fn enqueue<H: AsRef<str>>(
        &self,
        seen: u64,
        ticket: Ticket,
        record: &Outgoing<'_, H>,
    ) -> Result<KafkaResult<()>, Stale> {
        // Never blocks: a purge holds the lock, and the send is stale.
        let Ok(gate) = self.gate.lock.try_read() else {
            return Err(Stale);
        };
        if self.gate.generation.load(Ordering::SeqCst) != seen {
            return Err(Stale);
        }
        let sent = self.topics.produce(record, ticket);
        drop(gate);
        if sent.is_ok() {
            self.wake_poller();
        }
        Ok(sent)
    }

    /// Wakes the poller if it sleeps (see `Poller::serve`): the record just
    /// enqueued is seen by the poller's check before it parks, or this
    /// sees the poller parked.
    fn wake_poller(&self) {
        std::sync::atomic::fence(Ordering::SeqCst);
        if self.parked.load(Ordering::SeqCst) {
            self.poller.unpark();
        }
    }

    pub fn client(&self) -> &rdkafka::client::Client<Reports> {
        self.inner.client()
    }

    /// Records and events librdkafka still holds (`rd_kafka_outq_len`).
    pub fn in_flight_count(&self) -> i32 {
        self.inner.in_flight_count()
    }

    pub fn begin_transaction(&self) -> KafkaResult<()> {
        self.inner.begin_transaction()
    }
}

impl Drop for Producer {
    fn drop(&mut self) {
        self.inner.purge(PurgeConfig::default().queue().inflight());
        self.stop.store(true, Ordering::SeqCst);
        self.poller.unpark();
        if let Some(purger) = self.inner.context().purger.get() {
            purger.unpark();
        }
        // Awaited sends whose report never comes end as canceled.
        let lanes = self
            .inner
            .context()
            .lanes
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        for queue in lanes.values() {
            lock(&queue.shared.waiters).clear();
        }
    }
}

/// One sender's way into a [`Producer`]: its tickets, its reports, and the
/// generation it has caught up with (see the module doc).
pub struct Lane {
    producer: Arc<Producer>,
    id: LaneId,
    queue: ReportQueue,
    generation: u64,
}

impl std::fmt::Debug for Lane {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lane")
            .field("id", &self.id)
            .field("generation", &self.generation)
            .finish_non_exhaustive()
    }
}

impl Lane {
    pub fn producer(&self) -> &Arc<Producer> {
        &self.producer
    }

    /// librdkafka's handle (see [`Producer::handle`]).
    pub fn handle(&self) -> Arc<BaseProducer<Reports>> {
        self.producer.handle()
    }

    pub fn client(&self) -> &rdkafka::client::Client<Reports> {
        self.producer.client()
    }

    /// Records and events the producer still holds, of every lane.
    pub fn in_flight_count(&self) -> i32 {
        self.producer.in_flight_count()
    }

    pub fn begin_transaction(&self) -> KafkaResult<()> {
        self.producer.begin_transaction()
    }

    /// The queue that batched sends report to.
    pub fn reports(&self) -> &ReportQueue {
        &self.queue
    }

    /// Takes generation `seen` (read before hearing the reports of what
    /// the lane sent, see [`Stale`]).
    pub fn adopt(&mut self, seen: u64) {
        self.generation = seen;
    }

    /// Whether the producer purged since this lane's generation.
    pub fn is_stale(&self) -> bool {
        self.producer.generation() != self.generation
    }

    /// Enqueues a record whose report goes to [`Lane::reports`].
    pub fn send_batched<H: AsRef<str>>(
        &self,
        record: &Outgoing<'_, H>,
    ) -> Result<KafkaResult<Ticket>, Stale> {
        let ticket = lane_ticket(self.id, false);
        Ok(self
            .producer
            .enqueue(self.generation, ticket, record)?
            .map(|()| ticket))
    }

    /// Enqueues a record whose report is awaited on its own.
    pub fn send_awaited<H: AsRef<str>>(
        &self,
        record: &Outgoing<'_, H>,
    ) -> Result<KafkaResult<Awaited>, Stale> {
        let ticket = lane_ticket(self.id, true);
        let (tx, rx) = oneshot::channel();
        lock(&self.queue.shared.waiters).insert(ticket, tx);
        match self.producer.enqueue(self.generation, ticket, record) {
            Ok(Ok(())) => Ok(Ok(Awaited(rx))),
            other => {
                lock(&self.queue.shared.waiters).remove(&ticket);
                other.map(|sent| sent.map(|()| Awaited(rx)))
            }
        }
    }
}

impl Drop for Lane {
    fn drop(&mut self) {
        let context = self.producer.inner.context();
        let mut lanes = context
            .lanes
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        // Another lane may share the queue (a transactional pair): only
        // this lane's entry goes.
        lanes.remove(&self.id);
    }
}

/// The poller thread's state.
struct Poller {
    producer: Arc<BaseProducer<Reports>>,
    stop: Arc<AtomicBool>,
    parked: Arc<AtomicBool>,
}

impl Poller {
    /// The poller's loop (see the module doc). It stays in `poll` (where a
    /// report wakes it, with no help from the sender) until nothing was in
    /// flight for [`QUIET`], so that a steady trickle of records does not
    /// park and wake it at every one.
    fn serve(&self) {
        let producer = &self.producer;
        let mut last_busy = std::time::Instant::now();
        while !self.stop.load(Ordering::SeqCst) {
            if producer.in_flight_count() > 0 {
                last_busy = std::time::Instant::now();
                self.producer.poll(BUSY_WINDOW);
                continue;
            }
            if last_busy.elapsed() < QUIET {
                self.producer.poll(BUSY_WINDOW);
                continue;
            }
            self.producer.poll(Duration::ZERO);
            self.parked.store(true, Ordering::SeqCst);
            if producer.in_flight_count() == 0 && !self.stop.load(Ordering::SeqCst) {
                std::thread::park_timeout(IDLE_TICK);
            }
            self.parked.store(false, Ordering::SeqCst);
        }
    }
}

/// The generation and the lock that orders sends and purges.
#[derive(Debug, Default)]
struct Gate {
    lock: RwLock<()>,
    generation: AtomicU64,
    purging: AtomicBool,
}

/// The purger thread's loop: a failed delivery (see [`Reports`]) wakes it,
/// and it purges every record not yet sent and moves to the next
/// generation, with no send in between (see the module doc).
fn purge_after_failures(producer: &BaseProducer<Reports>, gate: &Gate, stop: &AtomicBool) {
    while !stop.load(Ordering::SeqCst) {
        if !producer.context().purge_wanted.swap(false, Ordering::SeqCst) {
            std::thread::park_timeout(IDLE_PURGER);
            continue;
        }
        gate.purging.store(true, Ordering::SeqCst);
        let held = gate
            .lock
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let queued = producer.in_flight_count();
        // The generation moves first: no send can come between (the lock
        // is held), and whoever hears a purged report then reads the new
        // generation.
        gate.generation.fetch_add(1, Ordering::SeqCst);
        producer.purge(PurgeConfig::default().queue());
        drop(held);
        gate.purging.store(false, Ordering::SeqCst);
        tracing::info!(
            held = queued,
            "a delivery failed: the shared producer's unsent records were purged; the source that failed replays from its slot, the others send theirs again in order"
        );
    }
}

/// How long the purger sleeps when nothing wakes it (it checks for its
/// stop then).
const IDLE_PURGER: Duration = Duration::from_secs(1);
