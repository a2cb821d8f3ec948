//! `outboxd replay`: re-publishes outbox rows from the table.
//!
//! For when the WAL cannot deliver them (a lost or invalidated slot, Kafka
//! data lost) or a new consumer needs history. The relay's slot is never
//! touched, so a replay may run while the relay streams: the relay's
//! guarantees are its own, and a replayed record is one more copy of an
//! event consumers deduplicate by id.
//!
//! # The flow
//!
//! 1. [`select`] lists the ids of the selection in replay order (commit
//!    time where PostgreSQL knows it, else `created_at`, then id); with
//!    `--resume`, only the rows after the state file's last one.
//! 2. Batch by batch, the rows are read by id and each becomes the record
//!    the relay would have produced (same topic, key, headers and value,
//!    the **original** id), plus a `replayed` header holding the time the
//!    replay started. A row that can never be published follows
//!    `routing.on_poison`, as in the relay.
//! 3. Records are handed to an idempotent producer (never the relay's
//!    transactional one), throttled by `--rate`. Acknowledgements are
//!    taken in replay order; the batch's acknowledged prefix moves the
//!    state file's `last` ([`state`]). The first failed delivery stops the
//!    replay there, with the state saved: `--resume` repeats from the
//!    first unacknowledged row, so nothing is skipped.
//! 4. SIGINT or SIGTERM stops sending, waits for what is in flight, saves
//!    the state and prints the command that resumes.
//!
//! Records of one aggregate keep replay order: they share a key, hence a
//! partition, and the idempotent producer keeps a partition's order across
//! retries.

pub mod pace;
pub mod select;
pub mod state;

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::config::{Config, Mode, Validated};
use crate::kafka::enqueue::{enqueue_row, set_aside, set_aside_as_stub, EnqueueError, Enqueued};
use crate::kafka::records::{build_record, header, KafkaRecord, RecordError};
use crate::kafka::sink::{KafkaSink, KafkaSinkError, Refusal, Report};
use crate::postgres::admin::{self, AdminError};
use crate::shell::shell_word;
use pace::{Progress, Throttle};
use select::{Count, Key, Order, Query, ReplayRow, Selection};

use state::{Counts, State, StateError, StateFile};

/// What to replay and how.
#[derive(Clone, Debug)]
pub struct Options {
    pub selection: Selection,
    /// Replay the whole table (required when nothing narrows the selection).
    pub all: bool,
    /// Count only; publish nothing.
    pub dry_run: bool,
    /// Records a second, at most.
    pub rate: Option<f64>,
    /// Rows read and acknowledged per batch.
    pub batch: usize,
    pub state: PathBuf,
    pub resume: bool,
}

/// Why a replay stopped before the end.
#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    #[error("nothing selects the rows to replay: give --since, --until, --aggregate-type, --aggregate-id or --id, or --all for the whole table")]
    NothingSelected,
    #[error(transparent)]
    Admin(#[from] AdminError),
    #[error(transparent)]
    State(#[from] StateError),
    #[error(transparent)]
    Kafka(#[from] KafkaSinkError),
    #[error(transparent)]
    Poison(EnqueueError),
    #[error("{0}; the replay stopped there")]
    Schema(crate::schema::SchemaError),
    #[error("schema_registry: {0}")]
    RegistrySetup(String),
    #[error("Kafka did not acknowledge the record of outbox row {id}: {source}; the replay stopped there")]
    Delivery { id: String, source: KafkaSinkError },
    #[error("rows of the selection share the id {0:?}: a replay reads rows by their id (columns.id), so it replays only a table whose ids are unique; nothing was published")]
    DuplicateId(String),
    #[error("--since and --until compare with commit times or the timestamp column, and this table has no timestamp column (columns.timestamp) while track_commit_timestamp is off: select by --aggregate-type, --aggregate-id or --id, or --all")]
    NoTimeToSelectBy,
}

impl From<EnqueueError> for ReplayError {
    fn from(e: EnqueueError) -> Self {
        match e {
            EnqueueError::Kafka(k) => ReplayError::Kafka(k),
            poison @ EnqueueError::Poison { .. } => ReplayError::Poison(poison),
        }
    }
}

/// How a replay ended.
#[derive(Debug)]
pub enum Outcome {
    /// `--dry-run`: what would be replayed.
    DryRun { counts: Vec<Count>, order: Order },
    /// Every selected row is accounted for.
    Finished(Summary),
    /// Stopped by a signal, with the state saved.
    Interrupted(Summary),
}

/// What a replay did, for the summary it prints.
#[derive(Clone, Debug)]
pub struct Summary {
    /// Rows selected by this run (after the resumed position).
    pub selected: u64,
    /// Counts over every run of this replay (resumed runs included).
    pub counts: Counts,
    /// Counts of this run alone.
    pub this_run: Counts,
    pub elapsed: Duration,
    pub order: Order,
    pub last: Option<Key>,
}

impl std::fmt::Display for Summary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let secs = self.elapsed.as_secs_f64();
        let run = &self.this_run;
        writeln!(
            f,
            "selected     {} rows, ordered by {}",
            self.selected, self.order
        )?;
        writeln!(
            f,
            "published    {} ({:.0}/s over {secs:.1} s)",
            run.published,
            run.published as f64 / secs.max(0.001)
        )?;
        writeln!(f, "dead-letter  {}", run.dead_lettered)?;
        writeln!(f, "gone         {} (deleted before they were read)", run.gone)?;
        if self.counts != self.this_run {
            writeln!(
                f,
                "all runs     {} published, {} dead-lettered, {} gone",
                self.counts.published, self.counts.dead_lettered, self.counts.gone
            )?;
        }
        match &self.last {
            Some(k) => write!(f, "last         {} (order time {})", k.id, k.order_time),
            None => write!(f, "last         none"),
        }
    }
}

/// Aborts a background task when dropped.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// One replay.
#[derive(Debug)]
pub struct Replay {
    config: Config,
    validated: Validated,
    options: Options,
}

impl Replay {
    pub fn new(config: Config, validated: Validated, options: Options) -> Self {
        Replay {
            config,
            validated,
            options,
        }
    }

    /// The command that resumes this replay, when its state file holds an
    /// unfinished one.
    pub fn resumable(&self) -> Option<String> {
        match StateFile::new(&self.options.state).load() {
            Ok(Some(s)) if !s.finished => Some(self.resume_command()),
            _ => None,
        }
    }

    /// The command that resumes this replay.
    pub fn resume_command(&self) -> String {
        format!(
            "outboxd replay {} --state {} --resume",
            self.validated.config_args(),
            shell_word(&self.options.state.display().to_string())
        )
    }

    /// Runs until every selected row is handled, an error, or `stop`.
    pub async fn run(&self, stop: Arc<AtomicBool>) -> Result<Outcome, ReplayError> {
        let o = &self.options;
        if !o.resume && !o.all && !o.selection.is_narrowed() {
            return Err(ReplayError::NothingSelected);
        }
        let mut client = admin::connect(&self.validated.pg).await?;
        let query = Query::prepare(
            &client,
            &self.validated.table,
            &self.validated.columns,
            self.config.mode == Mode::Cdc,
        )
        .await?;
        let by_time = o.selection.since.is_some() || o.selection.until.is_some();
        if by_time && !query.order().places_rows_in_time() {
            return Err(ReplayError::NoTimeToSelectBy);
        }
        let file = StateFile::new(&o.state);
        let started_at = chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Millis, true);
        let fresh = State::new(o.selection.clone(), started_at);
        let mut state = if o.dry_run && !o.resume {
            fresh
        } else {
            file.open(o.resume, fresh)?
        };
        if o.dry_run {
            let counts = query
                .counts(&client, &state.selection, state.last.as_ref())
                .await?;
            return Ok(Outcome::DryRun {
                counts,
                order: query.order(),
            });
        }
        let mut ids = query.ids(&client, &state.selection, state.last.as_ref()).await?;
        unique(&ids).map_err(|e| *e)?;
        let selected = ids.len() as u64;
        let mut sink = KafkaSink::new(&self.config.kafka, self.config.kafka.admin_timeout.0)?;
        sink.check_brokers().await?;
        file.save(&state)?;
        let run_start = Instant::now();
        let before = state.counts;
        let mut throttle = Throttle::new(o.rate);
        let mut progress = Progress::new(selected);
        let mut interrupted = false;
        let mut failure: Option<ReplayError> = None;
        // After Kafka refused a batch: rows go one at a time, each waiting
        // for its answer, up to and including this one, so that a refusal
        // is the row's own (see `crate::relay::polling`, the same rule).
        let mut isolate_until: Option<String> = None;
        let mut registry =
            crate::schema::Registry::from_config(&self.config, None).map_err(ReplayError::RegistrySetup)?;
        // Ctrl-C ends a wait for an unreachable registry too.
        let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
        let watcher = {
            let stop = stop.clone();
            tokio::spawn(async move {
                while !stop.load(Ordering::Relaxed) {
                    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                }
                let _ = stop_tx.send(true);
            })
        };
        let _watcher = AbortOnDrop(watcher);
        if let Some(r) = registry.as_mut() {
            r.stop_on(stop_rx);
        }
        'runs: loop {
            let mut refused_batch = None;
            for chunk in ids.chunks(o.batch.max(1)) {
                let mut rows = query.rows(&mut client, chunk).await?;
                // In replay order: each row and what was enqueued for it,
                // or `None` for a row deleted since it was listed.
                let mut pending: Vec<Option<(ReplayRow, Enqueued)>> = Vec::with_capacity(chunk.len());
                let mut settled = Settled::default();
                for id in chunk {
                    if stop.load(Ordering::Relaxed) {
                        interrupted = true;
                        break;
                    }
                    let Some(r) = rows.remove(id) else {
                        pending.push(None);
                        continue;
                    };
                    throttle.admit().await;
                    let mut record = self.record(&r, &state.started_at);
                    if let Some(registry) = registry.as_mut() {
                        let commit_ms = r
                            .commit_ms
                            .unwrap_or_else(|| chrono::Utc::now().timestamp_millis());
                        match registry.prepare(record, &r.row, commit_ms).await {
                            Ok(built) => record = built,
                            Err(crate::schema::SchemaError::Interrupted) => {
                                interrupted = true;
                                break;
                            }
                            Err(e) => {
                                failure = Some(ReplayError::Schema(e));
                                break;
                            }
                        }
                    }
                    match enqueue_row(&mut sink, &self.config.routing, &r.row, record).await {
                        Ok(e) => pending.push(Some((r, e))),
                        Err(e) => {
                            failure = Some(e.into());
                            break;
                        }
                    }
                    if let Some(until) = isolate_until.clone() {
                        self.settle(&mut sink, &mut pending, &mut state, &mut settled, true)
                            .await;
                        if settled.last_id == Some(until) {
                            isolate_until = None;
                        }
                        if settled.stopped() {
                            break;
                        }
                    }
                    progress.update(state.counts.done() - before.done() + pending.len() as u64);
                }
                self.settle(&mut sink, &mut pending, &mut state, &mut settled, false)
                    .await;
                file.save(&state)?;
                if let Some(e) = settled.failure {
                    failure.get_or_insert(e);
                }
                refused_batch = settled.refused_batch;
                if failure.is_some() || interrupted || refused_batch.is_some() {
                    break;
                }
            }
            match refused_batch {
                Some(id) if failure.is_none() && !interrupted => {
                    tracing::warn!(%id, "Kafka refused a batch; sending the rows from there one at a time, to set aside only the row Kafka refuses");
                    isolate_until = Some(id);
                    ids = query.ids(&client, &state.selection, state.last.as_ref()).await?;
                    unique(&ids).map_err(|e| *e)?;
                }
                _ => break 'runs,
            }
        }
        progress.finish(state.counts.done() - before.done());
        let this_run = Counts {
            published: state.counts.published - before.published,
            dead_lettered: state.counts.dead_lettered - before.dead_lettered,
            gone: state.counts.gone - before.gone,
        };
        if let Some(e) = failure {
            return Err(e);
        }
        if !interrupted {
            state.finished = true;
            file.save(&state)?;
        }
        let summary = Summary {
            selected,
            counts: state.counts,
            this_run,
            elapsed: run_start.elapsed(),
            order: query.order(),
            last: state.last,
        };
        Ok(if interrupted {
            Outcome::Interrupted(summary)
        } else {
            Outcome::Finished(summary)
        })
    }

    /// Takes the acknowledgements of `pending` in order: each acknowledged
    /// row moves `state.last`; after the first failure none does (resuming
    /// repeats them). `alone`: the rows were sent one at a time, so a
    /// refusal is the row's own, and follows `routing.on_poison`.
    async fn settle(
        &self,
        sink: &mut KafkaSink,
        pending: &mut Vec<Option<(ReplayRow, Enqueued)>>,
        state: &mut State,
        settled: &mut Settled,
        alone: bool,
    ) {
        for entry in pending.drain(..) {
            let Some((r, enqueued)) = entry else {
                if !settled.stopped() {
                    state.counts.gone += 1;
                }
                continue;
            };
            let mut dead = match &enqueued {
                Enqueued::DeadLetter(_, reason) => Some(*reason),
                Enqueued::Record(_) => None,
            };
            let mut report = enqueued.into_future().await;
            if settled.stopped() {
                continue;
            }
            if let Report::Failed(source, _) = &report {
                if let (Refusal::Record { reason, .. }, None) = (Refusal::of(source), dead) {
                    if !alone {
                        settled.refused_batch = Some(r.key.id.clone());
                        continue;
                    }
                    let error = format!("Kafka refused it: {source}");
                    match set_aside(sink, &self.config.routing, &r.row, reason, error).await {
                        Ok(dl) => {
                            dead = Some(reason);
                            report = dl.into_future().await;
                        }
                        Err(e) => {
                            settled.failure = Some(e.into());
                            continue;
                        }
                    }
                }
            }
            // A dead letter refused in its turn (the row's headers travel
            // with it): its stub, once the refusal is its own.
            let refused_dead_letter = match (&report, dead) {
                (Report::Failed(source, _), Some(reason))
                    if matches!(Refusal::of(source), Refusal::Record { .. }) =>
                {
                    Some((reason, source.to_string()))
                }
                _ => None,
            };
            if let Some((reason, refused)) = refused_dead_letter {
                if !alone {
                    settled.refused_batch = Some(r.key.id.clone());
                    continue;
                }
                let error = format!("its dead letter was refused: {refused}");
                match set_aside_as_stub(sink, &self.config.routing, &r.row, reason, error, &refused).await {
                    Ok(stub) => report = stub.into_future().await,
                    Err(e) => {
                        settled.failure = Some(e.into());
                        continue;
                    }
                }
            }
            match report.into_result() {
                Ok(_) => {
                    if dead.is_some() {
                        state.counts.dead_lettered += 1;
                    } else {
                        state.counts.published += 1;
                    }
                    settled.last_id = Some(r.key.id.clone());
                    state.last = Some(r.key);
                }
                Err(source) => {
                    settled.failure = Some(ReplayError::Delivery { id: r.key.id, source });
                }
            }
        }
    }

    /// The record the relay would have produced, marked as replayed.
    fn record(&self, r: &ReplayRow, started_at: &str) -> Result<KafkaRecord, RecordError> {
        let commit_ms = r
            .commit_ms
            .or_else(|| r.row.created_at.rfc3339().map(chrono::DateTime::timestamp_millis))
            .unwrap_or_else(|| chrono::Utc::now().timestamp_millis());
        // A row without a timestamp takes the commit time, or the time of
        // the replay (`commit_ms` above).
        let mut rec = build_record(&r.row, &self.validated.topic, &self.validated.value, commit_ms)?;
        rec.headers.retain(|(k, _)| k != header::REPLAYED);
        rec.headers
            .push((header::REPLAYED.into(), started_at.as_bytes().to_vec()));
        Ok(rec)
    }
}

/// Refuses a selection in which two rows share an id: rows are read by
/// id, and one of them would be replayed twice and the other never.
fn unique(ids: &[String]) -> Result<(), Box<ReplayError>> {
    let mut seen = std::collections::HashSet::with_capacity(ids.len());
    match ids.iter().find(|id| !seen.insert(id.as_str())) {
        Some(id) => Err(Box::new(ReplayError::DuplicateId(id.clone()))),
        None => Ok(()),
    }
}

/// What settling a batch's acknowledgements found.
#[derive(Debug, Default)]
struct Settled {
    /// The last row acknowledged (or set aside).
    last_id: Option<String>,
    /// Kafka refused the batch holding this row.
    refused_batch: Option<String>,
    failure: Option<ReplayError>,
}

impl Settled {
    fn stopped(&self) -> bool {
        self.refused_batch.is_some() || self.failure.is_some()
    }
}
