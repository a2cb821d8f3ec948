//! Connection settings from a libpq-style URL.
//!
//! ```text
//! postgres://user:password@host:5432/dbname?sslmode=verify-full&sslrootcert=/etc/ca.pem
//! postgres://user@%2Fvar%2Frun%2Fpostgresql/dbname        (Unix socket directory as host)
//! postgres:///dbname?host=/var/run/postgresql&user=app     (same, as parameters)
//! ```
//!
//! Supported parameters: `host`, `port`, `user`, `password`, `dbname`,
//! `sslmode` (disable, prefer, require, verify-ca, verify-full),
//! `sslrootcert` (a PEM file, or `system` for the operating system's store),
//! `application_name` and `connect_timeout` (seconds). Anything else is
//! rejected so that a typo never silently weakens the connection.

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;

/// Where the server listens.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PgHost {
    /// A host name or IP address.
    Tcp(String),
    /// A directory holding the `.s.PGSQL.<port>` socket.
    Unix(PathBuf),
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
    pub host: PgHost,
    pub port: u16,
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
            .field("host", &self.host)
            .field("port", &self.port)
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
    #[error("postgres url parameter {0:?} is not supported (supported: host, port, user, password, dbname, sslmode, sslrootcert, application_name, connect_timeout)")]
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

impl FromStr for PgConnectConfig {
    type Err = ConnInfoError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let url = url::Url::parse(s).map_err(|e| ConnInfoError::Url(e.to_string()))?;
        if url.scheme() != "postgres" && url.scheme() != "postgresql" {
            return Err(ConnInfoError::Scheme(url.scheme().to_owned()));
        }
        let host_text = url.host_str().map(|h| {
            // url keeps IPv6 brackets and percent-encoding in opaque hosts.
            decode(h.trim_start_matches('[').trim_end_matches(']'))
        });
        let mut host = host_text.filter(|h| !h.is_empty());
        let mut port = url.port();
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
                "host" => host = Some(v),
                "port" => {
                    port = Some(v.parse().map_err(|_| ConnInfoError::Invalid {
                        param: "port",
                        reason: format!("{v:?} is not a port number"),
                    })?)
                }
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
        let host = match host {
            Some(h) if h.starts_with('/') => PgHost::Unix(PathBuf::from(h)),
            Some(h) if h.contains(',') => {
                return Err(ConnInfoError::Invalid {
                    param: "host",
                    reason: "several hosts are not supported: point outboxd at the primary".into(),
                })
            }
            Some(h) => PgHost::Tcp(h),
            None => PgHost::Tcp("localhost".to_owned()),
        };
        Ok(PgConnectConfig {
            host,
            port: port.unwrap_or(5432),
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
        match &self.host {
            PgHost::Tcp(h) => format!(
                "{h}:{} (database {:?}, user {:?})",
                self.port, self.dbname, self.user
            ),
            PgHost::Unix(d) => format!(
                "{}/.s.PGSQL.{} (database {:?}, user {:?})",
                d.display(),
                self.port,
                self.dbname,
                self.user
            ),
        }
    }

    /// Settings for an ordinary (non-replication) tokio-postgres connection.
    pub fn to_tokio_postgres(&self) -> tokio_postgres::Config {
        let mut c = tokio_postgres::Config::new();
        match &self.host {
            PgHost::Tcp(h) => {
                c.host(h);
            }
            PgHost::Unix(d) => {
                c.host_path(d);
            }
        }
        c.port(self.port)
            .user(&self.user)
            .dbname(&self.dbname)
            .application_name(&self.application_name)
            .connect_timeout(self.connect_timeout);
        if let Some(p) = &self.password {
            c.password(p);
        }
        let mode = match (&self.host, self.sslmode) {
            (PgHost::Unix(_), _) | (_, SslMode::Disable) => tokio_postgres::config::SslMode::Disable,
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
        assert_eq!(c.host, PgHost::Tcp("db.example".into()));
        assert_eq!(c.port, 6432);
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
        assert_eq!(a.host, PgHost::Unix("/tmp/pg".into()));
        let b = parse("postgresql:///db?host=/tmp/pg&port=5433&user=app");
        assert_eq!(b.host, PgHost::Unix("/tmp/pg".into()));
        assert_eq!(b.port, 5433);
        assert_eq!(b.dbname, "db");
        assert!(b.target().contains("/tmp/pg/.s.PGSQL.5433"));
    }

    #[test]
    fn defaults() {
        let c = parse("postgres://app@localhost");
        assert_eq!(c.port, 5432);
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
        assert!(err("postgres://a@h1,h2/db").contains("several hosts"));
        assert!(err("not a url").contains("not a valid URL"));
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
