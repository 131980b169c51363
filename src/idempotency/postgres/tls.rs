//! TLS for the store's connections (feature `postgres-tls`, rustls on ring), as libpq reads
//! `sslmode`: `disable`, `prefer` and `require` encrypt without checking the server's
//! certificate (unless a CA is given: then `require` checks it as `verify-ca` does),
//! `verify-ca` checks its chain against the CA, `verify-full` its chain and its host name.
//! The CA comes from `sslrootcert=<file>` in the URL or [`PostgresBuilder::with_ca_pem`](super::PostgresBuilder::with_ca_pem).
//! Without the feature the store speaks plain TCP and refuses a URL that asks for TLS.

use crate::store::StoreError;

/// The connector every connection of the store uses.
#[cfg(feature = "postgres-tls")]
pub(super) type Tls = tokio_postgres_rustls::MakeRustlsConnect;
/// The connector every connection of the store uses.
#[cfg(not(feature = "postgres-tls"))]
pub(super) type Tls = tokio_postgres::NoTls;

/// How the server's certificate is checked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Verify {
    /// Not at all (`prefer`, `require` without a CA).
    Nothing,
    /// Its chain, against the CA (`verify-ca`, `require` with a CA).
    Chain,
    /// Its chain and its host name (`verify-full`).
    Full,
}

/// What a URL asks of TLS, read and taken out of it (tokio-postgres knows only `disable`,
/// `prefer` and `require`, and no `sslrootcert`).
#[derive(Debug, Clone, Default)]
pub(super) struct Asked {
    /// `sslmode` as written, if any.
    pub(super) mode: Option<String>,
    /// `sslrootcert`, if any.
    pub(super) root_cert: Option<String>,
}

/// `url` without its `sslmode` and `sslrootcert`, and what they asked.
pub(super) fn split(url: &str) -> (String, Asked) {
    let mut asked = Asked::default();
    let mut take = |name: &str, value: &str| match name {
        "sslmode" => {
            asked.mode = Some(value.to_owned());
            true
        }
        "sslrootcert" => {
            asked.root_cert = Some(value.to_owned());
            true
        }
        _ => false,
    };
    if url.starts_with("postgres://") || url.starts_with("postgresql://") {
        let Some((base, query)) = url.split_once('?') else {
            return (url.to_owned(), asked);
        };
        let kept: Vec<&str> = query
            .split('&')
            .filter(|pair| {
                let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
                !take(name, &percent_decoded(value))
            })
            .collect();
        let rebuilt = if kept.is_empty() {
            base.to_owned()
        } else {
            format!("{base}?{}", kept.join("&"))
        };
        (rebuilt, asked)
    } else {
        let kept: Vec<&str> = url
            .split_whitespace()
            .filter(|pair| {
                let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
                !take(name, value.trim_matches('\''))
            })
            .collect();
        (kept.join(" "), asked)
    }
}

/// `%XX` escapes decoded (a path in `sslrootcert`).
fn percent_decoded(value: &str) -> String {
    let bytes = value.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%'
            && let Some(byte) = value
                .get(i + 1..i + 3)
                .and_then(|hex| u8::from_str_radix(hex, 16).ok())
        {
            out.push(byte);
            i += 3;
            continue;
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Applies `asked` (and a CA given to the builder) to `config`, and makes the connector.
pub(super) fn connector(
    config: &mut tokio_postgres::Config,
    asked: &Asked,
    ca_pem: Option<&[u8]>,
) -> Result<Tls, StoreError> {
    use tokio_postgres::config::SslMode;
    let ca_file = match &asked.root_cert {
        Some(path) => Some(std::fs::read(path).map_err(|e| {
            StoreError::Config(format!("postgres sslrootcert {path:?} cannot be read: {e}"))
        })?),
        None => None,
    };
    let ca = ca_pem.map(<[u8]>::to_vec).or(ca_file);
    let verify = match asked.mode.as_deref() {
        None | Some("prefer") => {
            config.ssl_mode(SslMode::Prefer);
            if ca.is_some() {
                Verify::Chain
            } else {
                Verify::Nothing
            }
        }
        Some("disable") => {
            config.ssl_mode(SslMode::Disable);
            Verify::Nothing
        }
        Some("allow" | "require") => {
            config.ssl_mode(SslMode::Require);
            if ca.is_some() {
                Verify::Chain
            } else {
                Verify::Nothing
            }
        }
        Some("verify-ca") => {
            config.ssl_mode(SslMode::Require);
            Verify::Chain
        }
        Some("verify-full") => {
            config.ssl_mode(SslMode::Require);
            Verify::Full
        }
        Some(other) => {
            return Err(StoreError::Config(format!(
                "invalid postgres sslmode {other:?}: disable, prefer, require, verify-ca or verify-full"
            )));
        }
    };
    make(config, verify, ca.as_deref())
}

#[cfg(not(feature = "postgres-tls"))]
fn make(
    config: &mut tokio_postgres::Config,
    verify: Verify,
    ca: Option<&[u8]>,
) -> Result<Tls, StoreError> {
    use tokio_postgres::config::SslMode;
    let asks = matches!(config.get_ssl_mode(), SslMode::Require)
        || verify != Verify::Nothing
        || ca.is_some();
    if asks {
        return Err(StoreError::Config(
            "this postgres url asks for TLS: build throttlebeam with the postgres-tls feature"
                .to_owned(),
        ));
    }
    // Plain TCP: `prefer` would find no TLS to prefer.
    config.ssl_mode(SslMode::Disable);
    Ok(tokio_postgres::NoTls)
}

#[cfg(feature = "postgres-tls")]
fn make(
    config: &mut tokio_postgres::Config,
    verify: Verify,
    ca: Option<&[u8]>,
) -> Result<Tls, StoreError> {
    use std::sync::Arc;

    use rustls::pki_types::CertificateDer;
    use rustls::pki_types::pem::PemObject;

    let _ = config;
    // The process's provider if the host installed one, else ring's (the one compiled in).
    #[allow(deprecated)]
    let provider = rustls::crypto::CryptoProvider::get_default()
        .cloned()
        .unwrap_or_else(|| Arc::new(rustls::crypto::ring::default_provider()));
    let bad = |what: &str, e: &dyn std::fmt::Display| {
        StoreError::Config(format!("postgres TLS: {what}: {e}"))
    };
    let mut roots = rustls::RootCertStore::empty();
    if let Some(pem) = ca {
        for cert in CertificateDer::pem_slice_iter(pem) {
            let cert = cert.map_err(|e| bad("the CA is not PEM certificates", &e))?;
            roots
                .add(cert)
                .map_err(|e| bad("a CA certificate is invalid", &e))?;
        }
    }
    if verify != Verify::Nothing && roots.is_empty() {
        return Err(StoreError::Config(
            "postgres sslmode verify-ca or verify-full needs a CA: sslrootcert=<file> in the url \
             or PostgresBuilder::with_ca_pem"
                .to_owned(),
        ));
    }
    let builder = rustls::ClientConfig::builder_with_provider(Arc::clone(&provider))
        .with_safe_default_protocol_versions()
        .map_err(|e| bad("no protocol version", &e))?;
    let tls = match verify {
        Verify::Full => builder.with_root_certificates(roots).with_no_client_auth(),
        Verify::Chain => {
            let inner = rustls::client::WebPkiServerVerifier::builder_with_provider(
                Arc::new(roots),
                Arc::clone(&provider),
            )
            .build()
            .map_err(|e| bad("the CA cannot verify", &e))?;
            builder
                .dangerous()
                .with_custom_certificate_verifier(Arc::new(ChainOnly(inner)))
                .with_no_client_auth()
        }
        Verify::Nothing => builder
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(Unchecked(provider)))
            .with_no_client_auth(),
    };
    Ok(tokio_postgres_rustls::MakeRustlsConnect::new(tls))
}

/// `verify-ca`: the chain checked against the CA, the host name not.
#[cfg(feature = "postgres-tls")]
#[derive(Debug)]
struct ChainOnly(std::sync::Arc<rustls::client::WebPkiServerVerifier>);

#[cfg(feature = "postgres-tls")]
impl rustls::client::danger::ServerCertVerifier for ChainOnly {
    fn verify_server_cert(
        &self,
        end_entity: &rustls::pki_types::CertificateDer<'_>,
        intermediates: &[rustls::pki_types::CertificateDer<'_>],
        server_name: &rustls::pki_types::ServerName<'_>,
        ocsp_response: &[u8],
        now: rustls::pki_types::UnixTime,
    ) -> Result<rustls::client::danger::ServerCertVerified, rustls::Error> {
        use rustls::{CertificateError, Error};
        match self
            .0
            .verify_server_cert(end_entity, intermediates, server_name, ocsp_response, now)
        {
            Err(Error::InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
            )) => Ok(rustls::client::danger::ServerCertVerified::assertion()),
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &rustls::pki_types::CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &rustls::pki_types::CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.0.supported_verify_schemes()
    }
}

/// `prefer` and `require` without a CA (libpq's meaning): encrypted, the certificate not
/// checked; the handshake's signatures still are.
#[cfg(feature = "postgres-tls")]
#[derive(Debug)]
struct Unchecked(std::sync::Arc<rustls::crypto::CryptoProvider>);

#[cfg(feature = "postgres-tls")]
impl rustls::client::danger::ServerCertVerifier for Unchecked {
    fn verify_server_cert(
        &self,
        _: &rustls::pki_types::CertificateDer<'_>,
        _: &[rustls::pki_types::CertificateDer<'_>],
        _: &rustls::pki_types::ServerName<'_>,
        _: &[u8],
        _: rustls::pki_types::UnixTime,
    ) -> Result<rustls::client::danger::ServerCertVerified, rustls::Error> {
        Ok(rustls::client::danger::ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &rustls::pki_types::CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &rustls::pki_types::CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sslmode_and_sslrootcert_are_taken_out_of_urls_and_key_value_strings() {
        let (url, asked) = split(
            "postgres://app@db:5432/shop?sslmode=verify-full&application_name=x&sslrootcert=%2Fetc%2Fca.pem",
        );
        assert_eq!(url, "postgres://app@db:5432/shop?application_name=x");
        assert_eq!(asked.mode.as_deref(), Some("verify-full"));
        assert_eq!(asked.root_cert.as_deref(), Some("/etc/ca.pem"));
        let (kv, asked) = split("host=db user=app sslmode=require dbname=shop");
        assert_eq!(kv, "host=db user=app dbname=shop");
        assert_eq!(asked.mode.as_deref(), Some("require"));
        let (plain, asked) = split("postgres://app@db/shop");
        assert_eq!(plain, "postgres://app@db/shop");
        assert!(asked.mode.is_none());
    }

    #[cfg(not(feature = "postgres-tls"))]
    #[test]
    fn without_the_feature_a_url_that_asks_for_tls_is_refused() {
        let mut config: tokio_postgres::Config = "postgres://app@db/shop".parse().unwrap();
        let asked = Asked {
            mode: Some("require".to_owned()),
            root_cert: None,
        };
        let e = connector(&mut config, &asked, None).err().unwrap();
        assert!(e.to_string().contains("postgres-tls"), "{e}");
    }
}
