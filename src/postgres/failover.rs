//! Failover protection (PostgreSQL 17+): will the slot outlive a promotion?
//!
//! A logical slot lives on one server. Since PostgreSQL 17 a *failover*
//! slot is copied to physical standbys that run with
//! `sync_replication_slots = on`, so that after a promotion outboxd resumes
//! from the copy instead of losing its position. Three things must hold,
//! and this module checks each, by name:
//!
//! 1. **On the primary**, the slot has `failover = true` (outboxd creates it
//!    so unless `postgres.failover_slot = false`).
//! 2. **On the primary**, `synchronized_standby_slots` names the standbys'
//!    physical slots, and they stream. Without it outboxd may receive (and
//!    confirm) changes a standby has not yet received; after a promotion the
//!    standby's copy would then point past its own WAL.
//! 3. **On each standby** listed in `postgres.url` (`host=primary,standby`),
//!    the copy exists, is `synced`, persistent (a copy is temporary until
//!    the standby has caught up with the slot once) and not `conflicting`.
//!    A standby outside the URL cannot be seen, so protection is reported
//!    only when at least one copy was verified.
//!
//! The relay's poller runs [`inspect`] every `health.poll_interval` and
//! publishes the answer as `outboxd_failover_protected` and in `/readyz`,
//! `/status`; `outboxd check` prints it.

use tokio_postgres::Client;

use crate::config::conninfo::{PgConnectConfig, TargetSessionAttrs};
use crate::config::ident::SlotName;
use crate::lsn::Lsn;
use crate::postgres::admin::{self, AdminError};
use crate::postgres::publication;

/// The answer of [`inspect`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Protection {
    /// The server is older than PostgreSQL 17: it has no failover slots.
    Unavailable { server_version: i32 },
    /// Every condition holds; `detail` names the verified copies.
    Protected { detail: String },
    /// At least one condition fails; each entry says which and what to do.
    Unprotected { problems: Vec<String> },
}

impl Protection {
    /// One line for logs, `check` and `/status`.
    pub fn describe(&self) -> String {
        match self {
            Protection::Unavailable { server_version } => format!(
                "not available: PostgreSQL {} has no failover slots (17+ has); a promotion loses the slot",
                server_version / 10_000
            ),
            Protection::Protected { detail } => format!("protected: {detail}"),
            Protection::Unprotected { problems } => format!("unprotected: {}", problems.join("; ")),
        }
    }

    /// `outboxd_failover_protected`: 1 protected, 0 not (or unavailable).
    pub fn gauge(&self) -> i64 {
        i64::from(matches!(self, Protection::Protected { .. }))
    }
}

/// A standby's copy of the slot, as read on that standby.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Copy {
    server: String,
    confirmed: Option<Lsn>,
}

/// Checks the three conditions (see the module doc). `client` is connected
/// to the primary; the standbys are found among `cfg`'s hosts.
pub async fn inspect(
    client: &Client,
    cfg: &PgConnectConfig,
    slot: &SlotName,
) -> Result<Protection, AdminError> {
    let server_version = publication::server_version(client).await?;
    if server_version < 170_000 {
        return Ok(Protection::Unavailable { server_version });
    }
    let mut problems = Vec::new();
    let primary_confirmed = match admin::slot_info(client, slot).await? {
        None => {
            problems.push(format!("slot {} does not exist yet", slot.as_str()));
            None
        }
        Some(info) => {
            if info.failover != Some(true) {
                problems.push(format!(
                    "slot {} is not a failover slot: set postgres.failover_slot = true (the default) and restart outboxd, which alters it",
                    slot.as_str()
                ));
            }
            info.confirmed_flush_lsn
        }
    };
    problems.extend(standby_slots_on_primary(client).await?);
    let mut copies = Vec::new();
    let mut standbys = 0;
    for server in cfg.each_server() {
        let server = PgConnectConfig {
            target_session_attrs: TargetSessionAttrs::Any,
            ..server
        };
        let name = server.endpoint().to_string();
        let standby = match admin::connect(&server).await {
            Ok(c) => c,
            Err(e) => {
                // The primary answered on the main connection; a listed
                // server that does not answer may be the standby.
                problems.push(format!(
                    "{name} does not answer, so its copy of the slot cannot be checked: {e}"
                ));
                continue;
            }
        };
        let in_recovery: bool = standby.query_one("SELECT pg_is_in_recovery()", &[]).await?.get(0);
        if !in_recovery {
            continue;
        }
        standbys += 1;
        match copy_on_standby(&standby, slot, &name).await? {
            Ok(copy) => copies.push(copy),
            Err(problem) => problems.push(problem),
        }
    }
    if standbys == 0 {
        problems.push(
            "no standby is listed in postgres.url, so no copy of the slot can be verified: list the standbys (postgres://primary:5432,standby:5432/db?target_session_attrs=read-write), which also lets outboxd follow a promotion".to_owned(),
        );
    }
    if !problems.is_empty() {
        return Ok(Protection::Unprotected { problems });
    }
    let detail = copies
        .iter()
        .map(|c| {
            let behind = match (primary_confirmed, c.confirmed) {
                (Some(p), Some(s)) => format!("{} bytes behind the primary", p.0.saturating_sub(s.0)),
                _ => "position unknown".to_owned(),
            };
            format!(
                "{} holds a synced copy at {} ({behind})",
                c.server,
                c.confirmed.map(|l| l.to_string()).unwrap_or_else(|| "-".into())
            )
        })
        .collect::<Vec<_>>()
        .join(", ");
    Ok(Protection::Protected { detail })
}

/// Condition 2: `synchronized_standby_slots` names physical slots that exist
/// and stream.
async fn standby_slots_on_primary(client: &Client) -> Result<Vec<String>, AdminError> {
    let setting: String = client
        .query_one("SELECT current_setting('synchronized_standby_slots')", &[])
        .await?
        .get(0);
    let names: Vec<&str> = setting
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .collect();
    if names.is_empty() {
        return Ok(vec![
            "synchronized_standby_slots is empty on the primary: set it to the standby's physical slot (ALTER SYSTEM SET synchronized_standby_slots = 'standby1'; SELECT pg_reload_conf();), or outboxd may confirm changes the standby never received".to_owned(),
        ]);
    }
    let mut problems = Vec::new();
    for name in names {
        let row = client
            .query_opt(
                "SELECT slot_type, active FROM pg_catalog.pg_replication_slots WHERE slot_name = $1",
                &[&name],
            )
            .await?;
        match row {
            None => problems.push(format!(
                "synchronized_standby_slots names {name:?}, which is not a slot on the primary: create it with SELECT pg_create_physical_replication_slot('{name}') and set primary_slot_name on the standby"
            )),
            Some(r) if r.get::<_, String>(0) != "physical" => {
                problems.push(format!("synchronized_standby_slots names {name:?}, which is not a physical slot"))
            }
            Some(r) if !r.get::<_, bool>(1) => problems.push(format!(
                "the standby slot {name:?} is not streaming: the standby is down or not connected, and outboxd's changes wait for it"
            )),
            Some(_) => {}
        }
    }
    Ok(problems)
}

/// Condition 3 on one standby: `Ok` with the copy, or `Err` with the problem.
async fn copy_on_standby(
    standby: &Client,
    slot: &SlotName,
    server: &str,
) -> Result<Result<Copy, String>, AdminError> {
    let info = admin::slot_info(standby, slot).await?;
    let sync: String = standby
        .query_one("SELECT current_setting('sync_replication_slots')", &[])
        .await?
        .get(0);
    Ok(match info {
        None if sync != "on" => Err(format!(
            "standby {server} does not sync slots: set sync_replication_slots = on, hot_standby_feedback = on, primary_slot_name, and dbname in primary_conninfo there"
        )),
        None => Err(format!(
            "standby {server} has no copy of slot {} yet (the slot sync worker copies failover slots; is primary_conninfo's dbname set?)",
            slot.as_str()
        )),
        Some(c) if c.synced != Some(true) => Err(format!(
            "standby {server} has a slot {} that is not a synced copy (created there by hand?)",
            slot.as_str()
        )),
        Some(c) if c.temporary => Err(format!(
            "standby {server}'s copy of slot {} is not persistent yet: it becomes so once the standby has caught up with the slot; a promotion now would drop it",
            slot.as_str()
        )),
        Some(c) if c.invalidated().is_some() => Err(format!(
            "standby {server}'s copy of slot {} is invalidated ({}): a promotion would not keep the position",
            slot.as_str(),
            c.invalidated().unwrap_or_default()
        )),
        Some(c) => Ok(Copy {
            server: server.to_owned(),
            confirmed: c.confirmed_flush_lsn,
        }),
    })
}
