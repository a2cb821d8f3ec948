//! The three read models of seed 004 and how one event changes each.
//!
//! * `balance` → `account_balance_view`: one row per account, its owner,
//!   balance and status, the version it reflects (`projection_version`) and
//!   the time of the last event applied (`updated_at`).
//! * `history` → `account_transaction_history`: one row per money movement
//!   (the opening deposit included) with the balance after it.
//! * `audit` → `account_audit_log`: one row per event of any type, with its
//!   id, version, correlation id, time, payload and metadata.
//!
//! Every column is a function of the events alone (no `now()`), so a
//! rebuild reproduces the same rows. The runner (`projection.rs`) decides
//! *whether* an event is applied (the version rule); here a projection only
//! says how, or why not: `Ok(Err(reason))` is a broken rule, which the
//! runner dead-letters.

use clap::ValueEnum;
use serde_json::Value;
use tokio_postgres::GenericClient;

use crate::event::AccountRecord;

pub const DDL: &str = "
CREATE TABLE IF NOT EXISTS projection_positions (
    projection text   NOT NULL,
    account_id text   NOT NULL,
    version    bigint NOT NULL,   -- the last version handled: applied or rejected
    PRIMARY KEY (projection, account_id)
);
CREATE TABLE IF NOT EXISTS projection_rejections (
    projection  text        NOT NULL,
    account_id  text        NOT NULL,
    version     bigint      NOT NULL,
    event_id    uuid        NOT NULL,
    reason      text        NOT NULL,
    rejected_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (projection, account_id, version)
);
CREATE TABLE IF NOT EXISTS account_balance_view (
    account_id         text        PRIMARY KEY,
    owner_id           text        NOT NULL,
    balance            bigint      NOT NULL,
    status             text        NOT NULL,
    projection_version bigint      NOT NULL,
    last_event_id      uuid        NOT NULL,
    updated_at         timestamptz NOT NULL
);
CREATE TABLE IF NOT EXISTS account_transaction_history (
    account_id    text        NOT NULL,
    version       bigint      NOT NULL,
    event_id      uuid        NOT NULL,
    kind          text        NOT NULL,   -- OPENING, DEPOSIT or WITHDRAWAL
    amount        bigint      NOT NULL,
    balance_after bigint      NOT NULL,
    description   text        NOT NULL,
    occurred_at   timestamptz NOT NULL,
    PRIMARY KEY (account_id, version)
);
CREATE TABLE IF NOT EXISTS account_audit_log (
    account_id     text        NOT NULL,
    version        bigint      NOT NULL,
    event_id       uuid        NOT NULL,
    event_type     text        NOT NULL,
    correlation_id text,
    occurred_at    timestamptz NOT NULL,
    payload        jsonb       NOT NULL,
    metadata       jsonb       NOT NULL,
    PRIMARY KEY (account_id, version)
)";

/// A projection's verdict on an event: applied, or a broken rule.
pub type Verdict = Result<(), String>;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, ValueEnum)]
pub enum View {
    Balance,
    History,
    Audit,
}

impl View {
    pub const ALL: [View; 3] = [View::Balance, View::History, View::Audit];

    pub fn name(self) -> &'static str {
        match self {
            View::Balance => "balance",
            View::History => "history",
            View::Audit => "audit",
        }
    }

    /// The table a rebuild empties.
    pub fn table(self) -> &'static str {
        match self {
            View::Balance => "account_balance_view",
            View::History => "account_transaction_history",
            View::Audit => "account_audit_log",
        }
    }

    /// Applies `ev`, the account's next version for this view.
    pub async fn apply<C: GenericClient>(
        self,
        db: &C,
        ev: &AccountRecord,
    ) -> Result<Verdict, tokio_postgres::Error> {
        match self {
            View::Balance => balance(db, ev).await,
            View::History => history(db, ev).await,
            View::Audit => audit(db, ev).await,
        }
    }
}

/// An opening's owner and initial balance.
fn opening(ev: &AccountRecord) -> Result<(&str, i64), String> {
    let owner = ev.data["ownerId"].as_str().ok_or("ownerId is missing")?;
    let initial = ev.data["initialBalance"]
        .as_i64()
        .filter(|b| *b >= 0)
        .ok_or("initialBalance must be a non-negative integer")?;
    Ok((owner, initial))
}

/// A movement: its kind, amount, signed change and description.
struct Movement<'a> {
    kind: &'static str,
    amount: i64,
    delta: i64,
    description: &'a str,
}

fn movement(ev: &AccountRecord) -> Result<Movement<'_>, String> {
    let amount = ev.data["amount"]
        .as_i64()
        .ok_or("amount is missing or not an integer")?;
    if amount <= 0 {
        return Err(format!("amount must be positive, got {amount}"));
    }
    let description = ev.data["description"].as_str().unwrap_or_default();
    Ok(match ev.event_type.as_str() {
        "DepositMade" => Movement {
            kind: "DEPOSIT",
            amount,
            delta: amount,
            description,
        },
        _ => Movement {
            kind: "WITHDRAWAL",
            amount,
            delta: -amount,
            description,
        },
    })
}

/// The balance after `delta`, or the rule it breaks.
fn moved(balance: i64, m: &Movement<'_>) -> Result<i64, String> {
    match balance.checked_add(m.delta) {
        Some(b) if b >= 0 => Ok(b),
        Some(_) => Err(format!(
            "withdrawal of {} exceeds the balance {balance}",
            m.amount
        )),
        None => Err(format!("deposit of {} overflows the balance {balance}", m.amount)),
    }
}

fn unknown(ev: &AccountRecord) -> Verdict {
    Err(format!("unknown event type {:?}", ev.event_type))
}

async fn balance<C: GenericClient>(db: &C, ev: &AccountRecord) -> Result<Verdict, tokio_postgres::Error> {
    let row = db
        .query_opt(
            "SELECT balance, status FROM account_balance_view WHERE account_id = $1",
            &[&ev.account_id],
        )
        .await?;
    match ev.event_type.as_str() {
        "AccountOpened" => {
            if row.is_some() {
                return Ok(Err(format!("account {} is already open", ev.account_id)));
            }
            let (owner, initial) = match opening(ev) {
                Ok(o) => o,
                Err(why) => return Ok(Err(why)),
            };
            db.execute(
                "INSERT INTO account_balance_view
                        (account_id, owner_id, balance, status, projection_version, last_event_id, updated_at)
                 VALUES ($1, $2, $3, 'ACTIVE', $4, $5, $6)",
                &[
                    &ev.account_id,
                    &owner,
                    &initial,
                    &ev.version,
                    &ev.event_id,
                    &ev.occurred_at,
                ],
            )
            .await?;
        }
        "DepositMade" | "WithdrawalMade" => {
            let Some(row) = row else {
                return Ok(Err(format!("account {} was never opened", ev.account_id)));
            };
            let (balance, status): (i64, String) = (row.get(0), row.get(1));
            if status != "ACTIVE" {
                return Ok(Err(format!("account {} is {status}", ev.account_id)));
            }
            let after = match movement(ev).and_then(|m| moved(balance, &m)) {
                Ok(b) => b,
                Err(why) => return Ok(Err(why)),
            };
            db.execute(
                "UPDATE account_balance_view
                    SET balance = $2, projection_version = $3, last_event_id = $4, updated_at = $5
                  WHERE account_id = $1",
                &[&ev.account_id, &after, &ev.version, &ev.event_id, &ev.occurred_at],
            )
            .await?;
        }
        _ => return Ok(unknown(ev)),
    }
    Ok(Ok(()))
}

async fn history<C: GenericClient>(db: &C, ev: &AccountRecord) -> Result<Verdict, tokio_postgres::Error> {
    let last: Option<i64> = db
        .query_opt(
            "SELECT balance_after FROM account_transaction_history
              WHERE account_id = $1 ORDER BY version DESC LIMIT 1",
            &[&ev.account_id],
        )
        .await?
        .map(|r| r.get(0));
    let (kind, amount, after, description) = match ev.event_type.as_str() {
        "AccountOpened" => {
            if last.is_some() {
                return Ok(Err(format!("account {} is already open", ev.account_id)));
            }
            match opening(ev) {
                Ok((_, initial)) => ("OPENING", initial, initial, ""),
                Err(why) => return Ok(Err(why)),
            }
        }
        "DepositMade" | "WithdrawalMade" => {
            let Some(balance) = last else {
                return Ok(Err(format!("account {} was never opened", ev.account_id)));
            };
            match movement(ev).and_then(|m| Ok((moved(balance, &m)?, m))) {
                Ok((after, m)) => (m.kind, m.amount, after, m.description),
                Err(why) => return Ok(Err(why)),
            }
        }
        _ => return Ok(unknown(ev)),
    };
    db.execute(
        "INSERT INTO account_transaction_history
                (account_id, version, event_id, kind, amount, balance_after, description, occurred_at)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8)",
        &[
            &ev.account_id,
            &ev.version,
            &ev.event_id,
            &kind,
            &amount,
            &after,
            &description,
            &ev.occurred_at,
        ],
    )
    .await?;
    Ok(Ok(()))
}

/// Every event is audited, whatever its type: the log is of what was
/// recorded, not of what the other views accepted.
async fn audit<C: GenericClient>(db: &C, ev: &AccountRecord) -> Result<Verdict, tokio_postgres::Error> {
    db.execute(
        "INSERT INTO account_audit_log
                (account_id, version, event_id, event_type, correlation_id, occurred_at, payload, metadata)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8)",
        &[
            &ev.account_id,
            &ev.version,
            &ev.event_id,
            &ev.event_type,
            &ev.correlation_id(),
            &ev.occurred_at,
            &ev.data,
            &Value::Object(ev.metadata.clone()),
        ],
    )
    .await?;
    Ok(Ok(()))
}
