//! The replay's state file: what it selected and how far Kafka has
//! acknowledged it, so that an interrupted replay resumes where it stopped.
//!
//! The file is rewritten (to a temporary file, then renamed over the old
//! one) after every batch whose records Kafka acknowledged, and when the
//! replay stops for any reason. `last` only ever names a row whose record,
//! and every record before it, Kafka acknowledged; resuming re-selects
//! the rows after it, so an interruption can only repeat records, never
//! skip one.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::select::{Key, Selection};

/// The state file's format version.
pub const STATE_VERSION: u32 = 1;

/// Why the state file cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum StateError {
    #[error("cannot read the replay state file {path}: {source}")]
    Read { path: String, source: std::io::Error },
    #[error("cannot write the replay state file {path}: {source}; pass --state with a writable path")]
    Write { path: String, source: std::io::Error },
    #[error("{path} is not a replay state file this outboxd can resume: {reason}")]
    Malformed { path: String, reason: String },
    #[error("{path} holds an unfinished replay ({done} rows done); continue it with --resume, or pass --state with another path")]
    Unfinished { path: String, done: u64 },
    #[error("--resume continues the selection stored in {path}; leave out --since, --until, --aggregate-type, --aggregate-id and --id")]
    SelectionWithResume { path: String },
}

/// Counts of what a replay did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Counts {
    /// Records Kafka acknowledged.
    pub published: u64,
    /// Rows that can never be published, whose dead letters Kafka
    /// acknowledged.
    pub dead_lettered: u64,
    /// Rows selected but deleted before they were read (retention).
    pub gone: u64,
}

impl Counts {
    pub fn done(&self) -> u64 {
        self.published + self.dead_lettered + self.gone
    }
}

/// The state file's content.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct State {
    pub version: u32,
    pub selection: Selection,
    /// The `replayed` header's value: when the replay first started.
    pub started_at: String,
    /// The last row acknowledged, in replay order.
    pub last: Option<Key>,
    pub counts: Counts,
    pub finished: bool,
}

impl State {
    pub fn new(selection: Selection, started_at: String) -> Self {
        State {
            version: STATE_VERSION,
            selection,
            started_at,
            last: None,
            counts: Counts::default(),
            finished: false,
        }
    }
}

/// A state file on disk.
#[derive(Debug)]
pub struct StateFile {
    path: PathBuf,
}

impl StateFile {
    pub fn new(path: &Path) -> Self {
        StateFile {
            path: path.to_owned(),
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    fn name(&self) -> String {
        self.path.display().to_string()
    }

    /// The stored state, if the file exists.
    pub fn load(&self) -> Result<Option<State>, StateError> {
        let bytes = match std::fs::read(&self.path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(source) => {
                return Err(StateError::Read {
                    path: self.name(),
                    source,
                })
            }
        };
        let state: State = serde_json::from_slice(&bytes).map_err(|e| StateError::Malformed {
            path: self.name(),
            reason: e.to_string(),
        })?;
        if state.version != STATE_VERSION {
            return Err(StateError::Malformed {
                path: self.name(),
                reason: format!("version {} (this outboxd writes {STATE_VERSION})", state.version),
            });
        }
        Ok(Some(state))
    }

    /// The state to start from: a new one, or with `resume` the stored one.
    /// A new replay never overwrites an unfinished one.
    pub fn open(&self, resume: bool, fresh: State) -> Result<State, StateError> {
        let stored = self.load()?;
        if resume {
            if fresh.selection.is_narrowed() {
                return Err(StateError::SelectionWithResume { path: self.name() });
            }
            return stored.ok_or_else(|| StateError::Read {
                path: self.name(),
                source: std::io::Error::new(std::io::ErrorKind::NotFound, "no replay to resume"),
            });
        }
        match stored {
            Some(s) if !s.finished => Err(StateError::Unfinished {
                path: self.name(),
                done: s.counts.done(),
            }),
            _ => Ok(fresh),
        }
    }

    /// Writes the state atomically (temporary file, then rename).
    pub fn save(&self, state: &State) -> Result<(), StateError> {
        let write = |source| StateError::Write {
            path: self.name(),
            source,
        };
        let mut tmp = self.path.clone().into_os_string();
        tmp.push(".tmp");
        let bytes = serde_json::to_vec_pretty(state).map_err(|e| write(std::io::Error::other(e)))?;
        std::fs::write(&tmp, bytes).map_err(write)?;
        std::fs::rename(&tmp, &self.path).map_err(write)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_state_round_trips_and_an_unfinished_one_is_never_overwritten() {
        let dir = tempfile::tempdir().unwrap();
        let file = StateFile::new(&dir.path().join("r.json"));
        let sel = Selection {
            aggregate_types: vec!["Order".into()],
            ..Selection::default()
        };
        let mut s = State::new(sel.clone(), "2026-12-01T00:00:00Z".into());
        assert_eq!(file.open(false, s.clone()).unwrap(), s);
        s.counts.published = 3;
        s.last = Some(Key {
            order_time: "2026-12-01 00:00:00+00".into(),
            created_at: "2026-12-01 00:00:00+00".into(),
            id: uuid::Uuid::nil().to_string(),
        });
        file.save(&s).unwrap();
        assert_eq!(file.load().unwrap(), Some(s.clone()));
        let other = State::new(Selection::default(), "later".into());
        assert!(matches!(
            file.open(false, other.clone()),
            Err(StateError::Unfinished { done: 3, .. })
        ));
        assert!(matches!(
            file.open(true, State::new(sel, "x".into())),
            Err(StateError::SelectionWithResume { .. })
        ));
        assert_eq!(file.open(true, other.clone()).unwrap(), s);
        s.finished = true;
        file.save(&s).unwrap();
        assert_eq!(file.open(false, other.clone()).unwrap(), other);
    }
}
