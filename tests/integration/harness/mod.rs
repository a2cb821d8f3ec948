//! Shared test fixtures: the PostgreSQL server, a database per test, and
//! waiting on conditions instead of sleeping.

pub mod broker;
pub mod debezium;
pub mod otlp;
pub mod postgres;
pub mod registry;

use std::future::Future;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

pub use postgres::server;

static NEXT_DB: AtomicU32 = AtomicU32::new(0);

/// A fresh database on the shared server, with the outbox table.
#[derive(Debug)]
pub struct TestDb {
    pub name: String,
}

impl TestDb {
    /// Creates `<hint>_<n>` and applies the shipped migrations.
    pub async fn new(hint: &str) -> TestDb {
        let db = Self::empty(hint).await;
        outbox_sdk::migrate::migrate(&mut db.client().await)
            .await
            .expect("apply the migrations");
        db
    }

    /// Creates `<hint>_<n>` with no tables.
    pub async fn empty(hint: &str) -> TestDb {
        let server = server();
        let n = NEXT_DB.fetch_add(1, Ordering::SeqCst);
        let name = format!("{hint}_{}_{n}", std::process::id());
        let admin = server.client("postgres").await;
        admin
            .batch_execute(&format!("CREATE DATABASE {name}"))
            .await
            .unwrap_or_else(|e| panic!("CREATE DATABASE {name}: {e}"));
        TestDb { name }
    }

    /// A superuser SQL client on this database.
    pub async fn client(&self) -> tokio_postgres::Client {
        server().client(&self.name).await
    }

    /// A TCP URL for `user` on this database.
    pub fn url(&self, user: &str, password: Option<&str>) -> String {
        server().url(user, password, &self.name)
    }

    /// The superuser URL over TCP.
    pub fn superuser_url(&self) -> String {
        self.url("postgres", None)
    }
}

/// With `OUTBOXD_TEST_LOG=<filter>` (e.g. `outboxd=debug`), in-process
/// relays log to stderr; run with `--nocapture` to see them.
pub fn init_logs() {
    if let Ok(level) = std::env::var("OUTBOXD_TEST_LOG") {
        outboxd::ops::telemetry::init(&outboxd::config::LogConfig {
            format: outboxd::config::LogFormat::Text,
            level: Some(level),
        });
    }
}

/// Runs the shell command `then` as soon as this test process is gone,
/// however it goes (normal end, panic, SIGKILL): stopping the servers the
/// harness started and removing their directories.
pub fn spawn_watchdog(then: &str) {
    let script = format!(
        "while kill -0 {} 2>/dev/null; do sleep 0.5; done; {then}",
        std::process::id()
    );
    let _ = std::process::Command::new("sh")
        .arg("-c")
        .arg(script)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn();
}

/// A child process that is killed (SIGKILL) and reaped when the guard is
/// dropped, also when its test fails or panics: no process a test starts
/// outlives it (`scripts/test.sh` checks that none is left at the end).
#[derive(Debug)]
pub struct Reaped(Option<std::process::Child>);

impl Reaped {
    pub fn new(child: std::process::Child) -> Reaped {
        Reaped(Some(child))
    }

    /// The child, no longer killed on drop (the caller waits for it).
    pub fn into_inner(mut self) -> std::process::Child {
        self.0.take().expect("a child")
    }
}

impl std::ops::Deref for Reaped {
    type Target = std::process::Child;
    fn deref(&self) -> &std::process::Child {
        self.0.as_ref().expect("a child")
    }
}

impl std::ops::DerefMut for Reaped {
    fn deref_mut(&mut self) -> &mut std::process::Child {
        self.0.as_mut().expect("a child")
    }
}

impl Drop for Reaped {
    fn drop(&mut self) {
        if let Some(mut child) = self.0.take() {
            // SIGCONT first: a stopped child (SIGSTOP) is killed all the same,
            // but is only reaped once it runs.
            let _ = std::process::Command::new("kill")
                .args(["-CONT", &child.id().to_string()])
                .stderr(std::process::Stdio::null())
                .status();
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Polls `check` until it returns `Some`, or panics after `timeout` with `what`.
pub async fn wait_for<T, F, Fut>(what: &str, timeout: Duration, check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    wait_for_showing(what, timeout, &[], check).await
}

/// [`wait_for`], and on timeout the last lines of each of `logs` in the
/// panic message: a liveness wait between daemons fails with what they
/// were doing.
pub async fn wait_for_showing<T, F, Fut>(
    what: &str,
    timeout: Duration,
    logs: &[&std::path::Path],
    mut check: F,
) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = check().await {
            return v;
        }
        if Instant::now() >= deadline {
            let mut shown = String::new();
            for log in logs {
                let text = std::fs::read_to_string(log).unwrap_or_default();
                let lines: Vec<&str> = text.lines().collect();
                let tail = lines[lines.len().saturating_sub(40)..].join("\n");
                shown.push_str(&format!("\n--- {} (last 40 lines)\n{tail}", log.display()));
            }
            panic!("timed out after {timeout:?} waiting for {what}{shown}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The path of example `name`, built beside this test binary.
pub fn example_bin(name: &str) -> std::path::PathBuf {
    // target/<profile>/deps/integration-… → target/<profile>/examples/<name>
    let exe = std::env::current_exe().unwrap();
    let path = exe
        .parent()
        .unwrap()
        .parent()
        .unwrap()
        .join("examples")
        .join(name);
    assert!(
        path.exists(),
        "{} is missing: `cargo test` builds the examples (run the whole suite, or cargo build --examples)",
        path.display()
    );
    path
}

/// Starts example `name` as a server with `args` (which must make it
/// listen on a free port and print `listening on <base URL>` as its first
/// line on stdout); returns the child and the base URL.
pub fn spawn_example_server(name: &str, args: &[&str]) -> (Reaped, String) {
    use std::io::BufRead;
    let mut child = std::process::Command::new(example_bin(name))
        .args(args)
        .env("RUST_LOG", "warn")
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    std::io::BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let base = line
        .trim()
        .strip_prefix("listening on ")
        .unwrap_or_else(|| panic!("{name} did not start: {line:?}"))
        .to_owned();
    (Reaped::new(child), base)
}
