//! A throwaway PostgreSQL server for the test run.
//!
//! Started once per test process on first use: `initdb` into a temporary
//! directory, `wal_level=logical`, a free TCP port on 127.0.0.1 and a Unix
//! socket in the temporary directory, TLS with a certificate from a test CA,
//! and a `pg_hba.conf` with trust, cleartext, md5 and scram-sha-256 users.
//! When the tests run as root the server runs as the `postgres` OS user.
//!
//! `OUTBOXD_PG_VERSION` picks the server: 15 (the default) is the host's
//! own; 17 and 18 run inside the Debian roots that
//! `scripts/lib/postgres-root.sh` makes (`scripts/setup.sh` with
//! `OUTBOXD_PG_VERSIONS="17 18"`), through its chroot wrappers. Their files
//! then live under the root's `/tmp`, at a path that means the same file on
//! both sides of the chroot. `OUTBOXD_PG_BIN` names a binary directory
//! directly.
//!
//! A watchdog shell process stops the server and deletes the directory as
//! soon as the test process exits, however it exits (normal end, a panic
//! escaping the harness, SIGKILL). If the server cannot start, every test
//! that needs it fails with the reason and the server log; none skip.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use tokio_postgres::NoTls;

/// Users the tests can log in as, with the authentication method
/// `pg_hba.conf` applies to them over TCP.
pub const TRUST_USER: &str = "trust_user";
pub const CLEARTEXT_USER: (&str, &str) = ("clear_user", "clear-pass");
pub const MD5_USER: (&str, &str) = ("md5_user", "md5-pass");
pub const SCRAM_USER: (&str, &str) = ("scram_user", "scram-pass ü");

#[derive(Debug)]
pub struct PgServer {
    pub port: u16,
    pub socket_dir: PathBuf,
    pub data_dir: PathBuf,
    pub bin_dir: PathBuf,
    /// CA certificate that signed the server certificate (SAN: localhost only).
    pub ca_cert: PathBuf,
    /// A CA that signed nothing, for negative TLS tests.
    pub other_ca_cert: PathBuf,
    pub log_file: PathBuf,
    install: Install,
}

/// Where the server binaries are and how they run.
#[derive(Clone, Debug)]
struct Install {
    bin_dir: PathBuf,
    /// The directory to keep the server's files in, for binaries that run
    /// in a chroot (their wrappers switch to the postgres user themselves).
    chroot_tmp: Option<PathBuf>,
    /// Run the binaries through `runuser -u postgres` (tests run as root).
    run_as_postgres: bool,
}

static SERVER: OnceLock<Result<PgServer, String>> = OnceLock::new();

/// The shared server, started on first use. Panics (failing the test) with
/// the reason when it cannot start.
pub fn server() -> &'static PgServer {
    match SERVER.get_or_init(|| start("")) {
        Ok(s) => s,
        Err(e) => panic!("the test PostgreSQL server could not start: {e}"),
    }
}

/// A server of its own, with `extra_conf` appended to postgresql.auto.conf
/// (later settings win). Stopped when the test process exits.
pub fn dedicated(extra_conf: &str) -> PgServer {
    start(extra_conf).unwrap_or_else(|e| panic!("a dedicated PostgreSQL server could not start: {e}"))
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
        .unwrap_or(false)
}

/// The major version `OUTBOXD_PG_VERSION` asks for (15 when unset).
pub fn wanted_version() -> u32 {
    std::env::var("OUTBOXD_PG_VERSION")
        .ok()
        .filter(|v| !v.is_empty())
        .map(|v| {
            v.parse()
                .unwrap_or_else(|_| panic!("OUTBOXD_PG_VERSION={v:?} is not a major version such as 17"))
        })
        .unwrap_or(15)
}

fn find_install() -> Result<Install, String> {
    let run_as_postgres = is_root();
    if let Some(dir) = std::env::var_os("OUTBOXD_PG_BIN") {
        return Ok(Install {
            bin_dir: PathBuf::from(dir),
            chroot_tmp: None,
            run_as_postgres,
        });
    }
    let version = wanted_version();
    let host = PathBuf::from(format!("/usr/lib/postgresql/{version}/bin"));
    if host.join("postgres").exists() {
        return Ok(Install {
            bin_dir: host,
            chroot_tmp: None,
            run_as_postgres,
        });
    }
    let roots = std::env::var_os("OUTBOXD_PG_ROOTS")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache/outboxd/postgres")
        });
    let bin_dir = roots.join(version.to_string()).join("bin");
    match std::fs::read_to_string(bin_dir.join(".outboxd-chroot-tmp")) {
        Ok(tmp) => Ok(Install {
            bin_dir,
            chroot_tmp: Some(PathBuf::from(tmp.trim())),
            run_as_postgres: false,
        }),
        Err(_) => Err(format!(
            "no PostgreSQL {version} server: neither {} nor {} exists; \
             run `OUTBOXD_PG_VERSIONS={version} scripts/setup.sh`",
            host.display(),
            bin_dir.display()
        )),
    }
}

pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("no free TCP port on 127.0.0.1")
}

impl PgServer {
    /// Runs a server binary (initdb, pg_ctl, ...) as the server's OS user.
    pub fn command(&self, tool: &str) -> Command {
        self.install.command(tool)
    }

    /// A fresh directory for files the server reads or writes (a data
    /// directory of a standby, say): under the chroot's `/tmp` for servers
    /// that run in one, owned by the server's OS user.
    pub fn scratch_dir(&self, prefix: &str) -> PathBuf {
        let dir = self.install.scratch_dir(prefix).unwrap_or_else(|e| panic!("{e}"));
        // Removed once the test process is gone (and the servers the
        // watchdogs stop with it, which may run on a copy made here).
        super::spawn_watchdog(&format!("sleep 2; rm -rf '{}'", dir.display()));
        dir
    }

    /// `pg_ctl` with the data directory filled in; waits for it to finish.
    pub fn pg_ctl(&self, args: &[&str]) -> Result<(), String> {
        let out = self
            .command("pg_ctl")
            .arg("-D")
            .arg(&self.data_dir)
            .args(args)
            .stdin(Stdio::null())
            .output()
            .map_err(|e| format!("cannot run pg_ctl: {e}"))?;
        if out.status.success() {
            Ok(())
        } else {
            Err(format!(
                "pg_ctl {args:?} failed: {}{}\n{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr),
                self.log_tail()
            ))
        }
    }

    /// A streaming physical standby of this server on `port`, through the
    /// physical slot `slot` (created on this server by `pg_basebackup`),
    /// with `extra_conf` appended. It connects with `dbname=postgres` and
    /// `hot_standby_feedback`, as slot synchronisation (PostgreSQL 17+)
    /// needs. Stopped when the test process exits.
    pub fn standby(&self, port: u16, slot: &str, extra_conf: &str) -> PgServer {
        let root = self.scratch_dir("outboxd-pg-standby-");
        let data_dir = root.join("data");
        let socket_dir = root.join("sock");
        std::fs::create_dir_all(&socket_dir).unwrap();
        let mut chown = Command::new("chown");
        chown.args(["-R", "postgres:postgres"]).arg(&socket_dir);
        if self.install.run_as_postgres || self.install.chroot_tmp.is_some() {
            run(chown, "chown of the standby's socket directory").unwrap();
        }
        let mut backup = self.command("pg_basebackup");
        backup.arg("-D").arg(&data_dir).args([
            "-h",
            "127.0.0.1",
            "-p",
            &self.port.to_string(),
            "-U",
            "postgres",
            "-X",
            "stream",
            "-C",
            "-S",
            slot,
            "-R",
            "--no-sync",
            // An immediate checkpoint: a spread one paces itself over most
            // of checkpoint_timeout while writers are busy.
            "-c",
            "fast",
        ]);
        run(backup, "pg_basebackup").unwrap_or_else(|e| panic!("{e}\n{}", self.log_tail()));
        let conf = format!(
            "port = {port}\n\
             unix_socket_directories = '{sock}'\n\
             primary_conninfo = 'host=127.0.0.1 port={primary} user=postgres dbname=postgres application_name=standby'\n\
             primary_slot_name = '{slot}'\n\
             hot_standby = on\n\
             hot_standby_feedback = on\n\
             {extra_conf}\n",
            sock = socket_dir.display(),
            primary = self.port,
        );
        append_conf(&data_dir, &conf).unwrap();
        let server = PgServer {
            port,
            socket_dir,
            data_dir,
            bin_dir: self.bin_dir.clone(),
            ca_cert: self.ca_cert.clone(),
            other_ca_cert: self.other_ca_cert.clone(),
            log_file: root.join("server.log"),
            install: self.install.clone(),
        };
        spawn_watchdog(&server, &root);
        server
            .pg_ctl(&[
                "start",
                "-w",
                "-t",
                "60",
                "-l",
                &server.log_file.display().to_string(),
            ])
            .unwrap();
        wait_accepting(&server).unwrap();
        server
    }

    /// `pg_ctl promote`, waiting until the server accepts writes.
    pub fn promote(&self) {
        self.pg_ctl(&["promote", "-w", "-t", "60"]).unwrap();
    }

    /// The last lines of the server log, for failure messages.
    pub fn log_tail(&self) -> String {
        let log = std::fs::read_to_string(&self.log_file).unwrap_or_default();
        let lines: Vec<&str> = log.lines().collect();
        let start = lines.len().saturating_sub(30);
        format!(
            "--- server log ({}) ---\n{}",
            self.log_file.display(),
            lines[start..].join("\n")
        )
    }

    /// A postgres:// URL over TCP for `user` (with `password`) and `db`.
    pub fn url(&self, user: &str, password: Option<&str>, db: &str) -> String {
        let auth = match password {
            Some(p) => format!("{user}:{}", urlencode(p)),
            None => user.to_owned(),
        };
        format!("postgres://{auth}@127.0.0.1:{}/{db}?sslmode=disable", self.port)
    }

    /// A postgres:// URL over the Unix socket, as the superuser.
    pub fn socket_url(&self, db: &str) -> String {
        format!(
            "postgres://postgres@{}:{}/{db}",
            urlencode(&self.socket_dir.display().to_string()),
            self.port
        )
    }

    /// A superuser SQL client on `db`.
    pub async fn client(&self, db: &str) -> tokio_postgres::Client {
        let (client, conn) = tokio_postgres::Config::new()
            .host("127.0.0.1")
            .port(self.port)
            .user("postgres")
            .dbname(db)
            .connect(NoTls)
            .await
            .unwrap_or_else(|e| panic!("cannot connect to the test server: {e}\n{}", self.log_tail()));
        tokio::spawn(conn);
        client
    }
}

pub fn urlencode(s: &str) -> String {
    url::form_urlencoded::byte_serialize(s.as_bytes())
        .collect::<String>()
        .replace('+', "%20")
}

impl Install {
    fn command(&self, tool: &str) -> Command {
        let program = self.bin_dir.join(tool);
        if self.run_as_postgres {
            let mut c = Command::new("runuser");
            c.args(["-u", "postgres", "--"]).arg(program);
            c
        } else {
            Command::new(program)
        }
    }

    /// A new directory (kept until the watchdog removes it) owned by the
    /// server's user.
    fn scratch_dir(&self, prefix: &str) -> Result<PathBuf, String> {
        let mut builder = tempfile::Builder::new();
        builder.prefix(prefix);
        let dir = match &self.chroot_tmp {
            Some(tmp) => builder.tempdir_in(tmp),
            None => builder.tempdir(),
        }
        .map_err(|e| format!("cannot create a temporary directory: {e}"))?
        .keep();
        if self.run_as_postgres || self.chroot_tmp.is_some() {
            let mut chown = Command::new("chown");
            chown.args(["-R", "postgres:postgres"]).arg(&dir);
            run(chown, "chown of the test directory to the postgres user")?;
        }
        Ok(dir)
    }
}

fn run(mut cmd: Command, what: &str) -> Result<(), String> {
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("cannot run {what}: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "{what} failed ({}): {}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    Ok(())
}

fn write_certs(dir: &Path) -> Result<(PathBuf, PathBuf), String> {
    use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, DnType, IsCa, KeyPair};
    let e = |e: rcgen::Error| format!("cannot make test certificates: {e}");
    let ca = |name: &str| -> Result<CertifiedIssuer<'static, KeyPair>, String> {
        let mut params = CertificateParams::new(Vec::<String>::new()).map_err(e)?;
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, name);
        CertifiedIssuer::self_signed(params, KeyPair::generate().map_err(e)?).map_err(e)
    };
    let test_ca = ca("outboxd test CA")?;
    let other_ca = ca("outboxd unrelated CA")?;
    let key = KeyPair::generate().map_err(e)?;
    let mut params = CertificateParams::new(vec!["localhost".to_owned()]).map_err(e)?;
    params.distinguished_name.push(DnType::CommonName, "localhost");
    let cert = params.signed_by(&key, &test_ca).map_err(e)?;
    let write = |name: &str, body: String| -> Result<PathBuf, String> {
        let p = dir.join(name);
        std::fs::write(&p, body).map_err(|err| format!("cannot write {}: {err}", p.display()))?;
        Ok(p)
    };
    write("server.crt", cert.pem())?;
    write("server.key", key.serialize_pem())?;
    Ok((
        write("ca.pem", test_ca.pem())?,
        write("other-ca.pem", other_ca.pem())?,
    ))
}

const HBA: &str = "\
# TYPE  DATABASE  USER         ADDRESS        METHOD
local   all       all                         trust
local   replication all                       trust
host    replication postgres   127.0.0.1/32   trust
host    all       postgres     127.0.0.1/32   trust
host    all       trust_user   127.0.0.1/32   trust
host    all       clear_user   127.0.0.1/32   password
host    all       md5_user     127.0.0.1/32   md5
host    all       scram_user   127.0.0.1/32   scram-sha-256
host    all       all          127.0.0.1/32   scram-sha-256
";

fn start(extra_conf: &str) -> Result<PgServer, String> {
    let install = find_install()?;
    let root = install.scratch_dir("outboxd-pg-")?;
    let data_dir = root.join("data");
    let socket_dir = root.join("sock");
    std::fs::create_dir_all(&socket_dir).map_err(|e| e.to_string())?;
    let (ca_cert, other_ca_cert) = write_certs(&root)?;
    if install.run_as_postgres || install.chroot_tmp.is_some() {
        let mut chown = Command::new("chown");
        chown.args(["-R", "postgres:postgres"]).arg(&root);
        run(chown, "chown of the test directory to the postgres user")?;
    }
    let mut initdb = install.command("initdb");
    initdb.arg("-D").arg(&data_dir).args([
        "-U",
        "postgres",
        "--auth=trust",
        "-E",
        "UTF8",
        "--locale=C",
        "--no-sync",
    ]);
    run(initdb, "initdb")?;
    std::fs::write(data_dir.join("pg_hba.conf"), HBA).map_err(|e| e.to_string())?;
    let key = root.join("server.key");
    let mut chmod = Command::new("chmod");
    chmod.arg("0600").arg(&key);
    run(chmod, "chmod of the server key")?;

    let port = free_port();
    let conf = format!(
        "port = {port}\n\
         listen_addresses = '127.0.0.1'\n\
         unix_socket_directories = '{sock}'\n\
         wal_level = logical\n\
         max_replication_slots = 200\n\
         max_wal_senders = 200\n\
         max_connections = 400\n\
         wal_sender_timeout = '60s'\n\
         fsync = off\n\
         full_page_writes = off\n\
         shared_buffers = '128MB'\n\
         max_wal_size = '2GB'\n\
         ssl = on\n\
         ssl_cert_file = '{cert}'\n\
         ssl_key_file = '{key}'\n\
         track_commit_timestamp = on\n\
         log_min_messages = warning\n\
         {extra_conf}\n",
        sock = socket_dir.display(),
        cert = root.join("server.crt").display(),
        key = key.display(),
    );
    append_conf(&data_dir, &conf)?;

    let log_file = root.join("server.log");
    let server = PgServer {
        port,
        socket_dir,
        data_dir,
        bin_dir: install.bin_dir.clone(),
        ca_cert,
        other_ca_cert,
        log_file,
        install,
    };
    spawn_watchdog(&server, &root);
    server.pg_ctl(&[
        "start",
        "-w",
        "-t",
        "60",
        "-l",
        &server.log_file.display().to_string(),
    ])?;
    wait_accepting(&server)?;
    create_roles(&server)?;
    Ok(server)
}

/// Appends settings to `postgresql.auto.conf` (later settings win).
fn append_conf(data_dir: &Path, conf: &str) -> Result<(), String> {
    let mut auto = std::fs::OpenOptions::new()
        .append(true)
        .open(data_dir.join("postgresql.auto.conf"))
        .map_err(|e| e.to_string())?;
    std::io::Write::write_all(&mut auto, conf.as_bytes()).map_err(|e| e.to_string())
}

/// Stops the server and removes its directory when this process is gone.
fn spawn_watchdog(server: &PgServer, root: &Path) {
    let stop = format!(
        "{} -D '{}' stop -m immediate",
        server.bin_dir.join("pg_ctl").display(),
        server.data_dir.display()
    );
    let stop = if server.install.run_as_postgres {
        format!("runuser -u postgres -- {stop}")
    } else {
        stop
    };
    super::spawn_watchdog(&format!(
        "{stop} >/dev/null 2>&1; rm -rf '{root}'",
        root = root.display()
    ));
}

fn wait_accepting(server: &PgServer) -> Result<(), String> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let ok = Command::new(server.bin_dir.join("pg_isready"))
            .args(["-h", "127.0.0.1", "-p", &server.port.to_string(), "-q"])
            .status()
            .map(|s| s.success())
            .unwrap_or(false);
        if ok {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(format!(
                "server did not accept connections within 30s\n{}",
                server.log_tail()
            ));
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Runs SQL as the superuser through psql on the Unix socket.
pub fn psql(server: &PgServer, db: &str, sql: &str) -> Result<String, String> {
    let out = Command::new(server.bin_dir.join("psql"))
        .args(["-X", "-q", "-A", "-t", "-v", "ON_ERROR_STOP=1"])
        .arg("-h")
        .arg(&server.socket_dir)
        .args([
            "-p",
            &server.port.to_string(),
            "-U",
            "postgres",
            "-d",
            db,
            "-c",
            sql,
        ])
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("cannot run psql: {e}"))?;
    if !out.status.success() {
        return Err(format!("psql failed: {}", String::from_utf8_lossy(&out.stderr)));
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
}

fn create_roles(server: &PgServer) -> Result<(), String> {
    let sql = format!(
        "CREATE ROLE {TRUST_USER} LOGIN REPLICATION;
         CREATE ROLE {} LOGIN REPLICATION PASSWORD '{}';
         SET password_encryption = 'md5';
         CREATE ROLE {} LOGIN REPLICATION PASSWORD '{}';
         SET password_encryption = 'scram-sha-256';
         CREATE ROLE {} LOGIN REPLICATION PASSWORD '{}';",
        CLEARTEXT_USER.0, CLEARTEXT_USER.1, MD5_USER.0, MD5_USER.1, SCRAM_USER.0, SCRAM_USER.1
    );
    psql(server, "postgres", &sql).map(|_| ())
}
