//! Event-sourced bank accounts (seed 004).
//!
//! [`Account`] is the aggregate: commands (`open`, `deposit`, `withdraw`)
//! check the seed's rules and record events; state changes only by
//! applying events, so loading replays history. Amounts are integers in
//! minor units (cents).
//!
//! [`AccountStore`] loads an account from its latest snapshot plus the
//! later events, saves new events (with their outbox rows, so outboxd
//! publishes them to `account.events`) and a snapshot every N versions, and
//! answers time-travel queries in SQL. [`AccountStore::update`] runs a
//! command with optimistic concurrency and retries on conflict.
//!
//! ```no_run
//! # async fn example(client: &mut tokio_postgres::Client) -> Result<(), Box<dyn std::error::Error>> {
//! use outbox_sdk::accounts::{Account, AccountStore};
//! use outbox_sdk::outbox::Headers;
//! let store = AccountStore::default();
//! let tx = client.transaction().await?;
//! let mut account = Account::open("acc-1", "owner-1", 3_000)?;
//! store.save(&tx, &mut account, &Headers::new()).await?;
//! tx.commit().await?;
//! let state = store.update(client, "acc-1", 10, &Headers::new(), |a| a.deposit(2_500, "salary")).await?;
//! assert_eq!(state.balance, 5_500);
//! # Ok(()) }
//! ```

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use tokio_postgres::{Client, GenericClient, Transaction};

use crate::error::SdkError;
use crate::event_store::{AggregateKey, EventStore, EventStoreError, NewEvent, RecordedEvent};
use crate::outbox::Headers;

/// The aggregate type of accounts: outboxd publishes to `account.events`.
pub const AGGREGATE_TYPE: &str = "Account";

/// The event-store key of account `id`.
pub fn key(id: &str) -> AggregateKey<'_> {
    AggregateKey::new(AGGREGATE_TYPE, id)
}

/// Whether an account accepts money movements.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum AccountStatus {
    Active,
    Frozen,
    Closed,
}

/// An account's state at some version.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AccountState {
    pub id: String,
    pub owner_id: String,
    pub balance: i64,
    pub status: AccountStatus,
    pub version: i64,
}

/// The account's domain events.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AccountEvent {
    AccountOpened { owner_id: String, initial_balance: i64 },
    DepositMade { amount: i64, description: String },
    WithdrawalMade { amount: i64, description: String },
}

pub const ACCOUNT_OPENED: &str = "AccountOpened";
pub const DEPOSIT_MADE: &str = "DepositMade";
pub const WITHDRAWAL_MADE: &str = "WithdrawalMade";

impl AccountEvent {
    /// The stored and published event type.
    pub fn type_name(&self) -> &'static str {
        match self {
            AccountEvent::AccountOpened { .. } => ACCOUNT_OPENED,
            AccountEvent::DepositMade { .. } => DEPOSIT_MADE,
            AccountEvent::WithdrawalMade { .. } => WITHDRAWAL_MADE,
        }
    }

    /// The JSON payload, with the seed's field names.
    pub fn payload(&self) -> Value {
        match self {
            AccountEvent::AccountOpened {
                owner_id,
                initial_balance,
            } => {
                json!({"ownerId": owner_id, "initialBalance": initial_balance})
            }
            AccountEvent::DepositMade { amount, description }
            | AccountEvent::WithdrawalMade { amount, description } => {
                json!({"amount": amount, "description": description})
            }
        }
    }

    /// Reads a stored event back.
    pub fn from_stored(event_type: &str, payload: &Value) -> Result<Self, SdkError> {
        #[derive(Deserialize)]
        #[serde(rename_all = "camelCase")]
        struct Opened {
            owner_id: String,
            initial_balance: i64,
        }
        #[derive(Deserialize)]
        struct Movement {
            amount: i64,
            #[serde(default)]
            description: String,
        }
        Ok(match event_type {
            ACCOUNT_OPENED => {
                let o: Opened = serde_json::from_value(payload.clone())?;
                AccountEvent::AccountOpened {
                    owner_id: o.owner_id,
                    initial_balance: o.initial_balance,
                }
            }
            DEPOSIT_MADE => {
                let m: Movement = serde_json::from_value(payload.clone())?;
                AccountEvent::DepositMade {
                    amount: m.amount,
                    description: m.description,
                }
            }
            WITHDRAWAL_MADE => {
                let m: Movement = serde_json::from_value(payload.clone())?;
                AccountEvent::WithdrawalMade {
                    amount: m.amount,
                    description: m.description,
                }
            }
            other => {
                return Err(SdkError::InvalidEvent(format!(
                    "unknown account event type {other:?}"
                )))
            }
        })
    }
}

/// A command broke one of the account's rules; nothing was recorded.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum AccountError {
    #[error("the initial balance must not be negative, got {0}")]
    NegativeInitialBalance(i64),
    #[error("the amount must be greater than 0, got {0}")]
    NonPositiveAmount(i64),
    #[error("only an active account accepts deposits and withdrawals; this one is {0:?}")]
    NotActive(AccountStatus),
    #[error("insufficient funds: balance {balance}, withdrawal {requested}")]
    InsufficientFunds { balance: i64, requested: i64 },
    #[error("the balance would overflow")]
    Overflow,
}

/// The aggregate: state plus the events recorded since it was loaded.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Account {
    state: AccountState,
    pending: Vec<AccountEvent>,
}

impl Account {
    /// Opens an account with an initial balance ≥ 0.
    pub fn open(
        id: impl Into<String>,
        owner_id: impl Into<String>,
        initial_balance: i64,
    ) -> Result<Self, AccountError> {
        if initial_balance < 0 {
            return Err(AccountError::NegativeInitialBalance(initial_balance));
        }
        let mut account = Account::empty(id.into());
        account.record(AccountEvent::AccountOpened {
            owner_id: owner_id.into(),
            initial_balance,
        });
        Ok(account)
    }

    fn empty(id: String) -> Self {
        Account {
            state: AccountState {
                id,
                owner_id: String::new(),
                balance: 0,
                status: AccountStatus::Active,
                version: 0,
            },
            pending: Vec::new(),
        }
    }

    /// Restores an account from a snapshot.
    pub fn from_snapshot(state: AccountState) -> Self {
        Account {
            state,
            pending: Vec::new(),
        }
    }

    pub fn state(&self) -> &AccountState {
        &self.state
    }

    /// The version including recorded but unsaved events.
    pub fn version(&self) -> i64 {
        self.state.version
    }

    /// Events recorded and not yet saved.
    pub fn pending(&self) -> &[AccountEvent] {
        &self.pending
    }

    fn ensure_movement(&self, amount: i64) -> Result<(), AccountError> {
        if self.state.status != AccountStatus::Active {
            return Err(AccountError::NotActive(self.state.status));
        }
        if amount <= 0 {
            return Err(AccountError::NonPositiveAmount(amount));
        }
        Ok(())
    }

    /// Deposits `amount` (> 0) into an active account.
    pub fn deposit(&mut self, amount: i64, description: impl Into<String>) -> Result<(), AccountError> {
        self.ensure_movement(amount)?;
        self.state
            .balance
            .checked_add(amount)
            .ok_or(AccountError::Overflow)?;
        self.record(AccountEvent::DepositMade {
            amount,
            description: description.into(),
        });
        Ok(())
    }

    /// Withdraws `amount` (> 0, at most the balance) from an active account.
    pub fn withdraw(&mut self, amount: i64, description: impl Into<String>) -> Result<(), AccountError> {
        self.ensure_movement(amount)?;
        if self.state.balance < amount {
            return Err(AccountError::InsufficientFunds {
                balance: self.state.balance,
                requested: amount,
            });
        }
        self.record(AccountEvent::WithdrawalMade {
            amount,
            description: description.into(),
        });
        Ok(())
    }

    fn record(&mut self, event: AccountEvent) {
        self.apply(&event);
        self.pending.push(event);
    }

    /// The state transition of one event; version moves by one.
    fn apply(&mut self, event: &AccountEvent) {
        match event {
            AccountEvent::AccountOpened {
                owner_id,
                initial_balance,
            } => {
                self.state.owner_id.clone_from(owner_id);
                self.state.balance = *initial_balance;
                self.state.status = AccountStatus::Active;
            }
            AccountEvent::DepositMade { amount, .. } => self.state.balance += amount,
            AccountEvent::WithdrawalMade { amount, .. } => self.state.balance -= amount,
        }
        self.state.version += 1;
    }

    /// Applies a stored event; it must be the next version.
    pub fn replay(&mut self, recorded: &RecordedEvent) -> Result<(), SdkError> {
        if recorded.version != self.state.version + 1 {
            return Err(SdkError::InvalidEvent(format!(
                "account {} event version {} does not follow {}",
                self.state.id, recorded.version, self.state.version
            )));
        }
        self.apply(&AccountEvent::from_stored(
            &recorded.event_type,
            &recorded.payload,
        )?);
        Ok(())
    }

    /// Rebuilds an account from its full history.
    pub fn from_history<'a>(
        id: impl Into<String>,
        events: impl IntoIterator<Item = &'a RecordedEvent>,
    ) -> Result<Self, SdkError> {
        let mut a = Account::empty(id.into());
        for e in events {
            a.replay(e)?;
        }
        Ok(a)
    }
}

/// Where a load started.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LoadInfo {
    /// The snapshot's version, when one was used.
    pub snapshot_version: Option<i64>,
    /// Events replayed after it.
    pub events_replayed: usize,
}

/// A command could not be carried out.
#[derive(Debug, thiserror::Error)]
pub enum AccountCommandError {
    #[error(transparent)]
    Domain(#[from] AccountError),
    #[error("account {0} does not exist")]
    NotFound(String),
    #[error("account {id}: still conflicting after {attempts} attempts")]
    RetriesExhausted { id: String, attempts: u32 },
    #[error(transparent)]
    Store(#[from] EventStoreError),
}

impl From<SdkError> for AccountCommandError {
    fn from(e: SdkError) -> Self {
        AccountCommandError::Store(EventStoreError::Sdk(e))
    }
}

impl From<tokio_postgres::Error> for AccountCommandError {
    fn from(e: tokio_postgres::Error) -> Self {
        AccountCommandError::Store(e.into())
    }
}

/// Loads and saves accounts.
#[derive(Clone, Copy, Debug, Default)]
pub struct AccountStore {
    events: EventStore,
}

impl AccountStore {
    pub fn new(events: EventStore) -> Self {
        AccountStore { events }
    }

    /// Loads the latest snapshot plus the later events.
    pub async fn load<C: GenericClient>(
        &self,
        client: &C,
        id: &str,
    ) -> Result<Option<Account>, EventStoreError> {
        Ok(self.load_with_info(client, id).await?.map(|(a, _)| a))
    }

    /// Like [`AccountStore::load`], and says where loading started.
    pub async fn load_with_info<C: GenericClient>(
        &self,
        client: &C,
        id: &str,
    ) -> Result<Option<(Account, LoadInfo)>, EventStoreError> {
        self.load_up_to(client, id, i64::MAX).await
    }

    /// The account at version `up_to` (or its latest, if lower): the latest
    /// snapshot at or below it plus the events after the snapshot.
    async fn load_up_to<C: GenericClient>(
        &self,
        client: &C,
        id: &str,
        up_to: i64,
    ) -> Result<Option<(Account, LoadInfo)>, EventStoreError> {
        let (mut account, snapshot_version) =
            match self.events.latest_snapshot(client, key(id), up_to).await? {
                Some((version, state)) => {
                    let state: AccountState = serde_json::from_value(state).map_err(SdkError::from)?;
                    if state.version != version || state.id != id {
                        return Err(SdkError::InvalidEvent(format!(
                            "snapshot of account {id} at version {version} holds account {} at version {}",
                            state.id, state.version
                        ))
                        .into());
                    }
                    (Account::from_snapshot(state), Some(version))
                }
                None => (Account::empty(id.to_owned()), None),
            };
        let events = self
            .events
            .read_range(client, key(id), account.version(), up_to)
            .await?;
        if snapshot_version.is_none() && events.is_empty() {
            return Ok(None);
        }
        for e in &events {
            account.replay(e)?;
        }
        Ok(Some((
            account,
            LoadInfo {
                snapshot_version,
                events_replayed: events.len(),
            },
        )))
    }

    /// Saves the account's pending events (and their outbox rows), plus a
    /// snapshot when the new version crosses a snapshot point.
    pub async fn save(
        &self,
        tx: &Transaction<'_>,
        account: &mut Account,
        headers: &Headers,
    ) -> Result<Vec<RecordedEvent>, EventStoreError> {
        if account.pending.is_empty() {
            return Ok(Vec::new());
        }
        let expected = account.version() - account.pending.len() as i64;
        let new: Vec<NewEvent> = account
            .pending
            .iter()
            .map(|e| NewEvent {
                event_type: e.type_name().to_owned(),
                payload: e.payload(),
            })
            .collect();
        let recorded = self
            .events
            .append(tx, key(&account.state.id), expected, &new, headers)
            .await?;
        if self.events.crosses_snapshot(expected, account.version()) {
            let state = serde_json::to_value(&account.state).map_err(SdkError::from)?;
            self.events
                .save_snapshot(tx, key(&account.state.id), account.version(), &state)
                .await?;
        }
        account.pending.clear();
        Ok(recorded)
    }

    /// Loads, runs `command`, saves and commits; on a concurrency conflict
    /// it reloads and tries again, up to `max_attempts` times. A broken rule
    /// returns [`AccountError`] and writes nothing.
    pub async fn update<F>(
        &self,
        client: &mut Client,
        id: &str,
        max_attempts: u32,
        headers: &Headers,
        mut command: F,
    ) -> Result<AccountState, AccountCommandError>
    where
        F: FnMut(&mut Account) -> Result<(), AccountError>,
    {
        for _ in 0..max_attempts.max(1) {
            let tx = client.transaction().await?;
            let mut account = self
                .load(&tx, id)
                .await?
                .ok_or_else(|| AccountCommandError::NotFound(id.to_owned()))?;
            command(&mut account)?;
            match self.save(&tx, &mut account, headers).await {
                Ok(_) => {
                    tx.commit().await?;
                    return Ok(account.state);
                }
                Err(EventStoreError::ConcurrencyConflict { .. }) => {
                    tx.rollback().await?;
                }
                Err(e) => return Err(e.into()),
            }
        }
        Err(AccountCommandError::RetriesExhausted {
            id: id.to_owned(),
            attempts: max_attempts.max(1),
        })
    }

    /// The account as it was at `at` (`None` if it did not exist yet): the
    /// state after [`EventStore::version_at`], which is always a prefix of
    /// its history, loaded from the latest snapshot at or below it.
    pub async fn state_at<C: GenericClient>(
        &self,
        client: &C,
        id: &str,
        at: DateTime<Utc>,
    ) -> Result<Option<AccountState>, EventStoreError> {
        let version = self.events.version_at(client, key(id), at).await?;
        if version == 0 {
            return Ok(None);
        }
        Ok(self
            .load_up_to(client, id, version)
            .await?
            .map(|(account, _)| account.state))
    }

    /// The events that took the account from its state just before `from`
    /// to its state at `to` (see [`EventStore::events_between`]).
    pub async fn events_between<C: GenericClient>(
        &self,
        client: &C,
        id: &str,
        from: DateTime<Utc>,
        to: DateTime<Utc>,
    ) -> Result<Vec<RecordedEvent>, EventStoreError> {
        self.events.events_between(client, key(id), from, to).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rules() {
        assert_eq!(
            Account::open("a", "o", -1),
            Err(AccountError::NegativeInitialBalance(-1))
        );
        let mut a = Account::open("a", "o", 100).unwrap();
        assert_eq!(a.deposit(0, ""), Err(AccountError::NonPositiveAmount(0)));
        assert_eq!(
            a.withdraw(101, ""),
            Err(AccountError::InsufficientFunds {
                balance: 100,
                requested: 101
            })
        );
        a.withdraw(100, "all").unwrap();
        assert_eq!(a.state().balance, 0);
        assert_eq!(a.version(), 2);
        assert_eq!(a.pending().len(), 2);
        let mut frozen = Account::from_snapshot(AccountState {
            status: AccountStatus::Frozen,
            ..a.state().clone()
        });
        assert_eq!(
            frozen.deposit(5, ""),
            Err(AccountError::NotActive(AccountStatus::Frozen))
        );
        assert!(frozen.pending().is_empty(), "a broken rule records nothing");
    }

    #[test]
    fn events_round_trip_through_storage_form() {
        for e in [
            AccountEvent::AccountOpened {
                owner_id: "o".into(),
                initial_balance: 3000,
            },
            AccountEvent::DepositMade {
                amount: 2500,
                description: "d".into(),
            },
            AccountEvent::WithdrawalMade {
                amount: 500,
                description: "w".into(),
            },
        ] {
            assert_eq!(AccountEvent::from_stored(e.type_name(), &e.payload()).unwrap(), e);
        }
        assert!(AccountEvent::from_stored("Closed", &json!({})).is_err());
    }
}
