//! The supervisor: every source of the file as a relay of its own.
//!
//! # Isolation
//!
//! Each source ([`crate::config::sources`]) runs as one task holding one
//! [`Relay`] (or [`PollingRelay`]): its own replication connection, leader
//! lock, publication guard, slot register record, backoff, parking store,
//! metrics (labelled `source`) and health. Nothing of one source waits on
//! another, so a source whose database is down keeps reconnecting with its
//! own backoff while the others stream; LSN progress is per slot and each
//! relay confirms only what Kafka acknowledged for it.
//!
//! The Kafka clients are the process's ([`KafkaClients`]): at-least-once
//! sources send through one shared producer, each session on a lane of its
//! own with its own in-flight budget, and a delivery that fails costs the
//! other sources only a re-send of their unsent records, in order
//! ([`crate::kafka::delivery`]). Exactly-once sources keep their
//! transactional producers.
//!
//! # Lifecycle
//!
//! The supervisor's loop owns the tasks, and changes them on:
//!
//! * **a source's end**: a relay that returns an error a retry will not
//!   fix marks its source `failed` with that error; the others go on.
//!   When no source is left running or paused, outboxd exits with failure,
//!   as it did with one source;
//! * **SIGHUP**: the file is read and validated again. A file that fails
//!   changes nothing (the error is logged). Otherwise sources are matched by
//!   name: added ones start, removed ones drain and stop, changed ones
//!   (another fingerprint of their merged settings) drain and start again,
//!   the others are untouched. Shared settings that only a restart can
//!   apply (`http.listen`, `log`) are named in a warning;
//! * **an operator's verb** ([`crate::ops::board::Control`]): pause drains
//!   the relay through its shutdown path (every acknowledged LSN is
//!   confirmed) and leaves the slot unstreamed, so its WAL is kept and its
//!   lag shows; resume starts it again; restart drains and starts it (a
//!   failed source too). These change the running state only;
//! * **SIGTERM / Ctrl-C**: every source drains at once, then outboxd exits.
//!   Shutdown is heard at every moment, also while a reload, a pause or a
//!   restart waits for a drain: the sources still running are stopped at
//!   once, the drains already under way go on under the same deadline, and
//!   nothing starts again.
//!
//! A stopping relay is drained before anything else starts on its slot, so
//! two relays of one source never overlap.
//!
//! # Replicas
//!
//! With `[coordination]` and more than one source, the supervisor starts no
//! source by itself: every source begins `unassigned`, and the replicas'
//! group ([`crate::coordination`]) says which ones this replica leads. An
//! assignment starts them; a revoke drains them (as a pause does) and
//! leaves them `unassigned`, and only then is the revoke answered, so the
//! group hands a source to its next replica once it is drained here. A
//! reload that changes the set of sources, their weights or the section
//! drains every source, leaves the group and joins the new one. Verbs act
//! on this replica's sources only.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use futures::stream::{FuturesUnordered, StreamExt};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tracing::Instrument;

use crate::config::sources::SourceConfig;
use crate::config::{Config, Mode};
use crate::coordination::{self, Class, Coordinator};
use crate::kafka::clients::KafkaClients;
use crate::metrics::Metrics;
use crate::ops::board::{Board, Control, ControlError, Source, State, Verb};
use crate::ops::health::Health;
use crate::relay::polling::PollingRelay;
use crate::relay::Relay;

/// How the process ends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ending {
    /// Asked to stop; every source drained.
    Stopped,
    /// Every source stopped on an error that a restart will not fix.
    Failed,
}

/// A relay that runs.
#[derive(Debug)]
struct Task {
    stop: watch::Sender<bool>,
    join: JoinHandle<()>,
    generation: u64,
}

/// Sends a relay's end once: with its result, or on a panic (dropped
/// without sending) as a failure.
struct ExitGuard {
    exits: mpsc::UnboundedSender<Exit>,
    name: Option<String>,
    generation: u64,
}

impl ExitGuard {
    fn send(mut self, result: Result<(), String>) {
        if let Some(name) = self.name.take() {
            let _ = self.exits.send(Exit {
                name,
                generation: self.generation,
                result,
            });
        }
    }
}

impl Drop for ExitGuard {
    fn drop(&mut self) {
        if let Some(name) = self.name.take() {
            let _ = self.exits.send(Exit {
                name,
                generation: self.generation,
                result: Err("the relay panicked (a bug: please report it with the log)".into()),
            });
        }
    }
}

/// How a wait for drains ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Drained {
    Done,
    /// Shutdown was requested meanwhile: every source was stopped.
    Interrupted,
}

/// A relay's end, as its task reports it.
#[derive(Debug)]
struct Exit {
    name: String,
    generation: u64,
    result: Result<(), String>,
}

/// The sources and their tasks.
#[derive(Debug)]
pub struct Supervisor {
    /// The file, read again on SIGHUP (`None`: no reload).
    path: Option<PathBuf>,
    /// `run --source NAME`: the one source of the file this process runs,
    /// at start and after every reload.
    only: Option<String>,
    /// SIGHUP, registered before anything starts (its default action would
    /// end the process).
    hangup: Option<tokio::signal::unix::Signal>,
    /// The slot watchers of paused and failed sources: their retained WAL
    /// and lag stay current while no relay streams.
    watchers: HashMap<String, JoinHandle<()>>,
    board: Arc<Board>,
    configs: HashMap<String, SourceConfig>,
    tasks: HashMap<String, Task>,
    generation: u64,
    exits_tx: mpsc::UnboundedSender<Exit>,
    exits: mpsc::UnboundedReceiver<Exit>,
    control: mpsc::Receiver<Control>,
    /// The Kafka clients every source shares (see [`crate::kafka::clients`]).
    kafka: Arc<KafkaClients>,
    /// Shutdown, as `run` was given it: waits for drains listen to it.
    shutdown: Option<watch::Receiver<bool>>,
    /// `[coordination]`: the group's consumers, what they decide, and the
    /// sources the group assigns this replica.
    coordinator: Option<Coordinator>,
    group_events: Option<mpsc::UnboundedReceiver<coordination::Event>>,
    /// The plan the coordinator runs: its settings and classes.
    plan: Option<Plan>,
    assigned: std::collections::HashSet<String>,
    /// Sources assigned in the group's first moments, started once the
    /// group has settled (replicas started together join one by one).
    settling: Settling,
    /// Sources still streaming here after the replica lost its place in
    /// the group (its session expired while their leases stayed fresh):
    /// the group's next assignment of their weight says whether they stay.
    orphans: std::collections::BTreeSet<String>,
}

/// The first assignment after joining waits a little: replicas started
/// together join one after another, and the first to join is assigned
/// every source until the others arrive. Starting them at once would start
/// and drain most of them again within seconds.
#[derive(Debug, Default)]
struct Settling {
    /// Set at the first assignment: until then, sources wait.
    until: Option<tokio::time::Instant>,
    waiting: std::collections::BTreeSet<String>,
    done: bool,
    /// The replica lost its session: the first assignment after it is
    /// only the group's first round (sources another replica holds come
    /// in the next one), so the orphans are judged once it has settled.
    after_lost: bool,
}

/// What a coordinator is started with; a reload that changes it joins the
/// group anew.
#[derive(Debug, Clone)]
struct Plan {
    settings: coordination::Settings,
    classes: Vec<Class>,
}

impl Plan {
    /// The plan of `sources`, or `None` when each replica tries every
    /// source: no `[coordination]`, or a single source (a standby takes it
    /// over faster by its lease alone).
    fn of(sources: &[&SourceConfig]) -> Option<Plan> {
        let first = sources.first()?;
        let config = first.config.coordination.clone()?;
        if sources.len() < 2 {
            tracing::info!("[coordination] is ignored for a single source: replicas stand by for its lease, as without it");
            return None;
        }
        let named: Vec<(String, u32)> = sources.iter().map(|s| (s.name.clone(), s.weight)).collect();
        let classes = coordination::classes(&config.group, &named);
        Some(Plan {
            settings: coordination::Settings {
                config,
                kafka: first.config.kafka.clone(),
                drain_bound: drain_bound(sources.iter().copied()),
            },
            classes,
        })
    }

    fn same(a: Option<&Plan>, b: Option<&Plan>) -> bool {
        match (a, b) {
            (None, None) => true,
            (Some(a), Some(b)) => {
                a.classes == b.classes
                    && a.settings.config == b.settings.config
                    && a.settings.drain_bound == b.settings.drain_bound
                    && a.settings.kafka.brokers == b.settings.kafka.brokers
                    && a.settings.kafka.options == b.settings.kafka.options
            }
            _ => false,
        }
    }
}

/// How long a drain of `sources` may take: the longest
/// `shutdown.drain_timeout`, and a margin for a set-up step that ignores
/// the stop (a connect).
fn drain_bound<'a>(sources: impl Iterator<Item = &'a SourceConfig>) -> Duration {
    sources
        .map(|c| c.config.shutdown.drain_timeout.0)
        .max()
        .unwrap_or(Duration::from_secs(30))
        + Duration::from_secs(30)
}

/// The supervisor could not set a source up.
#[derive(Debug, thiserror::Error)]
#[error("cannot set up the metrics of source {name:?}: {source}")]
pub struct SetupError {
    name: String,
    source: prometheus::Error,
}

impl Supervisor {
    /// A supervisor for `sources` (of the file `path`, of which it runs
    /// only the source `only` when set), and the board the HTTP server
    /// reads. Registers SIGHUP at once.
    pub fn new(
        path: Option<PathBuf>,
        only: Option<String>,
        sources: Vec<SourceConfig>,
    ) -> Result<(Self, Arc<Board>), SetupError> {
        let (control_tx, control) = mpsc::channel(16);
        let board = Arc::new(Board::new(control_tx));
        let (exits_tx, exits) = mpsc::unbounded_channel();
        let hangup = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()) {
            Ok(s) => Some(s),
            Err(e) => {
                tracing::warn!(error = %e, "cannot listen for SIGHUP; the config file is not reloaded");
                None
            }
        };
        let mut supervisor = Supervisor {
            path,
            only,
            hangup,
            watchers: HashMap::new(),
            board: board.clone(),
            configs: HashMap::new(),
            tasks: HashMap::new(),
            generation: 0,
            exits_tx,
            exits,
            control,
            kafka: KafkaClients::new(),
            shutdown: None,
            coordinator: None,
            group_events: None,
            plan: None,
            assigned: std::collections::HashSet::new(),
            settling: Settling::default(),
            orphans: std::collections::BTreeSet::new(),
        };
        for s in sources {
            supervisor.add(s, None)?;
        }
        Ok((supervisor, board))
    }

    /// Puts a source on the board (keeping `metrics` of an earlier
    /// version of it, so its counters go on).
    fn add(&mut self, config: SourceConfig, metrics: Option<Arc<Metrics>>) -> Result<(), SetupError> {
        let metrics = match metrics {
            Some(m) => m,
            None => Arc::new(Metrics::for_source(&config.name).map_err(|source| SetupError {
                name: config.name.clone(),
                source,
            })?),
        };
        let health = Arc::new(Health::new(config.config.health.thresholds()));
        self.board.put(Arc::new(Source::new(&config, metrics, health)));
        self.configs.insert(config.name.clone(), config);
        Ok(())
    }

    /// Starts every source, then runs until `stop` or until no source is
    /// left running or paused.
    pub async fn run(mut self, mut stop: watch::Receiver<bool>) -> Ending {
        self.shutdown = Some(stop.clone());
        let names: Vec<String> = self.board.sources().iter().map(|s| s.name.clone()).collect();
        let plan = Plan::of(&self.configs.values().collect::<Vec<_>>());
        match plan {
            Some(plan) => self.join_group(plan),
            None => {
                for name in &names {
                    self.start(name);
                }
            }
        }
        let mut hangup = self.hangup.take();
        loop {
            // Shutdown heard inside a drain (a pause, a restart, a reload).
            if *stop.borrow() {
                break;
            }
            if self.nothing_left() {
                // The others need not wait a session timeout for this
                // replica's share.
                self.leave_group().await;
                return Ending::Failed;
            }
            tokio::select! {
                // Shutdown first: no verb starts a source after it.
                biased;
                _ = stop.changed() => break,
                Some(exit) = self.exits.recv() => self.ended(exit),
                Some(c) = self.control.recv() => {
                    let outcome = self.apply(&c.source, c.verb).await;
                    let _ = c.reply.send(outcome);
                }
                Some(()) = async { match hangup.as_mut() { Some(h) => h.recv().await, None => None } } => {
                    self.reload().await;
                }
                Some(event) = async { match self.group_events.as_mut() { Some(e) => e.recv().await, None => None } } => {
                    self.on_group(event).await;
                }
                () = async { match self.settling.until { Some(t) => tokio::time::sleep_until(t).await, None => std::future::pending().await } } => {
                    self.settled().await;
                }
            }
        }
        let all: Vec<String> = self.tasks.keys().cloned().collect();
        self.stop_all(&all, State::Stopping).await;
        // Drained: the group may hand every source to the others now.
        self.leave_group().await;
        for (_, w) in self.watchers.drain() {
            w.abort();
        }
        Ending::Stopped
    }

    /// Joins the replicas' group: every source waits unassigned.
    fn join_group(&mut self, plan: Plan) {
        for source in self.board.sources() {
            self.unwatch(&source.name);
            source.set_state(State::Unassigned, None);
            source.metrics.assigned.set(0);
        }
        let (events_tx, events) = mpsc::unbounded_channel();
        let coordinator = Coordinator::spawn(&plan.settings, plan.classes.clone(), events_tx);
        self.board.set_coordination(Some(coordinator.board()));
        tracing::info!(
            group = %plan.settings.config.group,
            replica = %plan.settings.config.replica_name(),
            "sources are spread over the replicas of group {}: each starts when the group assigns it here",
            plan.settings.config.group
        );
        self.coordinator = Some(coordinator);
        self.group_events = Some(events);
        self.plan = Some(plan);
        self.assigned.clear();
        self.settling = Settling::default();
    }

    /// The group has settled: the sources assigned meanwhile start, and
    /// orphans it did not give back to this replica drain.
    async fn settled(&mut self) {
        self.settling.until = None;
        self.settling.done = true;
        self.settling.after_lost = false;
        let waiting = std::mem::take(&mut self.settling.waiting);
        for name in waiting {
            if self.assigned.contains(&name)
                && self
                    .board
                    .get(&name)
                    .is_some_and(|s| s.state().0 == State::Unassigned)
            {
                self.start(&name);
            }
        }
        let moved: Vec<String> = self
            .orphans
            .iter()
            .filter(|n| !self.assigned.contains(*n))
            .cloned()
            .collect();
        self.release_orphans(moved).await;
    }

    /// Orphans the group gave another replica: drained (a relay that
    /// ended on its own, or a paused one, only leaves the board's state),
    /// left `unassigned` with their last error.
    async fn release_orphans(&mut self, moved: Vec<String>) {
        if moved.is_empty() {
            return;
        }
        tracing::info!(sources = ?moved, "the group assigned these sources to another replica while this one was out of it: draining them");
        for name in &moved {
            self.orphans.remove(name);
        }
        let running: Vec<String> = moved
            .iter()
            .filter(|n| self.tasks.contains_key(*n))
            .cloned()
            .collect();
        let _ = self.stop_all(&running, State::Unassigned).await;
        for name in &moved {
            self.unwatch(name);
            if let Some(s) = self.board.get(name) {
                let (state, error) = s.state();
                if state != State::Stopping {
                    s.set_state(State::Unassigned, error);
                }
            }
        }
    }

    /// Leaves the group (every source drained first).
    async fn leave_group(&mut self) {
        // Revokes waiting in the queue are answered (their sender dropped).
        self.group_events = None;
        if let Some(c) = self.coordinator.take() {
            c.close().await;
        }
        self.board.set_coordination(None);
        self.plan = None;
        self.assigned.clear();
        self.settling = Settling::default();
        self.orphans.clear();
        for source in self.board.sources() {
            source.metrics.assigned.set(1);
        }
    }

    /// What the group decided.
    async fn on_group(&mut self, event: coordination::Event) {
        match event {
            coordination::Event::Assigned { group, sources } => self.on_assigned(&group, sources).await,
            coordination::Event::Failed(error) => {
                tracing::error!(%error, "this replica cannot join its group, so it would lead nothing: every source stops");
                let all: Vec<String> = self.tasks.keys().cloned().collect();
                let _ = self.stop_all(&all, State::Failed).await;
                for source in self.board.sources() {
                    self.unwatch(&source.name);
                    source.set_state(State::Failed, Some(error.clone()));
                }
            }
            coordination::Event::Revoked { sources, lost, done } => {
                // Picked up: the drain's bound counts from here.
                let _ = done.try_send(());
                for name in &sources {
                    self.assigned.remove(name);
                    self.settling.waiting.remove(name);
                    if let Some(s) = self.board.get(name) {
                        s.metrics.assigned.set(0);
                    }
                }
                let running: Vec<String> = sources
                    .iter()
                    .filter(|n| self.tasks.contains_key(*n))
                    .cloned()
                    .collect();
                if lost {
                    // The session expired (Kafka out of reach, or this
                    // replica was frozen). Relays whose lease is fresh go
                    // on: the lease keeps any other owner standing by, and
                    // a lost group must not stop publishing. The group's
                    // next assignment says which stay.
                    if !running.is_empty() {
                        tracing::warn!(sources = ?running, "this replica lost its place in the group (its session expired): its sources stream on under their leases until the group assigns them again");
                    }
                    self.orphans.extend(running.iter().cloned());
                    // Judged once the group has settled again.
                    self.settling = Settling {
                        after_lost: true,
                        ..Settling::default()
                    };
                } else {
                    let _ = self.stop_all(&running, State::Unassigned).await;
                }
                for name in &sources {
                    if self.orphans.contains(name) {
                        continue;
                    }
                    self.unwatch(name);
                    if let Some(s) = self.board.get(name) {
                        let (state, error) = s.state();
                        if state != State::Stopping {
                            // A failed source keeps its error in /status.
                            s.set_state(State::Unassigned, error);
                        }
                    }
                }
                drop(done);
            }
        }
    }

    /// The group assigned `names` of `group`'s sources here.
    async fn on_assigned(&mut self, group: &str, names: Vec<String>) {
        let first = !self.settling.done && self.settling.until.is_none();
        if first && (!names.is_empty() || self.settling.after_lost) {
            let heartbeat = self
                .plan
                .as_ref()
                .map_or(Duration::from_secs(1), |p| p.settings.config.heartbeat_interval.0);
            // After a lost session, sources held by others come in the
            // group's next round, after they answered their revoke.
            let rounds = if self.settling.after_lost { 5 } else { 2 };
            self.settling.until = Some(tokio::time::Instant::now() + heartbeat * rounds);
        }
        for name in &names {
            let Some(source) = self.board.get(name) else {
                continue;
            };
            self.assigned.insert(name.clone());
            source.metrics.assigned.set(1);
            if self.orphans.remove(name) && self.tasks.contains_key(name) {
                continue; // it streamed on, and stays
            }
            if self.settling.until.is_some() {
                self.settling.waiting.insert(name.clone());
            } else if source.state().0 == State::Unassigned {
                self.start(name);
            }
        }
        // Orphans of this group that it did not assign here are another
        // replica's now: they drain, and its relay takes their leases
        // (after a lost session, once the group has settled).
        if self.settling.until.is_some() {
            return;
        }
        let class: Vec<String> = self
            .plan
            .as_ref()
            .and_then(|p| p.classes.iter().find(|c| c.group == group))
            .map(|c| c.sources.clone())
            .unwrap_or_default();
        let moved: Vec<String> = self
            .orphans
            .iter()
            .filter(|n| class.contains(n) && !self.assigned.contains(*n))
            .cloned()
            .collect();
        self.release_orphans(moved).await;
    }

    /// Whether this replica may run `name`: always without `[coordination]`.
    fn may_run(&self, name: &str) -> bool {
        // An orphan restarted by a verb or a reload streams on until the
        // group says where it goes.
        self.plan.is_none() || self.assigned.contains(name) || self.orphans.contains(name)
    }

    /// No source runs or waits paused: everything failed.
    fn nothing_left(&self) -> bool {
        self.tasks.is_empty() && self.board.sources().iter().all(|s| s.state().0 == State::Failed)
    }

    fn start(&mut self, name: &str) {
        let (Some(config), Some(source)) = (self.configs.get(name), self.board.get(name)) else {
            return;
        };
        if !self.may_run(name) {
            source.set_state(State::Unassigned, None);
            return;
        }
        if let Some(w) = self.watchers.remove(name) {
            w.abort();
        }
        self.generation += 1;
        let generation = self.generation;
        let (stop, stop_rx) = watch::channel(false);
        let exits = self.exits_tx.clone();
        let config = config.clone();
        let kafka = self.kafka.clone();
        let span = tracing::info_span!("source", source = %name);
        source.set_state(State::Running, None);
        let key = name.to_owned();
        let name = name.to_owned();
        let join = tokio::spawn(
            async move {
                tracing::info!(
                    mode = source.mode,
                    postgres = %source.postgres,
                    table = %source.table,
                    slot = %source.slot,
                    "source starting"
                );
                // A panic in the relay still reports the source's end.
                let guard = ExitGuard {
                    exits,
                    name: Some(name),
                    generation,
                };
                let result = run_relay(
                    config,
                    source.metrics.clone(),
                    source.health.clone(),
                    kafka,
                    stop_rx,
                )
                .await;
                guard.send(result);
            }
            .instrument(span),
        );
        self.tasks.insert(
            key,
            Task {
                stop,
                join,
                generation,
            },
        );
    }

    /// A relay ended on its own (its task reported before being asked).
    fn ended(&mut self, exit: Exit) {
        let current = self
            .tasks
            .get(&exit.name)
            .is_some_and(|t| t.generation == exit.generation);
        if !current {
            return; // a drain the supervisor asked for; already accounted
        }
        self.tasks.remove(&exit.name);
        let Some(source) = self.board.get(&exit.name) else {
            return;
        };
        self.watch(&exit.name);
        match exit.result {
            Ok(()) => {
                tracing::info!(source = %exit.name, "source stopped");
                source.set_state(State::Paused, None);
            }
            Err(e) if self.configs.len() == 1 => {
                tracing::error!(error = %e, "stopped on an error that a restart will not fix");
                source.set_state(State::Failed, Some(e));
            }
            Err(e) => {
                tracing::error!(source = %exit.name, error = %e, "source stopped on an error that a restart will not fix; the other sources go on");
                source.set_state(State::Failed, Some(e));
            }
        }
    }

    /// Drains the named sources' relays (all at once) and leaves them in
    /// `then`. Shutdown is heard meanwhile: every other source is stopped
    /// at once, all drain under one deadline, and it returns
    /// [`Drained::Interrupted`] (the caller starts nothing).
    async fn stop_all(&mut self, names: &[String], then: State) -> Drained {
        let mut shutdown = self.shutdown.clone();
        let heard = async move {
            match shutdown.as_mut() {
                Some(s) => {
                    let _ = s.wait_for(|stopping| *stopping).await;
                }
                None => std::future::pending().await,
            }
        };
        tokio::pin!(heard);
        let mut pending = FuturesUnordered::new();
        let mut aborts = HashMap::new();
        let drain = |tasks: &mut HashMap<String, Task>, name: &str, board: &Board| {
            let task = tasks.remove(name)?;
            if let Some(s) = board.get(name) {
                s.set_state(State::Stopping, None);
            }
            let _ = task.stop.send(true);
            let abort = task.join.abort_handle();
            let name = name.to_owned();
            let join = task.join;
            Some((abort, async move { (name, join.await) }))
        };
        for name in names {
            if let Some((abort, waiting)) = drain(&mut self.tasks, name, &self.board) {
                aborts.insert(name.clone(), abort);
                pending.push(waiting);
            }
        }
        // The relays drain at once; each drain is bounded by
        // shutdown.drain_timeout, and a set-up step that ignores the stop (a
        // connect) gets a margin: one deadline for them all.
        let bound = |configs: &HashMap<String, SourceConfig>, names: &mut dyn Iterator<Item = &String>| {
            drain_bound(names.filter_map(|n| configs.get(n)))
        };
        let waited = bound(&self.configs, &mut names.iter());
        let mut deadline = tokio::time::Instant::now() + waited;
        let mut interrupted = false;
        loop {
            tokio::select! {
                next = pending.next() => {
                    let Some((name, result)) = next else { break };
                    aborts.remove(&name);
                    match result {
                        Ok(()) => {}
                        Err(e) if e.is_cancelled() => {
                            tracing::error!(source = %name, waited = ?waited, "a source did not stop in time; aborted (what it had not confirmed is published again)");
                        }
                        Err(e) => tracing::error!(source = %name, error = %e, "a source's task ended abnormally"),
                    }
                    let state = if interrupted { State::Stopping } else { then };
                    if let Some(s) = self.board.get(&name) {
                        s.set_state(state, None);
                    }
                    if state == State::Paused {
                        self.watch(&name);
                    }
                }
                () = tokio::time::sleep_until(deadline), if !aborts.is_empty() => {
                    // Aborted: each ends at its next await, before anything
                    // starts on its slot again.
                    for abort in aborts.values() {
                        abort.abort();
                    }
                    // An aborted task ends at its next await; abort again
                    // if one has not.
                    deadline = tokio::time::Instant::now() + Duration::from_secs(5);
                }
                () = &mut heard, if !interrupted => {
                    interrupted = true;
                    let others: Vec<String> = self.tasks.keys().cloned().collect();
                    if !others.is_empty() {
                        tracing::info!(sources = ?others, "shutdown requested while a drain was under way: every source stops now");
                    }
                    deadline = deadline.max(tokio::time::Instant::now() + bound(&self.configs, &mut others.iter()));
                    for name in &others {
                        if let Some((abort, waiting)) = drain(&mut self.tasks, name, &self.board) {
                            aborts.insert(name.clone(), abort);
                            pending.push(waiting);
                        }
                    }
                }
            }
        }
        // Their exits are stale now: drop them, keep any other source's.
        while let Ok(exit) = self.exits.try_recv() {
            self.ended(exit);
        }
        if interrupted {
            Drained::Interrupted
        } else {
            Drained::Done
        }
    }

    /// Watches the slot of a source no relay streams (paused, failed).
    fn watch(&mut self, name: &str) {
        self.unwatch(name);
        let (Some(config), Some(source)) = (self.configs.get(name), self.board.get(name)) else {
            return;
        };
        if config.config.mode != Mode::Cdc {
            return;
        }
        let task = tokio::spawn(crate::relay::poller::poll_slot_and_brokers(
            config.validated.clone(),
            None,
            config.config.health.poll_interval.0,
            config.config.health.max_retained_wal_bytes,
            source.metrics.clone(),
            source.health.clone(),
        ));
        self.watchers.insert(name.to_owned(), task);
    }

    fn unwatch(&mut self, name: &str) {
        if let Some(w) = self.watchers.remove(name) {
            w.abort();
        }
    }

    /// Carries out an operator's verb.
    async fn apply(&mut self, name: &str, verb: Verb) -> Result<(), ControlError> {
        let Some(source) = self.board.get(name) else {
            return Err(ControlError::NoSuchSource(name.to_owned()));
        };
        let state = source.state().0;
        match (verb, state) {
            // Assigned here, waiting for the group to settle: start now.
            (Verb::Resume | Verb::Restart, State::Unassigned) if self.assigned.contains(name) => {
                self.settling.waiting.remove(name);
                self.start(name);
                Ok(())
            }
            (Verb::Pause, State::Unassigned) if self.assigned.contains(name) => {
                self.settling.waiting.remove(name);
                source.set_state(State::Paused, None);
                self.watch(name);
                Ok(())
            }
            (_, State::Unassigned) => Err(ControlError::Conflict(
                name.to_owned(),
                "unassigned",
                "the replicas' group assigns it to another replica: send the verb to that one (GET /status on each names what it leads)",
            )),
            (Verb::Pause, State::Paused) => Ok(()),
            (Verb::Pause, State::Failed) => {
                source.set_state(State::Paused, source.state().1);
                Ok(())
            }
            (Verb::Pause, _) => {
                tracing::info!(source = %name, "pausing: draining, then holding the slot unstreamed");
                match self.stop_all(&[name.to_owned()], State::Paused).await {
                    Drained::Done => Ok(()),
                    Drained::Interrupted => Err(ControlError::Stopping),
                }
            }
            (Verb::Resume, State::Paused) => {
                tracing::info!(source = %name, "resuming");
                self.start(name);
                Ok(())
            }
            (Verb::Resume, State::Running | State::Stopping) => Ok(()),
            (Verb::Resume, State::Failed) => Err(ControlError::Conflict(
                name.to_owned(),
                "failed",
                "fix the cause, then POST /sources/<name>/restart",
            )),
            (Verb::Restart, _) => {
                tracing::info!(source = %name, "restarting");
                if self.stop_all(&[name.to_owned()], State::Stopping).await == Drained::Interrupted {
                    return Err(ControlError::Stopping);
                }
                self.start(name);
                Ok(())
            }
        }
    }

    /// SIGHUP: reads the file again and applies the difference.
    async fn reload(&mut self) {
        let Some(path) = self.path.clone() else {
            return;
        };
        let mut fresh = match Config::load_sources(&path) {
            Ok(f) => f,
            Err(e) => {
                tracing::error!(error = %e, file = %path.display(), "reload refused: the file is not valid; nothing changed");
                return;
            }
        };
        if let Some(only) = &self.only {
            fresh.retain(|s| s.name == *only);
            if fresh.is_empty() {
                tracing::error!(source = %only, file = %path.display(), "reload refused: the file has no source of this name (outboxd runs it with --source); nothing changed");
                return;
            }
        }
        if let (Some(old), Some(new)) = (self.configs.values().next(), fresh.first()) {
            let (o, n) = (&old.config, &new.config);
            if o.http.listen != n.http.listen || o.http.admin_token != n.http.admin_token {
                tracing::warn!("[http] (listen, admin_token) changes only when outboxd restarts");
            }
            if format!("{:?}", o.log) != format!("{:?}", n.log) {
                tracing::warn!("[log] changes only when outboxd restarts");
            }
        }
        let names: Vec<String> = fresh.iter().map(|s| s.name.clone()).collect();
        let removed: Vec<String> = self
            .configs
            .keys()
            .filter(|n| !names.contains(n))
            .cloned()
            .collect();
        // A failed source starts again too, as a restart of outboxd would
        // start it.
        let failed = |n: &str| self.board.get(n).is_some_and(|s| s.state().0 == State::Failed);
        let changed: Vec<String> = fresh
            .iter()
            .filter(|s| {
                self.configs
                    .get(&s.name)
                    .is_some_and(|old| old.fingerprint != s.fingerprint || failed(&s.name))
            })
            .map(|s| s.name.clone())
            .collect();
        let added: Vec<String> = names
            .iter()
            .filter(|n| !self.configs.contains_key(*n))
            .cloned()
            .collect();
        tracing::info!(?added, ?removed, ?changed, "reloading the config file");
        let paused: Vec<String> = changed
            .iter()
            .filter(|n| self.board.get(n).is_some_and(|s| s.state().0 == State::Paused))
            .cloned()
            .collect();
        // Another set of sources, other weights or another [coordination]:
        // every source drains here, and the group is joined anew.
        let plan = Plan::of(&fresh.iter().collect::<Vec<_>>());
        let regroup = !Plan::same(self.plan.as_ref(), plan.as_ref());
        let draining: Vec<String> = if regroup {
            tracing::info!("the sources' spread over replicas changes: every source drains, then the replicas' group is joined anew");
            self.tasks.keys().cloned().collect()
        } else {
            removed.iter().chain(&changed).cloned().collect()
        };
        if self.stop_all(&draining, State::Stopping).await == Drained::Interrupted {
            tracing::info!("reload not finished: outboxd is stopping");
            return;
        }
        if regroup {
            self.leave_group().await;
        }
        for name in &removed {
            self.unwatch(name);
            self.board.remove(name);
            self.configs.remove(name);
            tracing::info!(source = %name, "source removed");
        }
        for config in fresh {
            let name = config.name.clone();
            let is_changed = changed.contains(&name);
            if !is_changed && !added.contains(&name) {
                // Drained for a new spread without a group, or assigned to
                // another replica until now: it starts here.
                let unassigned = self
                    .board
                    .get(&name)
                    .is_some_and(|s| s.state().0 == State::Unassigned);
                if regroup && plan.is_none() && (draining.contains(&name) || unassigned) {
                    self.start(&name);
                }
                // Only `required` may differ: readiness changes, the relay
                // is untouched.
                if self
                    .configs
                    .get(&name)
                    .is_some_and(|old| old.required != config.required)
                {
                    if let Some(old) = self.board.get(&name) {
                        let entry = Source::new(&config, old.metrics.clone(), old.health.clone());
                        let (state, error) = old.state();
                        entry.set_state(state, error);
                        self.board.put(Arc::new(entry));
                    }
                    self.configs.insert(name, config);
                }
                continue;
            }
            let metrics = self.board.get(&name).map(|s| s.metrics.clone());
            if let Err(e) = self.add(config, metrics) {
                tracing::error!(error = %e, "source not started");
                continue;
            }
            if regroup && plan.is_some() {
                // The group assigns it (below).
            } else if paused.contains(&name) {
                if let Some(s) = self.board.get(&name) {
                    s.set_state(State::Paused, None);
                }
                self.watch(&name);
            } else {
                self.start(&name);
            }
        }
        self.board.order(&names);
        if let (true, Some(plan)) = (regroup, plan) {
            self.join_group(plan);
        }
    }
}

/// Builds and runs one source's relay until `stop` or a definite error.
async fn run_relay(
    source: SourceConfig,
    metrics: Arc<Metrics>,
    health: Arc<Health>,
    kafka: Arc<KafkaClients>,
    stop: watch::Receiver<bool>,
) -> Result<(), String> {
    match source.config.mode {
        Mode::Cdc => match Relay::with_clients(source.config, source.validated, metrics, health, kafka) {
            Ok(mut relay) => relay.run(stop).await.map_err(|e| e.to_string()),
            Err(e) => Err(e.to_string()),
        },
        Mode::Polling => {
            match PollingRelay::with_clients(source.config, source.validated, metrics, health, kafka) {
                Ok(mut relay) => relay.run(stop).await.map_err(|e| e.to_string()),
                Err(e) => Err(e.to_string()),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(coordination: &str, sources: usize) -> Vec<SourceConfig> {
        let mut text = format!("[kafka]\nbrokers = \"k:9092\"\n{coordination}\n");
        for i in 0..sources {
            text.push_str(&format!(
                "[[sources]]\nname = \"s{i}\"\nweight = {w}\n[sources.postgres]\nurl = \"postgres://u@h/d\"\nslot = \"s{i}\"\npublication = \"s{i}\"\ntable = \"o{i}\"\n",
                w = 1 + i % 2
            ));
        }
        crate::config::sources::from_toml(&text, |_| None).unwrap()
    }

    fn plan(sources: &[SourceConfig]) -> Option<Plan> {
        Plan::of(&sources.iter().collect::<Vec<_>>())
    }

    #[test]
    fn the_group_is_joined_only_with_coordination_and_several_sources() {
        let group = "[coordination]\ngroup = \"g\"";
        assert!(
            plan(&file("", 4)).is_none(),
            "no [coordination]: every source, as before"
        );
        assert!(
            plan(&file(group, 1)).is_none(),
            "one source: a hot standby, as before"
        );
        let p = plan(&file(group, 4)).unwrap();
        assert_eq!(p.classes.len(), 2, "one group per weight");
        assert_eq!(p.classes[0].sources, ["s0", "s2"]);
        assert_eq!(p.classes[1].group, "g.w2");
        // drain_timeout (30s by default) and a margin.
        assert_eq!(p.settings.drain_bound, Duration::from_secs(60));
        assert!(Plan::same(Some(&p), plan(&file(group, 4)).as_ref()));
        assert!(
            !Plan::same(Some(&p), plan(&file(group, 5)).as_ref()),
            "another source"
        );
        assert!(!Plan::same(
            Some(&p),
            plan(&file(
                "[coordination]\ngroup = \"g\"\nsession_timeout = \"20s\"",
                4
            ))
            .as_ref()
        ));
        assert!(!Plan::same(Some(&p), None));
    }
}
