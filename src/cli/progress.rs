//! Steps of the recovery commands that act on PostgreSQL and Kafka
//! together (`outboxd progress --accept-publication`, `--reset
//! --create-slot`).

use crate::config::{Config, Validated};
use crate::lsn::Lsn;
use crate::postgres::admin::{self, AdminError, SlotState};
use crate::postgres::connection::{ReplicationConnection, SystemIdentity};
use crate::postgres::publication;
use crate::relay::slot_register::{self, SlotRecord};

/// A recovery step failed.
#[derive(Debug, thiserror::Error)]
pub enum CommandError {
    #[error(transparent)]
    Admin(#[from] AdminError),
    #[error(transparent)]
    Replication(#[from] crate::postgres::error::PgError),
    #[error(transparent)]
    Progress(#[from] crate::relay::exactly_once::ProgressError),
    #[error("replication slot {0} does not exist: there is no stream to accept the publication for (a new slot starts at the current WAL position)")]
    NoSlot(String),
    #[error("the slot register is off (kafka.slot_register = false): nothing records what was accepted, and outboxd only reports an unproven publication")]
    NoRegister,
}

/// Records, in the slot register, the publication as it is now as the one
/// proven for the slot, so that the next start streams with it. The
/// operator runs it after re-publishing the rows the publication may have
/// missed while it changed.
pub async fn accept_publication(
    config: &Config,
    v: &Validated,
    system: &SystemIdentity,
) -> Result<String, CommandError> {
    if !config.kafka.keeps_slot_register() {
        return Err(CommandError::NoRegister);
    }
    let client = admin::connect(&v.pg).await?;
    let version = publication::server_version(&client).await?;
    let kafka = &config.kafka;
    let timeout = kafka.admin_timeout.0;
    let previous = slot_register::read(kafka, &system.system_id, v.slot.as_str(), timeout).await?;
    // As a session would prove it: reading messages if one read them.
    let mut subject = crate::postgres::publication::Subject::new(config, v, version);
    subject.receiving.read_before = previous.as_ref().is_some_and(|r| r.messages.is_some());
    let verified = publication::inspect(&client, &subject).await?;
    let slot = admin::slot_info(&client, &v.slot)
        .await?
        .ok_or_else(|| CommandError::NoSlot(v.slot.as_str().to_owned()))?;
    let confirmed = slot.confirmed_flush_lsn.unwrap_or(Lsn::ZERO);
    let record = previous
        .unwrap_or_else(|| {
            SlotRecord::new(
                v.slot.as_str(),
                &v.pg.dbname,
                &system.system_id,
                system.timeline,
                confirmed,
            )
        })
        .with_publication(Some(verified.fingerprint))
        .with_messages(verified.messages_fingerprint);
    slot_register::write(kafka, &record, timeout).await?;
    Ok(format!(
        "recorded publication {} as it is now for slot {} (confirmed at {confirmed}): the next start streams with it",
        v.publication.as_str(),
        v.slot.as_str()
    ))
}

/// Creates the slot at the current WAL position, if it is missing, and
/// says where it starts.
pub async fn create_slot(config: &Config, v: &Validated) -> Result<String, CommandError> {
    let client = admin::connect(&v.pg).await?;
    let version = publication::server_version(&client).await?;
    let failover = (version >= 170_000).then_some(config.postgres.failover_slot);
    let mut repl = ReplicationConnection::connect(&v.pg).await?;
    let state = admin::ensure_slot(&client, &mut repl, &v.slot, &v.pg.dbname, failover).await?;
    Ok(match state {
        SlotState::Created { consistent_point } => format!(
            "created slot {} at {consistent_point}: it keeps every transaction committed from now on. Run the replay that closes the gap, then start outboxd",
            v.slot.as_str()
        ),
        SlotState::Existing(info) => format!(
            "slot {} exists (confirmed at {}): it was left as it is",
            v.slot.as_str(),
            info.confirmed_flush_lsn.map(|l| l.to_string()).unwrap_or_else(|| "-".into())
        ),
    })
}
