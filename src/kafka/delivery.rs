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

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::channel::oneshot;
use rdkafka::client::ClientContext;
use rdkafka::config::ClientConfig;
use rdkafka::error::{KafkaError, KafkaResult};
use rdkafka::message::{Message, OwnedMessage};

use rdkafka::producer::{
    BaseProducer, BaseRecord, DeliveryResult, Producer as _, ProducerContext, PurgeConfig,
};

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

/// A record's number in its sink: even for reports taken in batches, odd
/// for reports awaited one by one.
pub type Ticket = usize;

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

/// A new ticket. One counter for the whole process: a ticket never
/// repeats, not even across sinks, so no report can retire another record.
pub(crate) fn ticket(awaited: bool) -> Ticket {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    (NEXT.fetch_add(1, Ordering::Relaxed) << 1) | usize::from(awaited)
}

/// A lock that a panic elsewhere does not poison for good: what it guards
/// stays consistent between statements.
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// A record librdkafka would not enqueue, handed back with the reason.
pub type Refused<'a> = (KafkaError, BaseRecord<'a, [u8], [u8], usize>);

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

/// librdkafka's callbacks: delivery reports go to the [`ReportQueue`];
/// logs and errors as rdkafka's default context handles them.
#[derive(Debug)]
pub struct Reports {
    queue: ReportQueue,
}

impl ClientContext for Reports {}

impl ProducerContext for Reports {
    type DeliveryOpaque = usize;

    fn delivery(&self, result: &DeliveryResult<'_>, ticket: usize) {
        self.queue.deliver(ticket, Report::of(result));
    }
}

/// How long the poller waits in one call while records are in flight: its
/// spin at the end of each window costs at most a thousandth of this.
const BUSY_WINDOW: Duration = Duration::from_secs(1);

/// How often an idle poller serves an event that is not a delivery report
/// (a log line, a client error).
pub const IDLE_TICK: Duration = Duration::from_millis(100);

/// How long the poller keeps waiting in `poll` after the last record in
/// flight, before it parks.
const QUIET: Duration = Duration::from_secs(5);

/// A producer with its own poller thread and report queue.
pub struct Producer {
    inner: Arc<BaseProducer<Reports>>,
    queue: ReportQueue,
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
    /// Creates the producer and starts its poller. Producers that share
    /// `queue` (a transactional sink's two) share its tickets and reports.
    pub fn create(config: &ClientConfig, queue: &ReportQueue) -> KafkaResult<Producer> {
        let queue = queue.clone();
        let inner: Arc<BaseProducer<Reports>> =
            Arc::new(config.create_with_context(Reports { queue: queue.clone() })?);
        let stop = Arc::new(AtomicBool::new(false));
        let parked = Arc::new(AtomicBool::new(false));
        let poller = {
            let (producer, stop, parked) = (inner.clone(), stop.clone(), parked.clone());
            std::thread::Builder::new()
                .name("outboxd-producer".into())
                .spawn(move || serve(&producer, &stop, &parked))
                .map_err(|e| {
                    KafkaError::ClientCreation(format!("cannot start the producer's poller thread: {e}"))
                })?
                .thread()
                .clone()
        };
        Ok(Producer {
            inner,
            queue,
            stop,
            parked,
            poller,
        })
    }

    /// The queue that batched sends report to.
    pub fn reports(&self) -> &ReportQueue {
        &self.queue
    }

    /// librdkafka's handle, for calls that block (run them off the async
    /// threads).
    pub fn handle(&self) -> Arc<BaseProducer<Reports>> {
        self.inner.clone()
    }

    /// Enqueues a record whose report goes to [`Producer::reports`].
    #[allow(clippy::result_large_err)]
    pub fn send_batched<'a>(&self, record: BaseRecord<'a, [u8], [u8], usize>) -> Result<Ticket, Refused<'a>> {
        let ticket = ticket(false);
        self.inner.send(record.delivery_opaque(ticket))?;
        self.wake_poller();
        Ok(ticket)
    }

    /// Enqueues a record whose report is awaited on its own.
    #[allow(clippy::result_large_err)]
    pub fn send_awaited<'a>(
        &self,
        record: BaseRecord<'a, [u8], [u8], usize>,
    ) -> Result<Awaited, Refused<'a>> {
        let ticket = ticket(true);
        let (tx, rx) = oneshot::channel();
        lock(&self.queue.shared.waiters).insert(ticket, tx);
        if let Err(e) = self.inner.send(record.delivery_opaque(ticket)) {
            lock(&self.queue.shared.waiters).remove(&ticket);
            return Err(e);
        }
        self.wake_poller();
        Ok(Awaited(rx))
    }

    /// Wakes the poller if it sleeps (see [`serve`]): the record just
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
        // Awaited sends whose report never comes end as canceled.
        lock(&self.queue.shared.waiters).clear();
    }
}

/// The poller's loop (see the module doc). It stays in `poll` (where a
/// report wakes it, with no help from the sender) until nothing was in
/// flight for [`QUIET`], so that a steady trickle of records does not
/// park and wake it at every one.
fn serve(producer: &BaseProducer<Reports>, stop: &AtomicBool, parked: &AtomicBool) {
    let mut last_busy = std::time::Instant::now();
    while !stop.load(Ordering::SeqCst) {
        if producer.in_flight_count() > 0 {
            last_busy = std::time::Instant::now();
            producer.poll(BUSY_WINDOW);
            continue;
        }
        if last_busy.elapsed() < QUIET {
            producer.poll(BUSY_WINDOW);
            continue;
        }
        producer.poll(Duration::ZERO);
        parked.store(true, Ordering::SeqCst);
        if producer.in_flight_count() == 0 && !stop.load(Ordering::SeqCst) {
            std::thread::park_timeout(IDLE_TICK);
        }
        parked.store(false, Ordering::SeqCst);
    }
}
