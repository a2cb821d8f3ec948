//! Connection settings from a libpq-style URL.
//!
//! ```text
//! postgres://user:password@host:5432/dbname?sslmode=verify-full&sslrootcert=/etc/ca.pem
//! postgres://user@%2Fvar%2Frun%2Fpostgresql/dbname        (Unix socket directory as host)
//! postgres:///dbname?host=/var/run/postgresql&user=app     (same, as parameters)
//! ```
//!
//! Several servers, tried in order as libpq tries them (a primary and its
//! standbys, so that outboxd follows a promotion):
//!
//! ```text
//! postgres://user@db-a:5432,db-b:5432/dbname?target_session_attrs=read-write
//! postgres://user@/dbname?host=db-a,db-b&port=5432,5433&target_session_attrs=read-write
//! ```
//!
//! Supported parameters: `host` and `port` (comma-separated lists; one port
//! serves every host), `user`, `password`, `dbname`, `sslmode` (disable,
//! prefer, require, verify-ca, verify-full), `sslrootcert` (a PEM file, or
//! `system` for the operating system's store), `application_name`,
//! `connect_timeout` (seconds, per server) and `target_session_attrs`
//! (`any`, the default, or `read-write`: skip servers that answer
//! `transaction_read_only = on`, such as a standby). Anything else is
//! rejected so that a typo never silently weakens the connection.

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;

/// How long a server may stay silent at the TCP level before the socket
/// probes it, and how long unacknowledged data may wait: a primary whose
/// host died is noticed in about 20 s, not after minutes of
/// retransmissions. (A server that is alive but busy still answers the
/// probes, so this never ends a session that decodes a large transaction.)
pub const TCP_KEEPALIVE_IDLE: Duration = Duration::from_secs(10);
pub const TCP_KEEPALIVE_INTERVAL: Duration = Duration::from_secs(3);
pub const TCP_KEEPALIVE_RETRIES: u32 = 3;
pub const TCP_USER_TIMEOUT: Duration = Duration::from_secs(20);

/// Where the server listens.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PgHost {
    /// A host name or IP address.
    Tcp(String),
    /// A directory holding the `.s.PGSQL.<port>` socket.
    Unix(PathBuf),
}

/// One server to try: a host (or socket directory) and its port.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Endpoint {
    pub host: PgHost,
    pub port: u16,
}

impl fmt::Display for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.host {
            PgHost::Tcp(h) if h.contains(':') => write!(f, "[{h}]:{}", self.port),
            PgHost::Tcp(h) => write!(f, "{h}:{}", self.port),
            PgHost::Unix(d) => write!(f, "{}/.s.PGSQL.{}", d.display(), self.port),
        }
    }
}

/// libpq's `target_session_attrs`: which of the listed servers will do.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum TargetSessionAttrs {
    /// The first server that accepts the connection.
    #[default]
    Any,
    /// The first server whose sessions can write (`transaction_read_only`
    /// is off): the primary, never a standby.
    ReadWrite,
}

impl FromStr for TargetSessionAttrs {
    type Err = ConnInfoError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "any" => Ok(TargetSessionAttrs::Any),
            "read-write" => Ok(TargetSessionAttrs::ReadWrite),
            "read-only" | "primary" | "standby" | "prefer-standby" => Err(ConnInfoError::Invalid {
                param: "target_session_attrs",
                reason: format!(
                    "{s:?} is not supported: outboxd needs the primary, so use read-write (or any)"
                ),
            }),
            other => Err(ConnInfoError::Invalid {
                param: "target_session_attrs",
                reason: format!("{other:?} is not one of any, read-write"),
            }),
        }
    }
}

/// libpq's `sslmode`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum SslMode {
    /// Never use TLS.
    Disable,
    /// Use TLS when the server offers it, without verifying the certificate.
    #[default]
    Prefer,
    /// Require TLS, without verifying the certificate.
    Require,
    /// Require TLS and a certificate signed by a trusted CA.
    VerifyCa,
    /// Require TLS, a trusted certificate, and a host name that matches it.
    VerifyFull,
}

impl FromStr for SslMode {
    type Err = ConnInfoError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(match s {
            "disable" => SslMode::Disable,
            "prefer" => SslMode::Prefer,
            "require" => SslMode::Require,
            "verify-ca" => SslMode::VerifyCa,
            "verify-full" => SslMode::VerifyFull,
            "allow" => {
                return Err(ConnInfoError::Invalid {
                    param: "sslmode",
                    reason: "\"allow\" is not supported: use prefer or require".into(),
                })
            }
            other => {
                return Err(ConnInfoError::Invalid {
                    param: "sslmode",
                    reason: format!(
                        "{other:?} is not one of disable, prefer, require, verify-ca, verify-full"
                    ),
                })
            }
        })
    }
}

/// Where trusted CA certificates come from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SslRootCert {
    File(PathBuf),
    System,
}

/// Parsed connection settings. `Debug` never prints the password.
#[derive(Clone, PartialEq, Eq)]
pub struct PgConnectConfig {
    /// The servers to try, in order; never empty.
    pub hosts: Vec<Endpoint>,
    pub target_session_attrs: TargetSessionAttrs,
    pub user: String,
    pub password: Option<String>,
    pub dbname: String,
    pub sslmode: SslMode,
    pub sslrootcert: Option<SslRootCert>,
    pub application_name: String,
    pub connect_timeout: Duration,
}

impl fmt::Debug for PgConnectConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PgConnectConfig")
            .field("hosts", &self.hosts)
            .field("target_session_attrs", &self.target_session_attrs)
            .field("user", &self.user)
            .field("password", &self.password.as_ref().map(|_| "<redacted>"))
            .field("dbname", &self.dbname)
            .field("sslmode", &self.sslmode)
            .field("sslrootcert", &self.sslrootcert)
            .finish()
    }
}

/// The connection URL could not be used.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ConnInfoError {
    #[error("postgres url is not a valid URL: {0}; expected postgres://user:password@host:5432/dbname")]
    Url(String),
    #[error("postgres url must start with postgres:// or postgresql://, not {0}://")]
    Scheme(String),
    #[error("postgres url has no user: write postgres://USER@host/dbname or add ?user=USER")]
    NoUser,
    #[error("postgres url parameter {param}: {reason}")]
    Invalid { param: &'static str, reason: String },
    #[error("postgres url parameter {0:?} is not supported (supported: host, port, user, password, dbname, sslmode, sslrootcert, application_name, connect_timeout, target_session_attrs)")]
    UnknownParam(String),
}

/// Percent-decoding as libpq does it: `%XX` only. A `+` stays a plus (it
/// is a space only in HTML form encoding, which libpq does not use).
fn decode(s: &str) -> String {
    percent_encoding::percent_decode_str(s)
        .decode_utf8_lossy()
        .into_owned()
}

/// The query's `key=value` pairs, percent-decoded as libpq does.
fn query_pairs(url: &url::Url) -> impl Iterator<Item = (String, String)> + '_ {
    url.query()
        .unwrap_or_default()
        .split('&')
        .filter(|kv| !kv.is_empty())
        .map(|kv| {
            let (k, v) = kv.split_once('=').unwrap_or((kv, ""));
            (decode(k), decode(v))
        })
}

/// Splits `scheme://userinfo@hostlist/...` into the same URL with one
/// placeholder host (for the URL parser) and the host list's text.
fn split_hostlist(s: &str) -> (String, Option<String>) {
    let Some(scheme_end) = s.find("://") else {
        return (s.to_owned(), None);
    };
    let after = &s[scheme_end + 3..];
    let authority_end = after.find(['/', '?', '#']).unwrap_or(after.len());
    let authority = &after[..authority_end];
    let (userinfo, hostlist) = match authority.rfind('@') {
        Some(i) => (&authority[..=i], &authority[i + 1..]),
        None => ("", authority),
    };
    if authority.is_empty() {
        return (s.to_owned(), None);
    }
    // `user@/db?host=...` has a user and no host: libpq takes it.
    let rest = &after[authority_end..];
    (
        format!("{}://{userinfo}placeholder{rest}", &s[..scheme_end]),
        Some(hostlist.to_owned()).filter(|h| !h.is_empty()),
    )
}

/// `host[:port],[v6]:port,...` into hosts and their ports.
fn parse_hostlist(list: &str) -> Result<(Vec<String>, Vec<Option<u16>>), ConnInfoError> {
    let mut hosts = Vec::new();
    let mut ports = Vec::new();
    for item in list.split(',') {
        let (host, port) = if let Some(v6) = item.strip_prefix('[') {
            let (h, rest) = v6.split_once(']').ok_or_else(|| ConnInfoError::Invalid {
                param: "host",
                reason: "an IPv6 address has no closing ]".into(),
            })?;
            (h, rest.strip_prefix(':').unwrap_or(""))
        } else {
            item.split_once(':').unwrap_or((item, ""))
        };
        hosts.push(decode(host));
        // The text after a host's colon may be a password cut short by an
        // unencoded '/', '?' or '#': the error never repeats it.
        ports.push(parse_port(port).map_err(|_| ConnInfoError::Invalid {
            param: "port",
            reason: "a host's port is not a number; if the password holds '/', '?', '#' or '@', percent-encode it (%2F, %3F, %23, %40)".into(),
        })?);
    }
    Ok((hosts, ports))
}

/// A port from a list; empty means the default.
fn parse_port(p: &str) -> Result<Option<u16>, ConnInfoError> {
    if p.is_empty() {
        return Ok(None);
    }
    p.parse().map(Some).map_err(|_| ConnInfoError::Invalid {
        param: "port",
        reason: format!("{p:?} is not a port number"),
    })
}

/// Pairs hosts with ports as libpq does: one port serves every host,
/// otherwise one port per host.
fn endpoints(hosts: Vec<String>, ports: Vec<Option<u16>>) -> Result<Vec<Endpoint>, ConnInfoError> {
    let hosts = if hosts.is_empty() {
        vec!["localhost".to_owned()]
    } else {
        hosts
    };
    if ports.len() > 1 && ports.len() != hosts.len() {
        return Err(ConnInfoError::Invalid {
            param: "port",
            reason: format!(
                "{} ports for {} hosts: give one port for all, or one per host",
                ports.len(),
                hosts.len()
            ),
        });
    }
    hosts
        .into_iter()
        .enumerate()
        .map(|(i, h)| {
            let port = ports.get(i).or(ports.first()).copied().flatten().unwrap_or(5432);
            let host = match h {
                h if h.is_empty() => {
                    return Err(ConnInfoError::Invalid {
                        param: "host",
                        reason: "an empty host in the list".into(),
                    })
                }
                h if h.starts_with('/') => PgHost::Unix(PathBuf::from(h)),
                h => PgHost::Tcp(h),
            };
            Ok(Endpoint { host, port })
        })
        .collect()
}

impl FromStr for PgConnectConfig {
    type Err = ConnInfoError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        // The URL parser takes one host; the list is read here.
        let (one_host, hostlist) = split_hostlist(s);
        let url = url::Url::parse(&one_host).map_err(|e| ConnInfoError::Url(e.to_string()))?;
        if url.scheme() != "postgres" && url.scheme() != "postgresql" {
            return Err(ConnInfoError::Scheme(url.scheme().to_owned()));
        }
        let (mut hosts, mut ports) = match hostlist {
            Some(list) => parse_hostlist(&list)?,
            None => (Vec::new(), Vec::new()),
        };
        let mut target_session_attrs = TargetSessionAttrs::default();
        let mut user = Some(decode(url.username())).filter(|u| !u.is_empty());
        let mut password = url.password().map(decode);
        let path = url.path().trim_start_matches('/');
        let mut dbname = Some(decode(path)).filter(|d| !d.is_empty());
        let mut sslmode = SslMode::default();
        let mut sslrootcert = None;
        let mut application_name = "outboxd".to_owned();
        let mut connect_timeout = Duration::from_secs(10);

        for (k, v) in query_pairs(&url) {
            match k.as_str() {
                "host" => hosts = v.split(',').map(str::to_owned).collect(),
                "port" => ports = v.split(',').map(parse_port).collect::<Result<_, _>>()?,
                "target_session_attrs" => target_session_attrs = v.parse()?,
                "user" => user = Some(v),
                "password" => password = Some(v),
                "dbname" => dbname = Some(v),
                "sslmode" => sslmode = v.parse()?,
                "sslrootcert" => {
                    sslrootcert = Some(if v == "system" {
                        SslRootCert::System
                    } else {
                        SslRootCert::File(PathBuf::from(v))
                    })
                }
                "application_name" => application_name = v,
                "connect_timeout" => {
                    let secs: u64 = v.parse().map_err(|_| ConnInfoError::Invalid {
                        param: "connect_timeout",
                        reason: format!("{v:?} is not a whole number of seconds"),
                    })?;
                    connect_timeout = Duration::from_secs(secs.max(1));
                }
                other => return Err(ConnInfoError::UnknownParam(other.to_owned())),
            }
        }

        let user = user.ok_or(ConnInfoError::NoUser)?;
        Ok(PgConnectConfig {
            hosts: endpoints(hosts, ports)?,
            target_session_attrs,
            dbname: dbname.unwrap_or_else(|| user.clone()),
            user,
            password,
            sslmode,
            sslrootcert,
            application_name,
            connect_timeout,
        })
    }
}

impl PgConnectConfig {
    /// A printable description of the target, without credentials.
    pub fn target(&self) -> String {
        let servers: Vec<String> = self.hosts.iter().map(Endpoint::to_string).collect();
        format!(
            "{} (database {:?}, user {:?})",
            servers.join(", "),
            self.dbname,
            self.user
        )
    }

    /// The first server: the one a single-server connection uses.
    pub fn endpoint(&self) -> &Endpoint {
        &self.hosts[0]
    }

    /// The same settings for each server alone, in the order to try them.
    pub fn each_server(&self) -> impl Iterator<Item = PgConnectConfig> + '_ {
        self.hosts.iter().map(|e| PgConnectConfig {
            hosts: vec![e.clone()],
            ..self.clone()
        })
    }

    /// Settings for an ordinary (non-replication) tokio-postgres
    /// connection; it tries the servers in order and, with `read-write`,
    /// skips read-only ones, as libpq does.
    pub fn to_tokio_postgres(&self) -> tokio_postgres::Config {
        let mut c = tokio_postgres::Config::new();
        for e in &self.hosts {
            match &e.host {
                PgHost::Tcp(h) => {
                    c.host(h);
                }
                PgHost::Unix(d) => {
                    c.host_path(d);
                }
            }
            c.port(e.port);
        }
        c.user(&self.user)
            .dbname(&self.dbname)
            .application_name(&self.application_name)
            .connect_timeout(self.connect_timeout)
            // As on the replication socket: a vanished host is noticed.
            .keepalives(true)
            .keepalives_idle(TCP_KEEPALIVE_IDLE)
            .keepalives_interval(TCP_KEEPALIVE_INTERVAL)
            .keepalives_retries(TCP_KEEPALIVE_RETRIES)
            .target_session_attrs(match self.target_session_attrs {
                TargetSessionAttrs::Any => tokio_postgres::config::TargetSessionAttrs::Any,
                TargetSessionAttrs::ReadWrite => tokio_postgres::config::TargetSessionAttrs::ReadWrite,
            });
        if let Some(p) = &self.password {
            c.password(p);
        }
        // tokio-postgres has one TLS mode for all hosts; socket
        // directories alone never use TLS (nor does libpq).
        let unix_only = self.hosts.iter().all(|e| matches!(e.host, PgHost::Unix(_)));
        let mode = match (unix_only, self.sslmode) {
            (true, _) | (_, SslMode::Disable) => tokio_postgres::config::SslMode::Disable,
            (_, SslMode::Prefer) => tokio_postgres::config::SslMode::Prefer,
            _ => tokio_postgres::config::SslMode::Require,
        };
        c.ssl_mode(mode);
        c
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(s: &str) -> PgConnectConfig {
        s.parse().unwrap()
    }

    #[test]
    fn full_tcp_url() {
        let c = parse("postgres://app:p%40ss@db.example:6432/orders?sslmode=verify-full&sslrootcert=/ca.pem&connect_timeout=3&application_name=x");
        assert_eq!(
            c.hosts,
            vec![Endpoint {
                host: PgHost::Tcp("db.example".into()),
                port: 6432
            }]
        );
        assert_eq!(c.target_session_attrs, TargetSessionAttrs::Any);
        assert_eq!(c.user, "app");
        assert_eq!(c.password.as_deref(), Some("p@ss"));
        assert_eq!(c.dbname, "orders");
        assert_eq!(c.sslmode, SslMode::VerifyFull);
        assert_eq!(c.sslrootcert, Some(SslRootCert::File("/ca.pem".into())));
        assert_eq!(c.connect_timeout, Duration::from_secs(3));
        assert_eq!(c.application_name, "x");
        assert!(!format!("{c:?}").contains("p@ss"));
    }

    #[test]
    fn unix_socket_forms() {
        let a = parse("postgres://app@%2Ftmp%2Fpg/db");
        assert_eq!(a.endpoint().host, PgHost::Unix("/tmp/pg".into()));
        let b = parse("postgresql:///db?host=/tmp/pg&port=5433&user=app");
        assert_eq!(
            b.hosts,
            vec![Endpoint {
                host: PgHost::Unix("/tmp/pg".into()),
                port: 5433
            }]
        );
        assert_eq!(b.dbname, "db");
        assert!(b.target().contains("/tmp/pg/.s.PGSQL.5433"));
    }

    #[test]
    fn defaults() {
        let c = parse("postgres://app@localhost");
        assert_eq!(c.endpoint().port, 5432);
        assert_eq!(c.dbname, "app");
        assert_eq!(c.sslmode, SslMode::Prefer);
        assert_eq!(c.password, None);
    }

    #[test]
    fn errors_name_the_problem() {
        let err = |s: &str| s.parse::<PgConnectConfig>().unwrap_err().to_string();
        assert!(err("mysql://a@b/c").contains("postgres://"));
        assert!(err("postgres://localhost/db").contains("no user"));
        assert!(err("postgres://a@h/db?sslmode=bogus").contains("sslmode"));
        assert!(err("postgres://a@h/db?sslmod=require").contains("\"sslmod\""));
        assert!(err("postgres://a@h/db?port=x").contains("port"));
        assert!(err("postgres://a@h1,h2/db?port=1,2,3").contains("3 ports for 2 hosts"));
        assert!(err("postgres://a@h1,,h2/db").contains("empty host"));
        assert!(err("postgres://a@h1:x/db").contains("port"));
        // A password cut short by an unencoded '/' is never repeated.
        let cut = err("postgres://app:hunter2/x@h/db");
        assert!(
            cut.contains("percent-encode") && !cut.contains("hunter2"),
            "{cut}"
        );
        let cut = err("postgres://app:[hunter2/x@h/db");
        assert!(!cut.contains("hunter2"), "{cut}");
        assert!(err("postgres://a@h/db?target_session_attrs=standby").contains("read-write"));
        assert!(err("postgres://a@h/db?target_session_attrs=rw").contains("any, read-write"));
        assert!(err("not a url").contains("not a valid URL"));
    }

    #[test]
    fn several_hosts_as_libpq_lists_them() {
        let tcp = |h: &str, port| Endpoint {
            host: PgHost::Tcp(h.into()),
            port,
        };
        let a = parse("postgres://app:pw@db-a:5433,db-b,[::1]:6000/orders?target_session_attrs=read-write");
        assert_eq!(
            a.hosts,
            vec![tcp("db-a", 5433), tcp("db-b", 5432), tcp("::1", 6000)]
        );
        assert_eq!(a.target_session_attrs, TargetSessionAttrs::ReadWrite);
        assert_eq!(
            (a.user.as_str(), a.password.as_deref(), a.dbname.as_str()),
            ("app", Some("pw"), "orders")
        );
        assert_eq!(
            a.target(),
            "db-a:5433, db-b:5432, [::1]:6000 (database \"orders\", user \"app\")"
        );
        // One port serves every host; one per host pairs them.
        let b = parse("postgres://app@/db?host=x,y&port=7000");
        assert_eq!(b.hosts, vec![tcp("x", 7000), tcp("y", 7000)]);
        let c = parse("postgres://app@/db?host=x,/tmp/pg&port=7000,7001");
        assert_eq!(
            c.hosts,
            vec![
                tcp("x", 7000),
                Endpoint {
                    host: PgHost::Unix("/tmp/pg".into()),
                    port: 7001
                }
            ]
        );
        // Each server alone, in order, with every other setting kept.
        let each: Vec<PgConnectConfig> = a.each_server().collect();
        assert_eq!(each.len(), 3);
        assert_eq!(each[1].hosts, vec![tcp("db-b", 5432)]);
        assert_eq!(each[1].password.as_deref(), Some("pw"));
        // A password with an @ and a comma stays the password.
        let d = parse("postgres://app:p%40ss%2Cw@h1,h2/db");
        assert_eq!(d.password.as_deref(), Some("p@ss,w"));
        assert_eq!(d.hosts.len(), 2);
        // tokio-postgres gets the same list.
        let t = a.to_tokio_postgres();
        assert_eq!(t.get_hosts().len(), 3);
        assert_eq!(t.get_ports(), &[5433, 5432, 6000]);
        assert_eq!(
            t.get_target_session_attrs(),
            tokio_postgres::config::TargetSessionAttrs::ReadWrite
        );
    }

    #[test]
    fn decoding_follows_libpq_not_html_forms() {
        // '+' is a plus; %2B, %26, %3D, %40, %2F, %25 and UTF-8 decode.
        let c =
            parse("postgres://us%2Ber+1:p+w%26d%3D%40%2F%25%C3%BC@db/or+ders%20x?application_name=a+b%26c");
        assert_eq!(c.user, "us+er+1");
        assert_eq!(c.password.as_deref(), Some("p+w&d=@/%ü"));
        assert_eq!(c.dbname, "or+ders x");
        assert_eq!(c.application_name, "a+b&c");
        let q = parse("postgres://app@h/db?password=a%2Bb+c%26d&user=x%3Dy");
        assert_eq!(q.password.as_deref(), Some("a+b+c&d"));
        assert_eq!(q.user, "x=y");
    }
}
