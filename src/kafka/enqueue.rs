//! Handing one outbox row read from the table to the producer: the part
//! that polling mode ([`crate::relay::polling`]) and `outboxd replay`
//! ([`crate::cli::replay`]) share.
//!
//! A row becomes its record (the caller builds it, so that it can add
//! headers), or, when it can never be published (a [`RecordError`], or a
//! record Kafka refuses for good when it is enqueued), follows
//! `routing.on_poison`: `stop` returns [`EnqueueError::Poison`], and
//! `dead-letter` sends its dead letter instead. Nothing waits for the
//! broker here: the caller awaits the returned futures in row order.

use std::time::Duration;

use crate::kafka::delivery::Awaited;

use crate::config::{OnPoison, RoutingConfig};
use crate::kafka::records::{dead_letter_for_row, dead_letter_stub, KafkaRecord, Poison, RecordError};
use crate::kafka::sink::{KafkaSink, KafkaSinkError, Refusal, SendOutcome};
use crate::source::outbox::OutboxRow;
use crate::Lsn;

/// Why a row was not enqueued.
#[derive(Debug, thiserror::Error)]
pub enum EnqueueError {
    #[error(transparent)]
    Kafka(#[from] KafkaSinkError),
    #[error(
        "outbox row {id} can never be published: {error}; fix it, or set routing.on_poison = \"dead-letter\""
    )]
    Poison { id: String, error: String },
}

/// What was enqueued for a row.
#[allow(missing_debug_implementations)]
pub enum Enqueued {
    /// The row's record.
    Record(Awaited),
    /// Its dead letter, for this reason.
    DeadLetter(Awaited, &'static str),
}

impl Enqueued {
    pub fn into_future(self) -> Awaited {
        match self {
            Enqueued::Record(f) | Enqueued::DeadLetter(f, _) => f,
        }
    }
}

/// A row whose record Kafka refused on its own (sent alone, so that the
/// refusal is the row's and not a batch neighbour's): its dead letter is
/// enqueued, or, under `stop`, [`EnqueueError::Poison`].
pub async fn set_aside(
    sink: &mut KafkaSink,
    routing: &RoutingConfig,
    row: &OutboxRow,
    reason: &'static str,
    error: String,
) -> Result<Enqueued, EnqueueError> {
    let dl = dead_letter(routing, row, reason, error)?;
    Ok(Enqueued::DeadLetter(send(sink, &dl).await?, reason))
}

/// Enqueues `record` (built from `row`), or the row's dead letter.
pub async fn enqueue_row(
    sink: &mut KafkaSink,
    routing: &RoutingConfig,
    row: &OutboxRow,
    record: Result<KafkaRecord, RecordError>,
) -> Result<Enqueued, EnqueueError> {
    let record = match record {
        Ok(r) => r,
        Err(e) => {
            let dl = dead_letter(routing, row, e.reason(), e.to_string())?;
            return Ok(Enqueued::DeadLetter(send(sink, &dl).await?, e.reason()));
        }
    };
    sink.ensure_topic(&record.topic).await?;
    loop {
        match sink.send(&record) {
            Ok(SendOutcome::Sent(f)) => return Ok(Enqueued::Record(f)),
            Ok(SendOutcome::QueueFull) => tokio::time::sleep(Duration::from_millis(1)).await,
            Err(KafkaSinkError::Produce { source, topic }) => {
                let Refusal::Record { reason, .. } = Refusal::of(&source) else {
                    return Err(KafkaSinkError::Produce { source, topic }.into());
                };
                let dl = dead_letter(routing, row, reason, source.to_string())?;
                return Ok(Enqueued::DeadLetter(send(sink, &dl).await?, reason));
            }
            Err(e) => return Err(e.into()),
        }
    }
}

/// A row that can never be published: [`EnqueueError::Poison`] in `stop`
/// mode, else its dead letter.
fn dead_letter(
    routing: &RoutingConfig,
    row: &OutboxRow,
    reason: &'static str,
    error: String,
) -> Result<KafkaRecord, EnqueueError> {
    // Parking keeps the relay's order; a replay re-publishes history and
    // has no sequence to park behind: it stops at the row instead.
    if routing.on_poison != OnPoison::DeadLetter {
        return Err(EnqueueError::Poison {
            id: row.id.clone(),
            error,
        });
    }
    tracing::warn!(id = %row.id, reason, error = %error, "outbox row can never be published; sending it to the dead-letter topic");
    let poison = Poison {
        reason,
        error,
        lsn: Lsn::ZERO,
        intended_topic: None,
        omit_payload: reason == "too_large",
    };
    Ok(dead_letter_for_row(row, &poison, &routing.dead_letter_topic))
}

/// The stub of a row's dead letter that Kafka refused (a dead letter keeps
/// the row's headers, which may be what is too large), enqueued: the id,
/// the reason and the sizes, small enough for any topic. The caller awaits
/// it as it would the dead letter.
pub async fn set_aside_as_stub(
    sink: &mut KafkaSink,
    routing: &RoutingConfig,
    row: &OutboxRow,
    reason: &'static str,
    error: String,
    refused: &str,
) -> Result<Enqueued, EnqueueError> {
    let dl = dead_letter(routing, row, reason, error)?;
    tracing::warn!(id = %row.id, error = refused, "Kafka refused a dead letter; sending its stub (id, reason, sizes) instead");
    let stub = dead_letter_stub(&dl, refused);
    Ok(Enqueued::DeadLetter(send(sink, &stub).await?, reason))
}

/// Enqueues a dead letter, waiting while the queue is full. One that
/// librdkafka refuses on its own (larger than `message.max.bytes`) goes
/// as its stub.
async fn send(sink: &mut KafkaSink, rec: &KafkaRecord) -> Result<Awaited, KafkaSinkError> {
    sink.ensure_topic(&rec.topic).await?;
    let mut stub: Option<KafkaRecord> = None;
    loop {
        match sink.send(stub.as_ref().unwrap_or(rec)) {
            Ok(SendOutcome::Sent(f)) => return Ok(f),
            Ok(SendOutcome::QueueFull) => tokio::time::sleep(Duration::from_millis(1)).await,
            Err(KafkaSinkError::Produce { source, .. })
                if stub.is_none() && matches!(Refusal::of(&source), Refusal::Record { .. }) =>
            {
                tracing::warn!(error = %source, "Kafka refused a dead letter; sending its stub (id, reason, sizes) instead");
                stub = Some(dead_letter_stub(rec, &source.to_string()));
            }
            Err(e) => return Err(e),
        }
    }
}
