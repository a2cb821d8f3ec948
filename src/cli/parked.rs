//! `outboxd parked`: list, show, redrive, skip and discard parked
//! sequences (see [`crate::park`] for how events get there).
//!
//! # Redrive
//!
//! A sequence is re-published in position order, each record built anew
//! from the parked row under today's configuration (so a fixed cause, a
//! raised `max.message.bytes`, an allowed aggregate type, a new schema
//! version, now lets the head through), with a `redriven` header, by
//! [`crate::relay::parked_publisher`] (one record at a time at-least-once; Kafka
//! transactions with a marker exactly-once).
//!
//! Only rows whose transaction the slot has durably passed are redriven
//! (see [`ParkStore::durably_passed`]; a replay of the WAL could otherwise
//! bring a redriven event back): a redrive waits, up to `--wait`, for the
//! relay to confirm them and the slot's `restart_lsn` to follow. The
//! header goes last (see [`ParkStore::release`]), so events the relay
//! parks meanwhile are redriven after the others, and events after the
//! release are the relay's to publish.
//!
//! # Handback
//!
//! An aggregate that is written all the time never pauses long enough for
//! the slot to durably pass its last parked event, so a redrive that waited
//! for that would never end. Once a redrive has published the head and
//! everything the slot has durably passed, it hands the rest back to the
//! relay ([`ParkStore::hand_back`]) and returns: the relay, which has
//! read every one of those events already, publishes them in order ahead
//! of the sequence's later events, and releases the sequence (see
//! `crate::relay`'s parking). A redrive of a handed-back sequence
//! publishes what the slot has durably passed too (the relay may be down,
//! or stopped at a parking limit); the sequence's lock
//! ([`ParkStore::lock_sequence`]) keeps the two from publishing at once.
//!
//! A head that fails again stays parked with the reason of today, its
//! attempts counted; the redrive of that sequence stops there.

use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::config::{Config, Validated};
use crate::kafka::records::{dead_letter_for_row, dead_letter_for_unreadable, Poison};
use crate::kafka::sink::{KafkaSink, KafkaSinkError, SendOutcome};
use crate::park::{ParkError, ParkStore, ParkedEvent, ParkedRow, SequenceHead};
pub use crate::relay::parked_publisher::REDRIVEN;
use crate::relay::parked_publisher::{Failed, PublishError, Publisher, Publishing};
use crate::source::outbox::{RowError, UnreadableRow};

/// Rows read, and (exactly-once) published per Kafka transaction.
const BATCH: i64 = crate::relay::parked_publisher::BATCH;

/// Which sequences a command acts on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Selection {
    /// The sequences of this key (an aggregate id), on any topic or one.
    Key {
        key: String,
        topic: Option<String>,
    },
    /// The sequences whose head was parked for this reason.
    Reason(String),
    All,
}

impl Selection {
    fn picks(&self, h: &SequenceHead) -> bool {
        match self {
            Selection::Key { key, topic } => h.key == *key && topic.as_ref().is_none_or(|t| h.topic == *t),
            Selection::Reason(r) => h.head_reason == *r,
            Selection::All => true,
        }
    }
}

/// Why a parked command failed.
#[derive(Debug, thiserror::Error)]
pub enum ParkedError {
    #[error(transparent)]
    Park(#[from] ParkError),
    #[error(transparent)]
    Kafka(#[from] KafkaSinkError),
    #[error(transparent)]
    Publish(#[from] PublishError),
    #[error("slot {0} does not exist: parked events are redriven once the slot has passed them; start outboxd (or create the slot) first")]
    NoSlot(String),
    #[error("no parked event has id {0} (see `outboxd parked list` and `show`)")]
    NoSuchEvent(String),
    #[error("event {id} is not the head of its sequence (the head is {head}): only a head can be skipped, or the sequence would be reordered")]
    NotHead { id: String, head: String },
    #[error("{UNPASSED} {0} within --wait: is outboxd running? A transaction left open on the server holds the slot back too (pg_stat_activity)")]
    Unconfirmed(String),
    #[error("the sequence of event {0} was handed back to outboxd by a redrive, and outboxd publishes its events (see `outboxd parked list`); skip applies to a head that fails")]
    HandedBack(String),
    #[error("topic {topic:?} key {key:?} is being published right now (by outboxd handing it back, or by a redrive): nothing of it was discarded; try again once `outboxd parked list` no longer shows it, or shows it unchanged")]
    Busy { topic: String, key: String },
    #[error("discard deletes parked events for good: add --confirm")]
    NotConfirmed,
    #[error("{0} sequence(s) could not be redriven completely; see above")]
    Incomplete(usize),
}

/// One sequence in `outboxd parked list --json`.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct Listed {
    pub topic: String,
    pub key: String,
    pub head_id: String,
    pub head_reason: String,
    pub events: i64,
    pub bytes: i64,
    pub parked_at: String,
    /// Handed back to the relay by a redrive: outboxd publishes the rest.
    #[serde(default)]
    pub handed_back: bool,
}

async fn store(validated: &Validated) -> Result<ParkStore, ParkError> {
    ParkStore::connect(&validated.pg, &validated.table, validated.slot.as_str()).await
}

/// `outboxd parked list`: per sequence, the head's reason, the count and
/// since when.
pub async fn list(validated: &Validated) -> Result<Vec<Listed>, ParkedError> {
    let heads = store(validated).await?.heads().await?;
    Ok(heads
        .into_iter()
        .map(|h| Listed {
            topic: h.topic,
            key: h.key,
            head_id: h.head_id,
            head_reason: h.head_reason,
            events: h.events,
            bytes: h.bytes,
            parked_at: h.parked_at.to_rfc3339(),
            handed_back: h.handback,
        })
        .collect())
}

/// `outboxd parked show`: the parked events of the selected sequences, in
/// order.
pub async fn show(validated: &Validated, selection: &Selection) -> Result<Vec<ParkedEvent>, ParkedError> {
    let store = store(validated).await?;
    let mut out = Vec::new();
    for h in store.heads().await?.iter().filter(|h| selection.picks(h)) {
        let mut after = None;
        loop {
            let batch = store.events(&h.topic, &h.key, after, BATCH).await?;
            let Some(last) = batch.last() else { break };
            after = Some(last.pos);
            out.extend(batch);
        }
    }
    Ok(out)
}

/// The start of the message that the slot has not passed a position.
const UNPASSED: &str = "the slot has not durably passed (restart_lsn, which follows the confirmed position at checkpoints and running-transaction records, every 15 s or so)";

/// Waits, up to `wait`, until the slot has durably passed the transaction
/// at `lsn` ([`ParkStore::durably_passed`]): the WAL never brings it back
/// to the relay, so what is done with its parked rows stays done.
async fn wait_confirmed(store: &ParkStore, lsn: crate::lsn::Lsn, wait: Duration) -> Result<(), ParkedError> {
    let deadline = Instant::now() + wait;
    loop {
        let passed = store
            .durably_passed()
            .await?
            .ok_or_else(|| ParkedError::NoSlot(store.slot().to_owned()))?;
        if lsn < passed {
            return Ok(());
        }
        if Instant::now() >= deadline {
            return Err(ParkedError::Unconfirmed(lsn.to_string()));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// `outboxd parked discard --confirm`: deletes the selected sequences,
/// once the slot has durably passed them (or a replay would park them
/// again).
pub async fn discard(
    validated: &Validated,
    selection: &Selection,
    confirm: bool,
    wait: Duration,
) -> Result<u64, ParkedError> {
    if !confirm {
        return Err(ParkedError::NotConfirmed);
    }
    let mut store = store(validated).await?;
    let mut n = 0;
    for h in store.heads().await?.into_iter().filter(|h| selection.picks(h)) {
        // Not while the relay hands it back, or a redrive publishes it.
        if !store.lock_sequence(&h.topic, &h.key).await? {
            return Err(ParkedError::Busy {
                topic: h.topic,
                key: h.key,
            });
        }
        let discarded = discard_sequence(&mut store, &h, wait).await;
        store.unlock_sequences().await?;
        n += discarded?;
    }
    Ok(n)
}

/// Discards one sequence (see [`discard`]); returns the events deleted.
async fn discard_sequence(
    store: &mut ParkStore,
    h: &SequenceHead,
    wait: Duration,
) -> Result<u64, ParkedError> {
    let mut n = 0;
    // Events the relay parks meanwhile keep the sequence: they are
    // discarded too once the slot has passed them, and never unseen.
    loop {
        let Some(last) = store.last_lsn(&h.topic, &h.key).await? else {
            if store
                .discard_through(&h.topic, &h.key, crate::lsn::Lsn::ZERO)
                .await?
                .1
            {
                return Ok(n);
            }
            continue;
        };
        wait_confirmed(store, last, wait).await?;
        let (deleted, released) = store.discard_through(&h.topic, &h.key, last).await?;
        n += deleted;
        tracing::warn!(
            topic = h.topic,
            key = h.key,
            events = deleted,
            "discarded parked events"
        );
        if released {
            return Ok(n);
        }
    }
}

/// What a redrive did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Redriven {
    /// Sequences released (every event published).
    pub released: usize,
    /// Events published.
    pub published: u64,
    /// Sequences left parked (a head failed again, or the slot had not
    /// passed their events within `--wait`).
    pub left: usize,
    /// Sequences handed back to the relay, which publishes the rest (see
    /// the module's "Handback").
    pub handed_back: usize,
}

/// Options of `redrive` and `skip`.
#[derive(Clone, Debug)]
pub struct RedriveOptions {
    pub dry_run: bool,
    /// How long to wait for the slot to confirm past parked events.
    pub wait: Duration,
}

/// Why redriving one sequence stopped before its release.
enum Stopped {
    /// The head failed again: it stays parked with this reason.
    Failed(Failed),
    /// The slot did not confirm past these events within `--wait`.
    NotConfirmed { lsn: String },
    /// Handed back to the relay, with this many events left.
    HandedBack { left: usize },
    /// Another publisher holds the sequence: the relay handing it back,
    /// or another redrive.
    Busy,
}

/// `outboxd parked redrive`.
pub async fn redrive(
    config: &Config,
    validated: &Validated,
    selection: &Selection,
    options: &RedriveOptions,
) -> Result<Redriven, ParkedError> {
    let mut store = store(validated).await?;
    let heads: Vec<SequenceHead> = store
        .heads()
        .await?
        .into_iter()
        .filter(|h| selection.picks(h))
        .collect();
    let mut done = Redriven::default();
    if options.dry_run {
        for h in &heads {
            println!(
                "would redrive {} event(s) of topic {:?} key {:?} (head {} parked for {})",
                h.events, h.topic, h.key, h.head_id, h.head_reason
            );
        }
        return Ok(done);
    }
    let mut publisher = Publisher::new(config, validated, Publishing::Redrive).await?;
    publisher.finish_committed(&store).await?;
    for h in &heads {
        // One publisher per sequence at a time (the relay handing it back,
        // or another redrive); a handed-back sequence's head was published
        // already, so what the slot has durably passed is redriven here too
        // (a relay that is down, or at a parking limit, is not waited for).
        let outcome = if store.lock_sequence(&h.topic, &h.key).await? {
            let outcome = redrive_locked(&mut store, &mut publisher, h, options, &mut done).await;
            store.unlock_sequences().await?;
            outcome?
        } else {
            Some(Stopped::Busy)
        };
        match outcome {
            None => {
                done.released += 1;
                tracing::info!(topic = h.topic, key = h.key, "redriven: the sequence is released");
            }
            Some(Stopped::Failed(Failed { id, reason, error })) => {
                done.left += 1;
                eprintln!("outboxd: topic {:?} key {:?}: event {id} still cannot be published ({reason}): {error}; it stays parked at the head", h.topic, h.key);
            }
            Some(Stopped::NotConfirmed { lsn }) => {
                done.left += 1;
                eprintln!("outboxd: topic {:?} key {:?}: {UNPASSED} {lsn} within --wait: is outboxd running? The rest stays parked", h.topic, h.key);
            }
            Some(Stopped::HandedBack { left }) => {
                done.handed_back += 1;
                tracing::info!(topic = h.topic, key = h.key, left, "redriven up to what the slot has durably passed; handed the rest back to outboxd, which publishes it in order ahead of the sequence's later events and releases it");
            }
            Some(Stopped::Busy) if h.handback => {
                done.handed_back += 1;
                tracing::info!(
                    topic = h.topic,
                    key = h.key,
                    "outboxd is publishing this handed-back sequence right now"
                );
            }
            Some(Stopped::Busy) => {
                done.left += 1;
                eprintln!("outboxd: topic {:?} key {:?}: another `outboxd parked redrive` is publishing it right now; left to it", h.topic, h.key);
            }
        }
    }
    Ok(done)
}

/// Under the sequence's lock: finishes what a publisher that stopped
/// between its Kafka commit and its deletes left (its marker), reads the
/// header again (the relay may have handed it back, or ended a handback),
/// and redrives it.
async fn redrive_locked(
    store: &mut ParkStore,
    p: &mut Publisher,
    h: &SequenceHead,
    options: &RedriveOptions,
    done: &mut Redriven,
) -> Result<Option<Stopped>, ParkedError> {
    p.finish_committed(store).await?;
    match store.head(&h.topic, &h.key).await? {
        Some(now) => redrive_sequence(store, p, &now, options, done).await,
        None => Ok(None),
    }
}

/// Redrives one sequence to its end and releases it (`None`), or says why
/// it stopped.
async fn redrive_sequence(
    store: &mut ParkStore,
    p: &mut Publisher,
    h: &SequenceHead,
    options: &RedriveOptions,
    done: &mut Redriven,
) -> Result<Option<Stopped>, ParkedError> {
    let (topic, key) = (h.topic.as_str(), h.key.as_str());
    // The wait is for each look at the slot: a redrive that makes progress
    // goes on.
    let mut deadline = Instant::now() + options.wait;
    // The head is published here, never handed back: its failure is the
    // operator's to see (a sequence handed back had its head published).
    let mut head_published = h.handback;
    loop {
        let batch = store.events(topic, key, None, BATCH).await?;
        if batch.is_empty() {
            if store.release(topic, key).await? {
                return Ok(None);
            }
            continue;
        }
        let passed = store
            .durably_passed()
            .await?
            .ok_or_else(|| ParkedError::NoSlot(store.slot().to_owned()))?;
        // Only what the slot has durably passed: the WAL never brings it
        // back, not even after a crash of PostgreSQL.
        let ready: Vec<&ParkedEvent> = batch.iter().take_while(|e| e.pos.commit_lsn < passed).collect();
        if ready.is_empty() {
            // Caught up: what is left was parked since the slot's last
            // durable step, and the relay has read all of it. A busy
            // aggregate adds more all the time; the relay publishes it.
            if head_published && store.hand_back(topic, key).await? {
                return Ok(Some(Stopped::HandedBack { left: batch.len() }));
            }
            if Instant::now() >= deadline {
                return Ok(Some(Stopped::NotConfirmed {
                    lsn: batch[0].pos.commit_lsn.to_string(),
                }));
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
            continue;
        }
        deadline = Instant::now() + options.wait;
        let (published, failed) = p.publish(store, topic, key, &ready).await?;
        done.published += published;
        head_published |= published > 0;
        if let Some(failed) = failed {
            return Ok(Some(Stopped::Failed(failed)));
        }
    }
}

/// Only a sequence's head may be skipped: the rest keeps its order.
async fn is_head(store: &ParkStore, ev: &ParkedEvent) -> Result<(), ParkedError> {
    let head = store
        .events(&ev.topic, &ev.key, None, 1)
        .await?
        .into_iter()
        .next()
        .ok_or_else(|| ParkedError::NoSuchEvent(ev.id()))?;
    if head.pos != ev.pos {
        return Err(ParkedError::NotHead {
            id: ev.id(),
            head: head.id(),
        });
    }
    Ok(())
}

/// `outboxd parked skip --id`: sends the head of its sequence to the
/// dead-letter topic, deletes it, and redrives the rest.
pub async fn skip(
    config: &Config,
    validated: &Validated,
    id: &str,
    options: &RedriveOptions,
) -> Result<Redriven, ParkedError> {
    let store = store(validated).await?;
    // An exactly-once redrive that committed but did not delete first:
    // its events are in Kafka, and none of them may become a dead letter.
    if !options.dry_run {
        Publisher::new(config, validated, Publishing::Redrive)
            .await?
            .finish_committed(&store)
            .await
            .map_err(ParkedError::Publish)?;
    }
    let ev = store
        .by_id(id)
        .await?
        .ok_or_else(|| ParkedError::NoSuchEvent(id.to_owned()))?;
    is_head(&store, &ev).await?;
    if !store.lock_sequence(&ev.topic, &ev.key).await? {
        return Err(ParkedError::Busy {
            topic: ev.topic.clone(),
            key: ev.key.clone(),
        });
    }
    if store.head(&ev.topic, &ev.key).await?.is_some_and(|h| h.handback) {
        return Err(ParkedError::HandedBack(id.to_owned()));
    }
    if options.dry_run {
        println!(
            "would send event {id} to {} and redrive the rest of topic {:?} key {:?}",
            config.routing.dead_letter_topic, ev.topic, ev.key
        );
        return Ok(Redriven::default());
    }
    // As for a redrive: a replay of the WAL must not park it again. A
    // predecessor replayed meanwhile may have become the head: look again.
    wait_confirmed(&store, ev.pos.commit_lsn, options.wait).await?;
    is_head(&store, &ev).await?;
    let poison = Poison {
        reason: crate::metrics::DEAD_LETTER_REASONS
            .iter()
            .find(|r| **r == ev.reason)
            .copied()
            .unwrap_or("refused"),
        error: ev.error.clone(),
        lsn: ev.pos.commit_lsn,
        intended_topic: Some(ev.topic.clone()),
        omit_payload: false,
    };
    let dead_letter = match &ev.row {
        ParkedRow::Row(row) => dead_letter_for_row(row, &poison, &config.routing.dead_letter_topic),
        ParkedRow::Unreadable {
            id,
            aggregate_id,
            columns_json,
        } => {
            let row = UnreadableRow {
                id: id.clone(),
                aggregate_id: aggregate_id.clone(),
                error: RowError::Message {
                    reason: ev.error.clone(),
                },
                columns_json: columns_json.clone(),
            };
            dead_letter_for_unreadable(&row, &poison, &config.routing.dead_letter_topic)
        }
    };
    // Its own producer, never transactional: a dead letter is a copy for
    // an operator, and it goes before the rest is redriven.
    let mut sink = KafkaSink::new(&config.kafka, config.kafka.admin_timeout.0)?;
    sink.ensure_topic(&dead_letter.topic).await?;
    let sent = loop {
        match sink.send(&dead_letter)? {
            SendOutcome::Sent(f) => break f,
            SendOutcome::QueueFull => tokio::time::sleep(Duration::from_millis(1)).await,
        }
    };
    sent.await.into_result()?;
    store.delete(&ev).await?;
    store.advance_head(&ev.topic, &ev.key).await?;
    tracing::warn!(
        id,
        topic = ev.topic,
        key = ev.key,
        dead_letter_topic = config.routing.dead_letter_topic,
        "skipped: the head went to the dead-letter topic"
    );
    let selection = Selection::Key {
        key: ev.key.clone(),
        topic: Some(ev.topic.clone()),
    };
    // The redrive takes the sequence's lock on a connection of its own.
    store.unlock_sequences().await?;
    redrive(config, validated, &selection, options).await
}
