//! The sources as the HTTP endpoints see them: each source's name, state,
//! metrics and health, and the channel that carries an operator's verbs
//! (pause, resume, restart) to the supervisor ([`crate::daemon`]).
//!
//! The supervisor owns the sources and writes their state here; the HTTP
//! server only reads, and asks for changes through [`Control`].

use std::sync::{Arc, Mutex, RwLock};

use serde::Serialize;
use tokio::sync::{mpsc, oneshot};

use crate::metrics::Metrics;
use crate::ops::health::{Health, Snapshot};

/// Where a source's lifecycle stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum State {
    /// Its relay runs (streaming, reconnecting or standing by).
    Running,
    /// Paused by an operator: drained, the slot not streamed (its WAL is
    /// kept), until `resume`, a restart of the source or of outboxd.
    Paused,
    /// Stopped on an error a retry will not fix (see `last_error`).
    Failed,
    /// Draining, on its way to paused, restarted or removed.
    Stopping,
    /// `[coordination]`: the replicas' group assigns it to another replica
    /// (or has not assigned it yet); this one runs no relay for it.
    Unassigned,
}

/// An operator's verb for one source.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verb {
    Pause,
    Resume,
    Restart,
}

/// A verb sent to the supervisor, answered with the outcome.
#[derive(Debug)]
pub struct Control {
    pub source: String,
    pub verb: Verb,
    pub reply: oneshot::Sender<Result<(), ControlError>>,
}

/// Why a verb was not carried out.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ControlError {
    #[error("no source named {0:?}; GET /sources lists them")]
    NoSuchSource(String),
    #[error("source {0:?} is {1}; {2}")]
    Conflict(String, &'static str, &'static str),
    #[error("outboxd is stopping")]
    Stopping,
}

/// One source.
#[derive(Debug)]
pub struct Source {
    pub name: String,
    pub required: bool,
    /// `cdc` or `polling`.
    pub mode: &'static str,
    pub slot: String,
    pub table: String,
    /// The PostgreSQL servers and database (no password).
    pub postgres: String,
    pub metrics: Arc<Metrics>,
    pub health: Arc<Health>,
    state: Mutex<(State, Option<String>)>,
}

/// A source's status, for `/status`, `/sources` and `outboxd status`.
#[derive(Clone, Debug, Serialize, serde::Deserialize, PartialEq)]
pub struct SourceStatus {
    pub name: String,
    pub state: String,
    pub required: bool,
    pub mode: String,
    pub slot: String,
    pub table: String,
    pub postgres: String,
    /// The error the source stopped on, if it failed.
    pub last_error: Option<String>,
    #[serde(flatten)]
    pub snapshot: Snapshot,
}

impl Source {
    pub fn new(
        config: &crate::config::sources::SourceConfig,
        metrics: Arc<Metrics>,
        health: Arc<Health>,
    ) -> Self {
        let v = &config.validated;
        Source {
            name: config.name.clone(),
            required: config.required,
            mode: match config.config.mode {
                crate::config::Mode::Cdc => "cdc",
                crate::config::Mode::Polling => "polling",
            },
            slot: v.slot.as_str().to_owned(),
            table: v.table.to_string(),
            postgres: v.pg.target(),
            metrics,
            health,
            state: Mutex::new((State::Running, None)),
        }
    }

    pub fn state(&self) -> (State, Option<String>) {
        self.state
            .lock()
            .map(|s| s.clone())
            .unwrap_or((State::Failed, None))
    }

    pub fn set_state(&self, state: State, error: Option<String>) {
        if let Ok(mut s) = self.state.lock() {
            *s = (state, error);
        }
    }

    /// Why this source is not ready; empty when it is.
    pub fn not_ready_reasons(&self) -> Vec<String> {
        match self.state() {
            (State::Running, _) => self.health.not_ready_reasons(),
            (State::Paused, _) => vec!["paused by an operator (POST /sources/<name>/resume)".to_owned()],
            (State::Stopping, _) => vec!["stopping".to_owned()],
            // A healthy member of the group: the source is another's.
            (State::Unassigned, _) => Vec::new(),
            (State::Failed, e) => vec![format!(
                "stopped on an error: {}",
                e.unwrap_or_else(|| "unknown".into())
            )],
        }
    }

    pub fn status(&self) -> SourceStatus {
        let (state, last_error) = self.state();
        let mut snapshot = self.health.snapshot();
        let reasons = self.not_ready_reasons();
        snapshot.ready = reasons.is_empty();
        snapshot.not_ready_reasons = reasons;
        SourceStatus {
            name: self.name.clone(),
            state: serde_json::to_value(state)
                .ok()
                .and_then(|v| v.as_str().map(str::to_owned))
                .unwrap_or_default(),
            required: self.required,
            mode: self.mode.to_owned(),
            slot: self.slot.clone(),
            table: self.table.clone(),
            postgres: self.postgres.clone(),
            last_error,
            snapshot,
        }
    }
}

/// Every source of the process, and the supervisor's inbox.
#[derive(Debug)]
pub struct Board {
    sources: RwLock<Vec<Arc<Source>>>,
    control: mpsc::Sender<Control>,
    /// The replicas' group, with `[coordination]`.
    coordination: RwLock<Option<Arc<crate::coordination::Board>>>,
}

impl Board {
    pub fn new(control: mpsc::Sender<Control>) -> Self {
        Board {
            sources: RwLock::new(Vec::new()),
            control,
            coordination: RwLock::new(None),
        }
    }

    /// The replicas' group this process is a member of, if any.
    pub fn coordination(&self) -> Option<crate::coordination::Status> {
        self.coordination
            .read()
            .ok()
            .and_then(|c| c.as_ref().map(|b| b.status()))
    }

    pub fn set_coordination(&self, board: Option<Arc<crate::coordination::Board>>) {
        if let Ok(mut c) = self.coordination.write() {
            *c = board;
        }
    }

    /// The sources, in the file's order.
    pub fn sources(&self) -> Vec<Arc<Source>> {
        self.sources.read().map(|s| s.clone()).unwrap_or_default()
    }

    pub fn get(&self, name: &str) -> Option<Arc<Source>> {
        self.sources().into_iter().find(|s| s.name == name)
    }

    /// Adds a source, or replaces the one of the same name in its place.
    pub fn put(&self, source: Arc<Source>) {
        if let Ok(mut all) = self.sources.write() {
            match all.iter_mut().find(|s| s.name == source.name) {
                Some(slot) => *slot = source,
                None => all.push(source),
            }
        }
    }

    pub fn remove(&self, name: &str) {
        if let Ok(mut all) = self.sources.write() {
            all.retain(|s| s.name != name);
        }
    }

    /// Orders the sources as `names` lists them.
    pub fn order(&self, names: &[String]) {
        if let Ok(mut all) = self.sources.write() {
            all.sort_by_key(|s| names.iter().position(|n| *n == s.name).unwrap_or(usize::MAX));
        }
    }

    /// Every metric of every source, one exposition; `outboxd_ready` is
    /// brought up to date first.
    pub fn metrics_text(&self) -> String {
        let sources = self.sources();
        for s in &sources {
            s.metrics.ready.set(i64::from(s.not_ready_reasons().is_empty()));
        }
        let mut text = crate::metrics::encode_all(sources.iter().map(|s| &*s.metrics));
        if let Some(c) = self.coordination.read().ok().and_then(|c| c.clone()) {
            text.push_str(&c.metrics_text());
        }
        text
    }

    /// Live when every running source's loop is.
    pub fn live(&self) -> Result<(), String> {
        let sources = self.sources();
        let one = sources.len() == 1;
        let mut why = Vec::new();
        for s in &sources {
            if s.state().0 != State::Running {
                continue;
            }
            if let Err(e) = s.health.live() {
                why.push(if one { e } else { format!("{}: {e}", s.name) });
            }
        }
        if why.is_empty() {
            Ok(())
        } else {
            Err(why.join("; "))
        }
    }

    /// Readiness: `Ok(lines)` when every required source is ready (the
    /// lines name what is degraded or not ready among the others), else
    /// `Err` with every reason. One source reads as before sources existed.
    pub fn readiness(&self) -> Result<Vec<String>, Vec<String>> {
        let sources = self.sources();
        let one = sources.len() == 1;
        let mut failing = Vec::new();
        let mut notes = Vec::new();
        for s in &sources {
            let reasons = s.not_ready_reasons();
            let name = |r: &str| {
                if one {
                    r.to_owned()
                } else {
                    format!("{}: {r}", s.name)
                }
            };
            // With several sources and two replicas, leadership may split
            // (one replica leads some slots, the other the rest): a source
            // standing by for another replica fails neither pod. Alone, a
            // standby is not ready, as before.
            let standing_by = !one && s.state().0 == State::Running && s.health.snapshot().standby;
            if s.state().0 == State::Unassigned {
                notes.push(name(
                    "unassigned: the replicas' group assigns it to another replica",
                ));
            } else if standing_by {
                notes.push(name("standby: another outboxd leads this slot"));
            } else if reasons.is_empty() {
                notes.extend(s.health.degraded_reasons().iter().map(|r| name(r)));
            } else if s.required {
                failing.extend(reasons.iter().map(|r| name(r)));
            } else {
                notes.extend(
                    reasons
                        .iter()
                        .map(|r| name(&format!("not ready (not required): {r}"))),
                );
            }
        }
        if sources.is_empty() {
            failing.push("no source is configured".to_owned());
        }
        if let Some(c) = self.coordination() {
            failing.extend(c.not_ready_reasons());
        }
        if failing.is_empty() {
            Ok(notes)
        } else {
            Err(failing)
        }
    }

    /// Sends a verb to the supervisor and waits for its answer.
    pub async fn control(&self, source: &str, verb: Verb) -> Result<(), ControlError> {
        let (reply, answer) = oneshot::channel();
        let sent = self.control.send(Control {
            source: source.to_owned(),
            verb,
            reply,
        });
        sent.await.map_err(|_| ControlError::Stopping)?;
        answer.await.map_err(|_| ControlError::Stopping)?
    }
}
