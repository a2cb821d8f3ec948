//! The Confluent Schema Registry REST API, the few calls outboxd makes:
//! a subject's version, a schema by id, registering a schema.
//!
//! Requests are blocking (ureq, the HTTP client outboxd already has); the
//! [`super::Registry`] runs them on tokio's blocking pool, rarely: each
//! answer is cached. Every request is bounded in time
//! (`schema_registry.timeout`) and every answer in size
//! ([`MAX_RESPONSE_BYTES`]). No error carries a credential: the URL holds
//! none (the config refuses one) and headers are never printed.

use std::sync::Arc;

use base64::Engine;
use percent_encoding::{utf8_percent_encode, NON_ALPHANUMERIC};
use serde::Deserialize;

use crate::config::SchemaRegistryConfig;

/// The largest answer outboxd reads from the registry.
pub const MAX_RESPONSE_BYTES: u64 = 8 << 20;

/// A schema as the registry serves it.
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct Served {
    /// Absent on `GET /schemas/ids/{id}`, which is asked by id.
    #[serde(default)]
    pub id: Option<u32>,
    #[serde(default)]
    pub version: Option<u32>,
    pub schema: String,
    /// `AVRO` when absent.
    #[serde(default)]
    pub schema_type: Option<String>,
    #[serde(default)]
    pub references: Vec<serde_json::Value>,
}

/// What went wrong talking to the registry.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum ClientError {
    /// Worth retrying: the registry is down, slow, or overloaded.
    #[error("the Schema Registry at {url} is unavailable: {reason}")]
    Unavailable { url: String, reason: String },
    #[error("the Schema Registry at {url} refused outboxd's credentials (HTTP {status}); check schema_registry.username and schema_registry.password, or schema_registry.token")]
    Unauthorized { url: String, status: u16 },
    #[error("{what} is not in the Schema Registry at {url}: {message}")]
    NotFound {
        url: String,
        what: String,
        message: String,
    },
    #[error("the Schema Registry at {url} refused {what} (HTTP {status}, error code {code}): {message}")]
    Refused {
        url: String,
        what: String,
        status: u16,
        code: i64,
        message: String,
    },
    #[error("the Schema Registry at {url} answered {what} with something outboxd cannot read: {reason}; is schema_registry.url the API's base URL (Apicurio: .../apis/ccompat/v7)?")]
    Unreadable {
        url: String,
        what: String,
        reason: String,
    },
    /// The request cannot be made, or its answer cannot be taken, however
    /// often it is tried.
    #[error("{what} at the Schema Registry {url} cannot work: {reason}")]
    Impossible {
        url: String,
        what: String,
        reason: String,
    },
}

impl ClientError {
    /// Worth waiting for: the registry is away, or answered with
    /// something that is not its API (a proxy's maintenance page).
    pub fn is_transient(&self) -> bool {
        matches!(
            self,
            ClientError::Unavailable { .. } | ClientError::Unreadable { .. }
        )
    }
}

#[derive(Deserialize)]
struct ErrorBody {
    #[serde(default)]
    error_code: i64,
    #[serde(default)]
    message: String,
}

#[derive(Deserialize)]
struct Registered {
    id: u32,
}

/// A registry client.
#[derive(Clone)]
pub struct Client {
    agent: ureq::Agent,
    base: String,
    auth: Option<Arc<str>>,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client")
            .field("base", &self.base)
            .finish_non_exhaustive()
    }
}

fn segment(s: &str) -> String {
    utf8_percent_encode(s, NON_ALPHANUMERIC).to_string()
}

impl Client {
    /// A client for `[schema_registry]`. Fails only on a CA file that
    /// holds no certificate.
    pub fn new(cfg: &SchemaRegistryConfig) -> Result<Client, String> {
        let auth = match (&cfg.username, &cfg.password, &cfg.token) {
            (_, _, Some(token)) => Some(format!("Bearer {}", token.0)),
            (Some(user), Some(password), None) => Some(format!(
                "Basic {}",
                base64::engine::general_purpose::STANDARD.encode(format!("{user}:{}", password.0))
            )),
            _ => None,
        };
        let mut tls = ureq::tls::TlsConfig::builder()
            .provider(ureq::tls::TlsProvider::Rustls)
            .unversioned_rustls_crypto_provider(Arc::new(rustls::crypto::ring::default_provider()));
        let roots: Vec<ureq::tls::Certificate<'static>> = match &cfg.ca_file {
            Some(path) => {
                let pem =
                    std::fs::read(path).map_err(|e| format!("schema_registry.ca_file {path:?}: {e}"))?;
                let certs: Vec<_> = ureq::tls::parse_pem(&pem)
                    .filter_map(|item| match item {
                        Ok(ureq::tls::PemItem::Certificate(c)) => Some(c),
                        _ => None,
                    })
                    .collect();
                if certs.is_empty() {
                    return Err(format!(
                        "schema_registry.ca_file {path:?} holds no PEM certificate"
                    ));
                }
                certs
            }
            None => rustls_native_certs::load_native_certs()
                .certs
                .into_iter()
                .map(|c| ureq::tls::Certificate::from_der(c.as_ref()).to_owned())
                .collect(),
        };
        tls = tls.root_certs(ureq::tls::RootCerts::new_with_certs(&roots));
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .timeout_global(Some(cfg.timeout.0))
            .http_status_as_error(false)
            .tls_config(tls.build())
            .user_agent(concat!("outboxd/", env!("CARGO_PKG_VERSION")))
            .build()
            .into();
        Ok(Client {
            agent,
            base: cfg.url.trim_end_matches('/').to_owned(),
            auth: auth.map(Into::into),
        })
    }

    /// The base URL, for messages.
    pub fn url(&self) -> &str {
        &self.base
    }

    /// `GET /subjects/{subject}/versions/{version or latest}`.
    pub fn version(&self, subject: &str, version: Option<u32>) -> Result<Served, ClientError> {
        let v = version.map_or_else(|| "latest".to_owned(), |v| v.to_string());
        let what = format!("version {v} of subject {subject:?}");
        let body = self.call(
            "GET",
            &format!("/subjects/{}/versions/{v}", segment(subject)),
            None,
            &what,
        )?;
        self.read(&body, &what)
    }

    /// `GET /schemas/ids/{id}`.
    pub fn by_id(&self, id: u32) -> Result<Served, ClientError> {
        let what = format!("schema id {id}");
        let body = self.call("GET", &format!("/schemas/ids/{id}"), None, &what)?;
        let mut s: Served = self.read(&body, &what)?;
        s.id = Some(id);
        Ok(s)
    }

    /// `GET /schemas/ids/{id}/versions`: the (subject, version) pairs
    /// that hold schema `id`.
    pub fn versions_of_id(&self, id: u32) -> Result<Vec<(String, u32)>, ClientError> {
        #[derive(serde::Deserialize)]
        struct SubjectVersion {
            subject: String,
            version: u32,
        }
        let what = format!("the subjects of schema id {id}");
        let body = self.call("GET", &format!("/schemas/ids/{id}/versions"), None, &what)?;
        let list: Vec<SubjectVersion> = self.read(&body, &what)?;
        Ok(list.into_iter().map(|v| (v.subject, v.version)).collect())
    }

    /// `GET /subjects`: how many subjects the registry holds (proves it
    /// answers and takes outboxd's credentials).
    pub fn subjects(&self) -> Result<usize, ClientError> {
        let what = "the list of subjects".to_owned();
        let body = self.call("GET", "/subjects", None, &what)?;
        let list: Vec<String> = self.read(&body, &what)?;
        Ok(list.len())
    }

    /// `POST /subjects/{subject}/versions`: registers `schema` (or finds it
    /// registered) and returns its id.
    pub fn register(&self, subject: &str, schema: &str, schema_type: &str) -> Result<u32, ClientError> {
        let what = format!("registering a schema under subject {subject:?}");
        self.post_schema(
            &format!("/subjects/{}/versions", segment(subject)),
            schema,
            schema_type,
            &what,
        )
    }

    /// The id of `schema` if it is registered under `subject` (`POST
    /// /subjects/{subject}`), without registering it.
    pub fn lookup(&self, subject: &str, schema: &str, schema_type: &str) -> Result<u32, ClientError> {
        let what = format!("the schema {schema} under subject {subject:?}");
        self.post_schema(
            &format!("/subjects/{}", segment(subject)),
            schema,
            schema_type,
            &what,
        )
    }

    /// Posts a schema to `path`; the id the registry answers with.
    fn post_schema(
        &self,
        path: &str,
        schema: &str,
        schema_type: &str,
        what: &str,
    ) -> Result<u32, ClientError> {
        let body = serde_json::json!({"schema": schema, "schemaType": schema_type}).to_string();
        let answer = self.call("POST", path, Some(body), what)?;
        let r: Registered = self.read(&answer, what)?;
        Ok(r.id)
    }

    fn read<T: serde::de::DeserializeOwned>(&self, body: &str, what: &str) -> Result<T, ClientError> {
        serde_json::from_str(body).map_err(|e| ClientError::Unreadable {
            url: self.base.clone(),
            what: what.to_owned(),
            reason: e.to_string(),
        })
    }

    fn call(
        &self,
        method: &str,
        path: &str,
        body: Option<String>,
        what: &str,
    ) -> Result<String, ClientError> {
        let url = format!("{}{path}", self.base);
        let unavailable = |reason: String| ClientError::Unavailable {
            url: self.base.clone(),
            reason,
        };
        let mut req = http::Request::builder().method(method).uri(&url).header(
            "Accept",
            "application/vnd.schemaregistry.v1+json, application/json",
        );
        if let Some(a) = &self.auth {
            req = req.header("Authorization", a.as_ref());
        }
        if body.is_some() {
            req = req.header("Content-Type", "application/vnd.schemaregistry.v1+json");
        }
        let req = req
            .body(body.unwrap_or_default())
            .map_err(|e| ClientError::Impossible {
                url: self.base.clone(),
                what: what.to_owned(),
                reason: format!("the request cannot be built ({e}): check schema_registry.username, password and token for characters a header cannot hold"),
            })?;
        let mut resp = self.agent.run(req).map_err(|e| unavailable(e.to_string()))?;
        let status = resp.status().as_u16();
        let text = resp
            .body_mut()
            .with_config()
            .limit(MAX_RESPONSE_BYTES)
            .read_to_string()
            .map_err(|e| match e {
                ureq::Error::BodyExceedsLimit(_) => ClientError::Impossible {
                    url: self.base.clone(),
                    what: what.to_owned(),
                    reason: format!("the answer is larger than {MAX_RESPONSE_BYTES} bytes"),
                },
                other => unavailable(other.to_string()),
            })?;
        if (200..300).contains(&status) {
            return Ok(text);
        }
        let err: ErrorBody = serde_json::from_str(&text).unwrap_or(ErrorBody {
            error_code: 0,
            message: text.chars().take(200).collect(),
        });
        Err(match status {
            401 | 403 => ClientError::Unauthorized {
                url: self.base.clone(),
                status,
            },
            404 => ClientError::NotFound {
                url: self.base.clone(),
                what: what.to_owned(),
                message: err.message,
            },
            408 | 429 | 500..=599 => unavailable(format!("HTTP {status}: {}", err.message)),
            _ => ClientError::Refused {
                url: self.base.clone(),
                what: what.to_owned(),
                status,
                code: err.error_code,
                message: err.message,
            },
        })
    }
}
