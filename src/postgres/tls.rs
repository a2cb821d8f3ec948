//! TLS client settings that follow libpq's `sslmode` rules.
//!
//! | sslmode       | encrypted          | certificate chain | host name |
//! |---------------|--------------------|-------------------|-----------|
//! | `disable`     | no                 | -                 | -         |
//! | `prefer`      | if the server can  | not checked       | not checked |
//! | `require`     | yes                | not checked       | not checked |
//! | `verify-ca`   | yes                | checked           | not checked |
//! | `verify-full` | yes                | checked           | checked   |
//!
//! Trusted roots come from `sslrootcert` (a PEM file, or `system`); like
//! libpq, the default is `~/.postgresql/root.crt`.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::WebPkiServerVerifier;
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{CertificateError, ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme};

use crate::config::conninfo::{PgConnectConfig, SslMode, SslRootCert};

/// TLS could not be set up from the configuration.
#[derive(Debug, thiserror::Error)]
pub enum TlsConfigError {
    #[error("sslmode={mode} needs trusted CA certificates: set sslrootcert=/path/to/ca.pem (or sslrootcert=system) in the postgres url; {path} does not exist")]
    NoRootCert { mode: &'static str, path: String },
    #[error("cannot read sslrootcert {path}: {reason}")]
    RootCert { path: String, reason: String },
    #[error("sslrootcert {0} holds no certificate")]
    EmptyRootCert(String),
    #[error("cannot load the system's CA certificates: {0}")]
    System(String),
    #[error("TLS setup failed: {0}")]
    Rustls(#[from] rustls::Error),
}

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn mode_name(mode: SslMode) -> &'static str {
    match mode {
        SslMode::Disable => "disable",
        SslMode::Prefer => "prefer",
        SslMode::Require => "require",
        SslMode::VerifyCa => "verify-ca",
        SslMode::VerifyFull => "verify-full",
    }
}

fn default_root_cert() -> PathBuf {
    let home = std::env::var_os("HOME").unwrap_or_default();
    Path::new(&home).join(".postgresql").join("root.crt")
}

fn load_roots(cfg: &PgConnectConfig) -> Result<RootCertStore, TlsConfigError> {
    let mut roots = RootCertStore::empty();
    let path = match &cfg.sslrootcert {
        Some(SslRootCert::System) => {
            let loaded = rustls_native_certs::load_native_certs();
            if loaded.certs.is_empty() {
                let reason = loaded
                    .errors
                    .first()
                    .map(|e| e.to_string())
                    .unwrap_or_else(|| "no certificates found".into());
                return Err(TlsConfigError::System(reason));
            }
            roots.add_parsable_certificates(loaded.certs);
            return Ok(roots);
        }
        Some(SslRootCert::File(p)) => p.clone(),
        None => {
            let p = default_root_cert();
            if !p.exists() {
                return Err(TlsConfigError::NoRootCert {
                    mode: mode_name(cfg.sslmode),
                    path: p.display().to_string(),
                });
            }
            p
        }
    };
    let display = path.display().to_string();
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(&path)
        .map_err(|e| TlsConfigError::RootCert {
            path: display.clone(),
            reason: e.to_string(),
        })?
        .collect::<Result<_, _>>()
        .map_err(|e| TlsConfigError::RootCert {
            path: display.clone(),
            reason: e.to_string(),
        })?;
    if certs.is_empty() {
        return Err(TlsConfigError::EmptyRootCert(display));
    }
    for cert in certs {
        roots.add(cert)?;
    }
    Ok(roots)
}

/// The rustls client settings for `cfg.sslmode`; `None` for `disable`.
pub fn client_config(cfg: &PgConnectConfig) -> Result<Option<Arc<ClientConfig>>, TlsConfigError> {
    let provider = provider();
    let builder =
        ClientConfig::builder_with_provider(provider.clone()).with_safe_default_protocol_versions()?;
    let config = match cfg.sslmode {
        SslMode::Disable => return Ok(None),
        SslMode::Prefer | SslMode::Require => builder
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(AcceptAnyCert { provider }))
            .with_no_client_auth(),
        SslMode::VerifyCa => {
            let inner = WebPkiServerVerifier::builder_with_provider(Arc::new(load_roots(cfg)?), provider)
                .build()
                .map_err(|e| TlsConfigError::Rustls(rustls::Error::General(e.to_string())))?;
            builder
                .dangerous()
                .with_custom_certificate_verifier(Arc::new(ChainOnly { inner }))
                .with_no_client_auth()
        }
        SslMode::VerifyFull => builder
            .with_root_certificates(load_roots(cfg)?)
            .with_no_client_auth(),
    };
    Ok(Some(Arc::new(config)))
}

/// `prefer` / `require`: encrypt, but do not authenticate the server (libpq
/// semantics). Handshake signatures are still checked.
#[derive(Debug)]
struct AcceptAnyCert {
    provider: Arc<CryptoProvider>,
}

impl ServerCertVerifier for AcceptAnyCert {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}

/// `verify-ca`: the chain must lead to a trusted root; the name is not checked.
#[derive(Debug)]
struct ChainOnly {
    inner: Arc<WebPkiServerVerifier>,
}

impl ServerCertVerifier for ChainOnly {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        match self
            .inner
            .verify_server_cert(end_entity, intermediates, server_name, ocsp_response, now)
        {
            Err(rustls::Error::InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
            )) => Ok(ServerCertVerified::assertion()),
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.inner.supported_verify_schemes()
    }
}

/// The server name to present and check. An IP address is checked against
/// the certificate's IP SANs under verify-full.
pub fn server_name(host: &str) -> Result<ServerName<'static>, TlsConfigError> {
    ServerName::try_from(host.to_owned()).map_err(|e| {
        TlsConfigError::Rustls(rustls::Error::General(format!(
            "invalid TLS server name {host:?}: {e}"
        )))
    })
}
