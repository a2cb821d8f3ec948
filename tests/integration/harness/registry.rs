//! A real Schema Registry for the tests: Apicurio Registry (in-memory
//! storage) from Maven Central, started once per test binary through
//! `scripts/registry.sh run`, its Confluent-compatible API under
//! `/apis/ccompat/v7`. `OUTBOXD_TEST_SCHEMA_REGISTRY=<ccompat URL>` uses a
//! registry of the user's own instead.
//!
//! [`Gate`] stands between outboxd and the registry for outage tests: a
//! TCP relay that can be closed (every connection is cut at once) and
//! opened again.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use super::spawn_watchdog;

/// The running registry.
#[derive(Debug)]
pub struct SchemaRegistry {
    /// The ccompat base URL, such as `http://127.0.0.1:PORT/apis/ccompat/v7`.
    pub url: String,
}

static REGISTRY: OnceLock<Result<SchemaRegistry, String>> = OnceLock::new();

/// The shared registry, started on first use.
pub fn registry() -> &'static SchemaRegistry {
    match REGISTRY.get_or_init(start) {
        Ok(r) => r,
        Err(e) => panic!("the test Schema Registry could not start: {e}"),
    }
}

fn script() -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/registry.sh"))
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn start() -> Result<SchemaRegistry, String> {
    if let Ok(url) = std::env::var("OUTBOXD_TEST_SCHEMA_REGISTRY") {
        return Ok(SchemaRegistry { url });
    }
    let port = free_port();
    let log = std::env::temp_dir().join(format!("outboxd-registry-{}.log", std::process::id()));
    let file = std::fs::File::create(&log).map_err(|e| e.to_string())?;
    let child = Command::new(script())
        .args(["run", "--port", &port.to_string()])
        .stdin(Stdio::null())
        .stdout(file.try_clone().map_err(|e| e.to_string())?)
        .stderr(file)
        .spawn()
        .map_err(|e| format!("cannot run scripts/registry.sh: {e}"))?;
    spawn_watchdog(&format!(
        "kill -9 {} 2>/dev/null; rm -f '{}'",
        child.id(),
        log.display()
    ));
    let url = format!("http://127.0.0.1:{port}/apis/ccompat/v7");
    let deadline = Instant::now() + Duration::from_secs(180);
    while Instant::now() < deadline {
        if get(&format!("{url}/subjects")).is_ok() {
            return Ok(SchemaRegistry { url });
        }
        std::thread::sleep(Duration::from_millis(250));
    }
    Err(format!(
        "no answer within 180 s: {}",
        std::fs::read_to_string(&log).unwrap_or_default()
    ))
}

fn get(url: &str) -> Result<Value, String> {
    let mut resp = ureq::get(url).call().map_err(|e| e.to_string())?;
    let text = resp.body_mut().read_to_string().map_err(|e| e.to_string())?;
    serde_json::from_str(&text).map_err(|e| e.to_string())
}

impl SchemaRegistry {
    /// Registers `schema` (`AVRO`, `JSON` or `PROTOBUF`) under `subject`;
    /// returns its id.
    pub fn register(&self, subject: &str, schema_type: &str, schema: &str) -> u32 {
        let subject = percent_encoding::utf8_percent_encode(subject, percent_encoding::NON_ALPHANUMERIC);
        let mut resp = ureq::post(&format!("{}/subjects/{subject}/versions", self.url))
            .header("Content-Type", "application/vnd.schemaregistry.v1+json")
            .send(json!({"schema": schema, "schemaType": schema_type}).to_string())
            .unwrap_or_else(|e| panic!("registering under {subject}: {e}"));
        let v: Value = serde_json::from_str(&resp.body_mut().read_to_string().unwrap()).unwrap();
        v["id"].as_u64().unwrap() as u32
    }

    /// The schema of `id`, parsed.
    pub fn schema_of(&self, id: u32) -> Value {
        let served = get(&format!("{}/schemas/ids/{id}", self.url)).unwrap();
        serde_json::from_str(served["schema"].as_str().unwrap()).unwrap()
    }

    /// The id of `subject`'s latest version.
    pub fn latest_id(&self, subject: &str) -> u32 {
        let subject = percent_encoding::utf8_percent_encode(subject, percent_encoding::NON_ALPHANUMERIC);
        get(&format!("{}/subjects/{subject}/versions/latest", self.url)).unwrap()["id"]
            .as_u64()
            .unwrap() as u32
    }
}

/// A TCP relay to `target` that can be closed and opened.
#[derive(Debug, Clone)]
pub struct Gate {
    pub port: u16,
    open: Arc<AtomicBool>,
}

impl Gate {
    /// A gate to the `host:port` of `url`, open.
    pub fn to(url: &str) -> Gate {
        let target = url::Url::parse(url).unwrap();
        let target = format!("{}:{}", target.host_str().unwrap(), target.port().unwrap());
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let open = Arc::new(AtomicBool::new(true));
        let gate = Gate {
            port,
            open: open.clone(),
        };
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                let Ok(client) = conn else { continue };
                if !open.load(Ordering::SeqCst) {
                    let _ = client.shutdown(Shutdown::Both);
                    continue;
                }
                let Ok(server) = TcpStream::connect(&target) else {
                    continue;
                };
                for (mut from, mut to) in [
                    (client.try_clone().unwrap(), server.try_clone().unwrap()),
                    (server, client),
                ] {
                    let open = open.clone();
                    std::thread::spawn(move || {
                        let mut buf = [0u8; 16 * 1024];
                        from.set_read_timeout(Some(Duration::from_millis(100))).unwrap();
                        loop {
                            if !open.load(Ordering::SeqCst) {
                                break;
                            }
                            match from.read(&mut buf) {
                                Ok(0) => break,
                                Ok(n) => {
                                    if to.write_all(&buf[..n]).is_err() {
                                        break;
                                    }
                                }
                                Err(e)
                                    if matches!(
                                        e.kind(),
                                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                                    ) => {}
                                Err(_) => break,
                            }
                        }
                        let _ = to.shutdown(Shutdown::Both);
                        let _ = from.shutdown(Shutdown::Both);
                    });
                }
            }
        });
        gate
    }

    /// The URL of the registry through this gate.
    pub fn url(&self, url: &str) -> String {
        let mut u = url::Url::parse(url).unwrap();
        u.set_port(Some(self.port)).unwrap();
        u.to_string().trim_end_matches('/').to_owned()
    }

    pub fn close(&self) {
        self.open.store(false, Ordering::SeqCst);
    }

    pub fn open(&self) {
        self.open.store(true, Ordering::SeqCst);
    }
}

/// An HTTP server that answers every request with `status` and `body`:
/// a registry that refuses outboxd's credentials.
pub fn refusing_server(status: u16, body: &'static str) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut s) = conn else { continue };
            let mut buf = [0u8; 8192];
            let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
            let _ = s.read(&mut buf);
            let _ = write!(
                s,
                "HTTP/1.1 {status} Refused\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            );
        }
    });
    format!("http://127.0.0.1:{port}")
}

/// The python of the independent registry clients
/// (scripts/lib/registry-clients.sh, run by setup.sh).
pub fn clients_python() -> String {
    if let Ok(p) = std::env::var("OUTBOXD_REGISTRY_CLIENTS_PYTHON") {
        return p;
    }
    let out = Command::new(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/scripts/lib/registry-clients.sh"
    ))
    .output()
    .expect("scripts/lib/registry-clients.sh runs");
    assert!(
        out.status.success(),
        "the registry clients are missing (run scripts/setup.sh): {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap().trim().to_owned()
}
