//! The relay's side of `routing.on_poison = "park"` (see [`crate::park`]
//! for the tables, the set and the redrive).
//!
//! Two ways into the table, both before the relay reads the next change:
//!
//! * A poison event (a row error, a schema mismatch, a record Kafka
//!   refused on its own) is queued as a [`ParkJob`] by the session and
//!   counted in the `AckTracker` as sent; [`Relay::flush_parked`] writes it
//!   (opening its sequence, or behind the head already there) and only
//!   then counts it acknowledged. The queue is flushed after every change
//!   handled and before any later event is published, so a later event of
//!   the sequence always finds the sequence parked.
//! * A good event of a parked sequence ([`Relay::park_behind`]) is written
//!   instead of being sent, and never enters the tracker.
//!
//! Every write runs under the replication keepalive; a failed one ends
//! the session (a transient failure) or stops outboxd (a missing table or
//! privilege, a limit reached): the slot holds the event, never dropped.
//!
//! # Handback
//!
//! A redrive that has published a sequence's head and everything the slot
//! has durably passed hands the rest back ([`crate::cli::parked`]): the
//! events the relay parked since, which it has read already. The relay
//! sees the flag when it reads the sequences (every [`REFRESH`]) and, at
//! the next boundary between PostgreSQL transactions:
//!
//! 1. stops reading the stream until nothing it sent is in flight and,
//!    exactly-once, the open Kafka transaction has committed: every parked
//!    event's transaction is then retired (`tracker.flushed()` past it), so
//!    this session never reads it again. A restart may (the slot's own
//!    position lags the relay's): exactly-once, a replay skips it, as a
//!    progress record covers it (a parked event opens the Kafka
//!    transaction, [`crate::relay::exactly_once::Group::parked`]);
//!    at-least-once, a replay after a crash may publish some of it again,
//!    duplicates that come after the first copies;
//! 2. takes the sequence's lock (a redrive holding it is left alone),
//!    publishes the sequence's rows in order with
//!    [`crate::relay::parked_publisher::Publisher`] (one acknowledged record at a
//!    time, or Kafka transactions of its own `.handback` producer, with a
//!    marker) and deletes each once it is in Kafka;
//! 3. releases the sequence, so its later events are published as they
//!    come, behind the rows just acknowledged.
//!
//! Rows the stream has not passed yet in this session (parked by an
//! earlier session past the slot's confirmed position, or past the
//! progress record) wait for the stream to pass them. A row that fails
//! clears the flag and becomes the head: the sequence waits for the
//! operator again. A crash in between leaves the flag and the rows not yet
//! deleted, and the next session (or a redrive) finishes.

use std::time::Duration;

use tokio::time::Instant;

use super::session::Session;
use super::{Relay, RelayError};
use crate::config::columns::Role;
use crate::kafka::records::TopicValues;
use crate::lsn::RowPos;
use crate::ops::health::{Parked, ParkedSequence, PARKED_SHOWN};
use crate::park::{ParkStore, ParkedEvent, ParkedRow, ParkedSet};
use crate::relay::parked_publisher::{Failed, PublishError, Publisher, Publishing, BATCH};
use crate::relay::progress::TxnId;
use crate::source::outbox::{OutboxRow, UnreadableRow};
use crate::source::stream::OutboxStream;

/// How often a session re-reads the parked sequences (released ones leave
/// the set; the metrics follow redrives).
const REFRESH: Duration = Duration::from_secs(5);

/// The parked-event store and the set, kept across sessions.
pub(super) struct Parking {
    store: Option<ParkStore>,
    pub(super) set: ParkedSet,
    refreshed: Option<Instant>,
}

impl Parking {
    pub(super) fn new(limits: crate::park::Limits) -> Self {
        Parking {
            store: None,
            set: ParkedSet::new(limits),
            refreshed: None,
        }
    }
}

/// A poison event waiting to be parked.
#[derive(Debug)]
pub(super) struct ParkJob {
    pub(super) txn: TxnId,
    pub(super) pos: RowPos,
    pub(super) row: ParkedRow,
    pub(super) reason: &'static str,
    pub(super) error: String,
}

impl Session {
    /// Queues a poison event to park; it counts as in flight until
    /// written. `counted`: it is in the tracker already (it was sent).
    pub(super) fn queue_park(&mut self, job: ParkJob, counted: bool) {
        if !counted {
            self.tracker.sent(job.txn);
        }
        self.to_park.push_back(job);
    }
}

impl Relay {
    /// At a session's start: connects the store (again, if its connection
    /// was lost), fences it with the session's walsender, and loads the
    /// parked sequences. A relay that does not park first looks for
    /// sequences left from `park` (see [`Relay::left_parked`]).
    pub(super) async fn start_parking(&mut self, walsender_pid: i32) -> Result<(), RelayError> {
        if self.parking.is_none() && self.left_parked().await? {
            self.parking = Some(Parking::new(self.config.routing.park));
        }
        let Some(parking) = self.parking.as_mut() else {
            return Ok(());
        };
        if parking.store.as_ref().is_none_or(ParkStore::is_closed) {
            let store = ParkStore::connect(
                &self.validated.pg,
                &self.validated.table,
                self.validated.slot.as_str(),
            )
            .await?;
            store.name_relay().await?;
            parking.store = Some(store);
        }
        let firsts = match parking.store.as_mut() {
            Some(store) => {
                // The walsender as PostgreSQL sees it (a pooler in between
                // may hand out a pid of its own).
                match store.active_pid().await? {
                    Some(pid) => store.fence(pid),
                    None => tracing::warn!(
                        walsender_pid,
                        "the slot shows no walsender: parking is not fenced this session"
                    ),
                }
                store.first_events().await?
            }
            None => Vec::new(),
        };
        // Sequences are named by routing.topic: one parked under another
        // name would be overtaken by its own later events.
        for first in firsts {
            match self.sequence_of_parked(&first.row) {
                Some((now, _)) if now == first.topic => {}
                now => {
                    return Err(crate::park::ParkError::Renamed {
                        topic: first.topic,
                        key: first.key,
                        now: now
                            .map_or_else(|| "(none: its aggregate cannot be read)".to_owned(), |(t, _)| t),
                    }
                    .into())
                }
            }
        }
        let Some(parking) = self.parking.as_mut() else {
            return Ok(());
        };
        if let Some(store) = &parking.store {
            let heads = store.heads().await?;
            parking.set.load(&heads);
            parking.refreshed = Some(Instant::now());
            if !heads.is_empty() {
                tracing::warn!(
                    sequences = heads.len(),
                    "parked sequences wait for `outboxd parked redrive`; their later events are parked too"
                );
            }
            publish_parked(&self.metrics, &self.health, &parking.set, &heads);
            // A relay that no longer parks keeps the tables only while
            // sequences left from `park` wait (it may have lost the grants
            // since).
            if heads.is_empty() && self.config.routing.on_poison != crate::config::OnPoison::Park {
                self.parking = None;
            }
        }
        Ok(())
    }

    /// Without `park`, at a session's start: whether sequences parked under
    /// it earlier (`routing.on_poison` changed since) wait in the tables.
    /// Their aggregates' later events must not overtake them, so such a
    /// relay keeps parking behind them (and takes their handbacks) until
    /// they are redriven, skipped or discarded, while new bad rows follow
    /// `on_poison`. Without the tables there is nothing to look for; tables
    /// that hold rows outboxd may not read are an error.
    async fn left_parked(&self) -> Result<bool, RelayError> {
        let client = crate::postgres::admin::connect(&self.validated.pg)
            .await
            .map_err(crate::park::ParkError::from)?;
        let waiting =
            ParkStore::waiting(&client, &self.validated.table, self.validated.slot.as_str()).await?;
        let Some(sequences) = waiting.filter(|n| *n > 0) else {
            return Ok(false);
        };
        tracing::warn!(
            sequences,
            on_poison = self.config.routing.on_poison.name(),
            "sequences parked under routing.on_poison = \"park\" are left: their later events are parked behind them until `outboxd parked redrive`; new bad rows follow routing.on_poison"
        );
        Ok(true)
    }

    /// The sequence (topic, key) of an outbox row.
    fn sequence_of(&self, row: &OutboxRow) -> (String, String) {
        (
            self.validated.topic.render_unchecked(row),
            row.aggregate_id.clone(),
        )
    }

    /// The sequence of a parked row; an unreadable row's route, type and
    /// additional columns are read from its columns' text, by the column
    /// map's names. `None` when what the topic needs (or its key) cannot
    /// be read: parking it would not hold its aggregate's later events
    /// back.
    fn sequence_of_parked(&self, row: &ParkedRow) -> Option<(String, String)> {
        match row {
            ParkedRow::Row(r) => Some(self.sequence_of(r)),
            ParkedRow::Unreadable {
                aggregate_id,
                columns_json,
                ..
            } => {
                if aggregate_id.is_empty() {
                    return None;
                }
                let columns: serde_json::Value = serde_json::from_str(columns_json).unwrap_or_default();
                let text = |name: &str| columns.get(name).and_then(|v| v.as_str()).map(str::to_owned);
                let map = &self.validated.columns;
                let role = |r: Role| {
                    let rc = map.role(r);
                    rc.name.iter().chain(&rc.aliases).find_map(|c| text(c.as_str()))
                };
                let route = match role(Role::Route) {
                    Some(t) if !t.is_empty() => t,
                    _ if map.role(Role::Route).needed => return None,
                    _ => String::new(),
                };
                // The type matters only to a template that names it.
                let event_type = match role(Role::Type) {
                    Some(t) => t,
                    None if self.validated.topic.uses_event_type() => return None,
                    None => String::new(),
                };
                let values = ColumnsText {
                    route,
                    event_type,
                    extra: map.extra.iter().map(|c| text(c.as_str())).collect(),
                };
                Some((
                    self.validated.topic.render_unchecked(&values),
                    aggregate_id.clone(),
                ))
            }
        }
    }

    /// Checks the limits before `event` is parked. Totals may be stale (a
    /// redrive released sequences since the last read): past a limit they
    /// are read again. An event parked already (a replay) adds nothing and
    /// always goes.
    async fn ensure_room(
        &mut self,
        stream: &mut OutboxStream,
        s: &Session,
        event: &ParkedEvent,
        opens: bool,
    ) -> Result<(), RelayError> {
        let Some(parking) = self.parking.as_mut() else {
            return Ok(());
        };
        if parking.set.room(event.bytes(), opens).is_ok() {
            return Ok(());
        }
        let Some(store) = parking.store.as_ref() else {
            return Ok(());
        };
        let (received, flushed, every) = s.beat();
        if stream
            .keep_alive_while(received, flushed, every, store.contains(event.pos))
            .await??
        {
            return Ok(());
        }
        let heads = stream
            .keep_alive_while(received, flushed, every, store.heads())
            .await??;
        parking.set.load(&heads);
        // Opening, unless the reload found the sequence parked.
        let opens = opens && parking.set.head(&event.topic, &event.key).is_none();
        parking.set.room(event.bytes(), opens).map_err(Into::into)
    }

    /// Whether an unreadable row belongs to a parked sequence: a relay that
    /// no longer parks (draining what `park` left) parks it behind its head
    /// all the same, rather than stop on it or dead-letter it ahead of its
    /// parked predecessors (a replay re-reads a head parked earlier, too).
    pub(super) fn parks_unreadable(&self, row: &UnreadableRow, pos: RowPos) -> bool {
        let Some(parking) = self.parking.as_ref().filter(|p| !p.set.is_empty()) else {
            return false;
        };
        self.sequence_of_parked(&unreadable(row))
            .is_some_and(|(topic, key)| parking.set.parks(&topic, &key, pos))
    }

    /// A good event whose sequence is parked goes behind its head: written
    /// to the table, not sent. Returns whether it was parked (`false`: the
    /// sequence is not parked, or was released meanwhile).
    pub(super) async fn park_behind(
        &mut self,
        stream: &mut OutboxStream,
        s: &mut Session,
        row: &OutboxRow,
        pos: RowPos,
    ) -> Result<bool, RelayError> {
        if !s.to_park.is_empty() {
            self.flush_parked(stream, s).await?;
        }
        // The common case, per event: nothing parked, nothing to name.
        if self.parking.as_ref().is_none_or(|p| p.set.is_empty()) {
            return Ok(false);
        }
        let (topic, key) = self.sequence_of(row);
        if !self
            .parking
            .as_ref()
            .is_some_and(|p| p.set.parks(&topic, &key, pos))
        {
            return Ok(false);
        }
        let event = ParkedEvent {
            pos,
            topic,
            key,
            row: ParkedRow::Row(row.clone()),
            reason: "behind".into(),
            error: "an earlier event of its sequence is parked".into(),
            attempts: 0,
        };
        // A leader that lost its lease parks nothing, as it sends nothing.
        if !self.election.still_held() {
            return Err(RelayError::LeadershipLost);
        }
        self.ensure_room(stream, s, &event, false).await?;
        let Some(parking) = self.parking.as_mut() else {
            return Ok(false);
        };
        let Some(store) = parking.store.as_mut() else {
            return Ok(false);
        };
        let (received, flushed, every) = s.beat();
        match stream
            .keep_alive_while(received, flushed, every, store.append(&event))
            .await??
        {
            Some((head, inserted)) => {
                parking.set.opened(&event.topic, &event.key, head);
                if inserted {
                    parking.set.added(event.bytes());
                }
                if let Some(txn) = s.open {
                    s.durability.parked(txn);
                }
                self.metrics.parked_total.with_label_values(&["behind"]).inc();
                tracing::debug!(id = %row.id, topic = event.topic, key = event.key, "parked behind its sequence's head");
                Ok(true)
            }
            None => {
                tracing::info!(
                    topic = event.topic,
                    key = event.key,
                    "the sequence was released: publishing its events again"
                );
                parking.set.released(&event.topic, &event.key);
                Ok(false)
            }
        }
    }

    /// Writes the queued poison events, each opening its sequence or
    /// joining it, and counts each acknowledged once written.
    pub(super) async fn flush_parked(
        &mut self,
        stream: &mut OutboxStream,
        s: &mut Session,
    ) -> Result<(), RelayError> {
        while let Some(job) = s.to_park.front() {
            let Some((topic, key)) = self.sequence_of_parked(&job.row) else {
                let ParkedRow::Unreadable { id, .. } = &job.row else {
                    return Err(RelayError::OutOfOrder("an outbox row without a sequence"));
                };
                return Err(RelayError::Poison {
                    id: id.clone(),
                    lsn: job.pos.commit_lsn,
                    error: format!("{}; its aggregate type, type or aggregate id cannot be read either, so parking it would not hold its aggregate's later events back: fix the row, or set routing.on_poison = \"dead-letter\" for it", job.error),
                });
            };
            if !self.election.still_held() {
                return Err(RelayError::LeadershipLost);
            }
            let event = ParkedEvent {
                pos: job.pos,
                topic,
                key,
                row: job.row.clone(),
                reason: job.reason.to_owned(),
                error: job.error.clone(),
                attempts: 1,
            };
            let reason = job.reason;
            let known = self
                .parking
                .as_ref()
                .is_some_and(|p| p.set.head(&event.topic, &event.key).is_some());
            self.ensure_room(stream, s, &event, !known).await?;
            // The room check may have read the sequences again.
            let known = self
                .parking
                .as_ref()
                .is_some_and(|p| p.set.head(&event.topic, &event.key).is_some());
            let Some(parking) = self.parking.as_mut() else {
                return Err(RelayError::OutOfOrder(
                    "an event to park without routing.on_poison = \"park\"",
                ));
            };
            let Some(store) = parking.store.as_mut() else {
                return Err(RelayError::OutOfOrder(
                    "an event to park before the park store is connected",
                ));
            };
            let (received, flushed, every) = s.beat();
            // Behind a head already there, unless it was released: then
            // this event opens the sequence anew.
            let joined = if known {
                stream
                    .keep_alive_while(received, flushed, every, store.append(&event))
                    .await??
            } else {
                None
            };
            let (head, inserted) = match joined {
                Some(joined) => joined,
                None => {
                    let opened = stream
                        .keep_alive_while(received, flushed, every, store.open(&event))
                        .await??;
                    tracing::warn!(id = event.id(), topic = event.topic, key = event.key, reason = event.reason, error = event.error,
                        "parked: this event and every later one of its topic and key wait for `outboxd parked redrive`");
                    opened
                }
            };
            parking.set.opened(&event.topic, &event.key, head);
            if inserted {
                parking.set.added(event.bytes());
            }
            self.metrics.parked_total.with_label_values(&[reason]).inc();
            if let Some(job) = s.to_park.pop_front() {
                s.durability.parked(job.txn);
                s.tracker.acked(job.txn);
            }
            s.observe_retired(&self.metrics);
        }
        Ok(())
    }

    /// Each status tick: re-reads the parked sequences now and then, so
    /// that released ones leave the set and the metrics follow.
    pub(super) async fn refresh_parked(
        &mut self,
        stream: &mut OutboxStream,
        s: &Session,
    ) -> Result<(), RelayError> {
        let Some(parking) = self.parking.as_mut() else {
            return Ok(());
        };
        if parking.refreshed.is_some_and(|t| t.elapsed() < REFRESH) {
            return Ok(());
        }
        let Some(store) = parking.store.as_ref() else {
            return Ok(());
        };
        let (received, flushed, every) = s.beat();
        let heads = stream
            .keep_alive_while(received, flushed, every, store.heads())
            .await??;
        parking.set.load(&heads);
        parking.refreshed = Some(Instant::now());
        publish_parked(&self.metrics, &self.health, &parking.set, &heads);
        Ok(())
    }
}

impl From<PublishError> for RelayError {
    fn from(e: PublishError) -> Self {
        match e {
            PublishError::Park(e) => RelayError::Park(e),
            PublishError::Kafka(e) => RelayError::Kafka(e),
            PublishError::Progress(e) => RelayError::Progress(e),
            PublishError::Schema(e) => RelayError::Schema(e),
            PublishError::RegistrySetup(e) => RelayError::RegistrySetup(e),
        }
    }
}

impl Relay {
    /// Whether a redrive handed a sequence back (see the module's
    /// "Handback"): intake pauses at the next transaction boundary.
    pub(super) fn handback_due(&self) -> bool {
        self.parking
            .as_ref()
            .is_some_and(|p| !p.set.handed_back().is_empty())
    }

    /// Publishes the sequences handed back and releases them. Call between
    /// PostgreSQL transactions, with nothing in flight and (exactly-once)
    /// no Kafka transaction open.
    pub(super) async fn hand_back(
        &mut self,
        stream: &mut OutboxStream,
        s: &Session,
    ) -> Result<(), RelayError> {
        let due: Vec<(String, String)> = match self.parking.as_ref() {
            Some(p) => p.set.handed_back().to_vec(),
            None => return Ok(()),
        };
        if due.is_empty() {
            return Ok(());
        }
        let mut publisher = None;
        let mut outcome = Ok(());
        for (topic, key) in due {
            match self.hand_back_one(stream, s, &mut publisher, &topic, &key).await {
                Ok(()) => {}
                // The session's own failures end it.
                Err(e @ (RelayError::Pg(_) | RelayError::Stream(_) | RelayError::LeadershipLost)) => {
                    outcome = Err(e);
                    break;
                }
                // A handback that fails (Kafka, the registry, a grant
                // missing) never stops the stream: the sequence stays
                // parked, and is tried again at the next read.
                Err(e) => {
                    self.metrics.error(e.reason());
                    tracing::warn!(topic, key, error = %e, "could not publish a handed-back sequence; it stays parked and is tried again in a few seconds");
                    // A producer that failed is not used again.
                    publisher = None;
                }
            }
        }
        let Some(parking) = self.parking.as_mut() else {
            return outcome;
        };
        let Some(store) = parking.store.as_ref() else {
            parking.set.defer_handbacks();
            return outcome;
        };
        // The store's connection lives on: its sequence locks go now, also
        // after a failure.
        let (received, flushed, every) = s.beat();
        let unlocked = stream
            .keep_alive_while(received, flushed, every, store.unlock_sequences())
            .await;
        outcome?;
        unlocked??;
        // The metrics follow at once. What was not published now (the
        // replay has yet to pass it, or a redrive holds it) and a handback
        // made meanwhile are due at the next regular read.
        let heads = stream
            .keep_alive_while(received, flushed, every, store.heads())
            .await??;
        parking.set.load(&heads);
        parking.set.defer_handbacks();
        parking.refreshed = Some(Instant::now());
        publish_parked(&self.metrics, &self.health, &parking.set, &heads);
        Ok(())
    }

    /// Publishes one handed-back sequence and releases it, unless a replay
    /// could bring its rows back yet, or a redrive holds it.
    async fn hand_back_one(
        &mut self,
        stream: &mut OutboxStream,
        s: &Session,
        publisher: &mut Option<Publisher>,
        topic: &str,
        key: &str,
    ) -> Result<(), RelayError> {
        // Every transaction read so far is retired: this session never
        // reads them again. A restart may (the slot's own position lags),
        // so they must also lie where a replay leaves them alone:
        // exactly-once, under a progress record.
        let covered = s.tracker.flushed();
        let (received, flushed, every) = s.beat();
        let Some(store) = self.parking.as_ref().and_then(|p| p.store.as_ref()) else {
            return Ok(());
        };
        let last = stream
            .keep_alive_while(received, flushed, every, store.last_lsn(topic, key))
            .await??;
        if last.is_some_and(|l| l >= covered || !s.durability.in_kafka(l)) {
            tracing::debug!(
                topic,
                key,
                "a handed-back sequence waits for the stream to pass its rows"
            );
            return Ok(());
        }
        let locked = stream
            .keep_alive_while(received, flushed, every, async {
                if store.lock_sequence(topic, key).await? {
                    return Ok(true);
                }
                // A relay that held the slot before this one and froze
                // mid-handback keeps its lock while its connection lives.
                if store.break_stale_lock(topic, key).await? {
                    tracing::warn!(topic, key, "ended the parked-event connection of a relay that held this slot before (frozen mid-handback), which held the sequence");
                    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
                    return store.lock_sequence(topic, key).await;
                }
                Ok::<_, crate::park::ParkError>(false)
            })
            .await??;
        if !locked {
            tracing::debug!(
                topic,
                key,
                "a redrive is publishing a handed-back sequence; later"
            );
            return Ok(());
        }
        if publisher.is_none() {
            let p = stream
                .keep_alive_while(
                    received,
                    flushed,
                    every,
                    Publisher::new(&self.config, &self.validated, Publishing::Handback),
                )
                .await??;
            *publisher = Some(p);
        }
        let Some(p) = publisher.as_mut() else {
            return Ok(());
        };
        // Under the lock: a redrive that committed this sequence's rows and
        // stopped before deleting them left its marker.
        stream
            .keep_alive_while(received, flushed, every, p.finish_committed(store))
            .await??;
        let Some(store) = self.parking.as_mut().and_then(|p| p.store.as_mut()) else {
            return Ok(());
        };
        let mut published = 0;
        let failed = loop {
            let batch = stream
                .keep_alive_while(received, flushed, every, store.events(topic, key, None, BATCH))
                .await??;
            if batch.is_empty() {
                if stream
                    .keep_alive_while(received, flushed, every, store.release(topic, key))
                    .await??
                {
                    break None;
                }
                continue;
            }
            if !self.election.still_held() {
                return Err(RelayError::LeadershipLost);
            }
            let rows: Vec<&ParkedEvent> = batch.iter().collect();
            let (n, failed) = stream
                .keep_alive_while(received, flushed, every, p.publish(store, topic, key, &rows))
                .await??;
            published += n;
            self.metrics.parked_handed_back.inc_by(n);
            self.metrics.events_published.inc_by(n);
            // A long handback is the relay at work, not a hung one.
            self.health.beat();
            if failed.is_some() {
                break failed;
            }
        };
        match failed {
            None => {
                if let Some(parking) = self.parking.as_mut() {
                    parking.set.released(topic, key);
                }
                tracing::info!(topic, key, events = published, "handed back by a redrive: published the rest of the parked sequence in order and released it");
            }
            Some(Failed { id, reason, error }) => {
                tracing::warn!(topic, key, events = published, id, reason, error,
                    "handed back by a redrive, but an event of it cannot be published: it is the sequence's head now, and the sequence waits for `outboxd parked redrive` again");
            }
        }
        Ok(())
    }
}

/// The parked sequences to the metrics and `/status`.
fn publish_parked(
    metrics: &crate::metrics::Metrics,
    health: &crate::ops::health::Health,
    set: &ParkedSet,
    heads: &[crate::park::SequenceHead],
) {
    let gauge = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
    let (sequences, events, bytes, oldest) = set.totals();
    let age = oldest.map(|t| (chrono::Utc::now().timestamp() - t).max(0) as f64);
    metrics.parked_sequences.set(gauge(sequences));
    metrics.parked_events.set(gauge(events));
    metrics.parked_bytes.set(gauge(bytes));
    metrics.parked_oldest_age_seconds.set(age.unwrap_or(0.0));
    health.set_parked(Parked {
        sequences,
        events,
        bytes,
        oldest_age_seconds: age,
        oldest: heads
            .iter()
            .take(PARKED_SHOWN)
            .map(|h| ParkedSequence {
                topic: h.topic.clone(),
                key: h.key.clone(),
                head_id: h.head_id.clone(),
                head_reason: h.head_reason.clone(),
                events: h.events,
                parked_at: h.parked_at.to_rfc3339(),
            })
            .collect(),
    });
}

/// What a session parks of an unreadable row.
pub(super) fn unreadable(row: &UnreadableRow) -> ParkedRow {
    ParkedRow::Unreadable {
        id: row.id.clone(),
        aggregate_id: row.aggregate_id.clone(),
        columns_json: row.columns_json.clone(),
    }
}

/// An unreadable row's columns, as a topic template reads them.
struct ColumnsText {
    route: String,
    event_type: String,
    extra: Vec<Option<String>>,
}

impl TopicValues for ColumnsText {
    fn route(&self) -> &str {
        &self.route
    }
    fn event_type(&self) -> &str {
        &self.event_type
    }
    fn column(&self, extra: usize) -> Option<&str> {
        self.extra.get(extra).and_then(Option::as_deref)
    }
}
