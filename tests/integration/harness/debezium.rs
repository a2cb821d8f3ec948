//! Debezium, the incumbent: Kafka Connect standalone with the Debezium
//! PostgreSQL connector and its Outbox Event Router, started through
//! `scripts/debezium.sh` (the same path as the benchmark). A test gets a
//! Connect of its own; a watchdog kills it if the test process dies.

use std::path::{Path, PathBuf};
use std::process::Command;

/// The repository's `scripts/debezium.sh`.
pub fn debezium_script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/debezium.sh")
}

/// The Debezium version `scripts/debezium.sh` installs.
#[allow(dead_code)]
pub fn version() -> String {
    let out = Command::new(debezium_script())
        .arg("version")
        .output()
        .expect("run scripts/debezium.sh version");
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

/// Where Debezium reads: the test server's database, a slot and a
/// publication that exist already (Debezium creates neither).
#[derive(Clone, Debug)]
pub struct Source<'a> {
    pub pg_port: u16,
    pub dbname: &'a str,
    pub slot: &'a str,
    pub publication: &'a str,
}

/// A running Kafka Connect with the outbox connector.
#[derive(Debug)]
pub struct Debezium {
    dir: tempfile::TempDir,
    brokers: String,
    /// Worker properties laid over the script's (`key=value`).
    worker: Vec<String>,
    /// The JVM's process id (the benchmark samples its RSS and CPU).
    #[allow(dead_code)]
    pub pid: u32,
}

impl Debezium {
    /// Starts Connect and waits until the task streams. `topic_replacement`
    /// is the EventRouter's `route.topic.replacement`; `settings` are
    /// extra connector properties (`key=value`).
    pub fn start(brokers: &str, source: &Source<'_>, topic_replacement: &str, settings: &[&str]) -> Debezium {
        let dir = tempfile::Builder::new()
            .prefix("outboxd-debezium-")
            .tempdir()
            .expect("temp dir");
        let mut connector = Command::new(debezium_script());
        connector.arg("connector").args([
            "--host",
            "127.0.0.1",
            "--port",
            &source.pg_port.to_string(),
            "--user",
            "postgres",
            "--password",
            "unused",
            "--dbname",
            source.dbname,
            "--slot",
            source.slot,
            "--publication",
            source.publication,
            "--topic-replacement",
            topic_replacement,
        ]);
        for s in settings {
            connector.args(["--set", s]);
        }
        let out = connector.output().expect("run scripts/debezium.sh connector");
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let file = dir.path().join("connector.properties");
        std::fs::write(&file, &out.stdout).expect("write the connector's properties");
        let connect = dir.path().join("connect");
        super::spawn_watchdog(&format!(
            "{} stop {} --kill; rm -rf {}",
            debezium_script().display(),
            connect.display(),
            dir.path().display()
        ));
        let mut debezium = Debezium {
            dir,
            brokers: brokers.to_owned(),
            worker: Vec::new(),
            pid: 0,
        };
        debezium.launch();
        debezium
    }

    /// Starts Connect with `connector` (a .properties text, used as it
    /// is) and `worker` settings over the script's worker (converters).
    #[allow(dead_code)]
    pub fn start_connector(brokers: &str, connector: &str, worker: &[&str]) -> Debezium {
        let dir = tempfile::Builder::new()
            .prefix("outboxd-debezium-")
            .tempdir()
            .expect("temp dir");
        std::fs::write(dir.path().join("connector.properties"), connector)
            .expect("write the connector's properties");
        let connect = dir.path().join("connect");
        super::spawn_watchdog(&format!(
            "{} stop {} --kill; rm -rf {}",
            debezium_script().display(),
            connect.display(),
            dir.path().display()
        ));
        let mut debezium = Debezium {
            dir,
            brokers: brokers.to_owned(),
            worker: worker.iter().map(|w| (*w).to_owned()).collect(),
            pid: 0,
        };
        debezium.launch();
        debezium
    }

    /// Starts Connect again after [`Debezium::stop`], with the same worker
    /// and the offsets it stored: a restart, as a deployment restarts.
    #[allow(dead_code)]
    pub fn restart(&mut self) {
        self.launch();
    }

    fn launch(&mut self) {
        let out = Command::new(debezium_script())
            .arg("start")
            .arg(self.connect_dir())
            .args(["--brokers", &self.brokers, "--connector"])
            .arg(self.dir.path().join("connector.properties"))
            .args(self.worker.iter().flat_map(|w| ["--worker-set", w.as_str()]))
            .output()
            .expect("run scripts/debezium.sh start");
        assert!(
            out.status.success(),
            "Debezium did not start: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        self.pid = std::fs::read_to_string(self.connect_dir().join("pid"))
            .expect("Connect's pid")
            .trim()
            .parse()
            .expect("a pid");
    }

    fn connect_dir(&self) -> PathBuf {
        self.dir.path().join("connect")
    }

    /// SIGTERM: Connect commits its offsets and Debezium confirms the slot.
    pub fn stop(&self) {
        let _ = Command::new(debezium_script())
            .arg("stop")
            .arg(self.connect_dir())
            .status();
    }

    /// SIGKILL: nothing is committed or confirmed on the way out.
    pub fn kill(&self) {
        let _ = Command::new(debezium_script())
            .arg("stop")
            .arg(self.connect_dir())
            .arg("--kill")
            .status();
    }

    /// Connect's log, for failure messages.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.connect_dir().join("connect.log")).unwrap_or_default()
    }
}

impl Drop for Debezium {
    fn drop(&mut self) {
        self.kill();
    }
}
