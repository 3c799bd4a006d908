//! Mutual TLS on the worker plane: a process's certificate and key plus the cluster CA, loaded
//! once and turned into tonic's server and client configurations, the rule that refuses plain
//! text off loopback, and the development CA behind `baton certs`.
//!
//! Every node certificate is both a server and a client certificate: a worker serves the
//! coordinator and the previous stage, and calls the next stage and the coordinator's registry.

use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::Duration;

use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use tonic::transport::{Certificate, ClientTlsConfig, Identity, ServerTlsConfig};

/// How long a peer may take over its TLS handshake before the connection is dropped.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// A TLS problem, naming the file or setting at fault.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("TLS needs all of tls_cert, tls_key and tls_ca; {missing} is not set")]
    Incomplete { missing: &'static str },
    #[error("cannot read {what} {path}: {source}")]
    Read {
        what: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{what} {path} holds no usable PEM {expected}: {reason}")]
    Pem {
        what: &'static str,
        path: PathBuf,
        expected: &'static str,
        reason: String,
    },
    #[error(
        "refusing plain-text gRPC on {addr}, which is not a loopback address: set tls_cert, tls_key \
         and tls_ca (`baton certs` makes them), or allow_plaintext = true on a network you trust"
    )]
    PlaintextOffLoopback { addr: SocketAddr },
    #[error("{url}: TLS is on, so peers are reached with https:// URLs")]
    NeedsHttps { url: String },
    #[error("{url}: TLS is off (no tls_cert/tls_key/tls_ca), so peers are reached with http:// URLs")]
    NeedsHttp { url: String },
    #[error("making certificates: {0}")]
    Generate(String),
    #[error("writing {path}: {source}")]
    Write { path: PathBuf, source: std::io::Error },
}

/// Paths of a node's TLS material, from settings (`tls_cert`, `tls_key`, `tls_ca`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TlsPaths {
    pub cert: Option<PathBuf>,
    pub key: Option<PathBuf>,
    pub ca: Option<PathBuf>,
}

impl TlsPaths {
    /// The loaded identity, None when no path is set (plain text), an error when only some are.
    pub fn load(&self) -> Result<Option<ClusterTls>, TlsError> {
        let set = |p: &Option<PathBuf>| p.clone().filter(|p| !p.as_os_str().is_empty());
        match (set(&self.cert), set(&self.key), set(&self.ca)) {
            (None, None, None) => Ok(None),
            (Some(cert), Some(key), Some(ca)) => ClusterTls::load(&cert, &key, &ca).map(Some),
            (c, k, _) => Err(TlsError::Incomplete {
                missing: if c.is_none() {
                    "tls_cert"
                } else if k.is_none() {
                    "tls_key"
                } else {
                    "tls_ca"
                },
            }),
        }
    }
}

/// A node's certificate chain and key and the cluster CA, as PEM checked at load time.
#[derive(Clone)]
pub struct ClusterTls {
    identity: Identity,
    ca: Certificate,
}

impl std::fmt::Debug for ClusterTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ClusterTls { .. }")
    }
}

impl ClusterTls {
    /// Read and check the three PEM files.
    pub fn load(cert: &Path, key: &Path, ca: &Path) -> Result<Self, TlsError> {
        let cert_pem = read("tls_cert", cert)?;
        let key_pem = read("tls_key", key)?;
        let ca_pem = read("tls_ca", ca)?;
        check_certs("tls_cert", cert, &cert_pem)?;
        check_certs("tls_ca", ca, &ca_pem)?;
        PrivateKeyDer::from_pem_slice(&key_pem).map_err(|e| TlsError::Pem {
            what: "tls_key",
            path: key.to_path_buf(),
            expected: "private key",
            reason: e.to_string(),
        })?;
        Ok(Self::from_pem(&cert_pem, &key_pem, &ca_pem))
    }

    /// From PEM already in memory (checked by the caller, e.g. freshly generated).
    pub fn from_pem(cert: &[u8], key: &[u8], ca: &[u8]) -> Self {
        Self {
            identity: Identity::from_pem(cert, key),
            ca: Certificate::from_pem(ca),
        }
    }

    /// Server side: present this node's certificate and require a client certificate that
    /// chains to the cluster CA.
    pub fn server_config(&self) -> ServerTlsConfig {
        ServerTlsConfig::new()
            .identity(self.identity.clone())
            .client_ca_root(self.ca.clone())
            .timeout(HANDSHAKE_TIMEOUT)
    }

    /// Client side: trust only the cluster CA and present this node's certificate.
    pub fn client_config(&self) -> ClientTlsConfig {
        ClientTlsConfig::new()
            .ca_certificate(self.ca.clone())
            .identity(self.identity.clone())
            .timeout(HANDSHAKE_TIMEOUT)
    }
}

fn read(what: &'static str, path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|source| TlsError::Read {
        what,
        path: path.to_path_buf(),
        source,
    })
}

fn check_certs(what: &'static str, path: &Path, pem: &[u8]) -> Result<(), TlsError> {
    let bad = |reason: String| TlsError::Pem {
        what,
        path: path.to_path_buf(),
        expected: "certificate",
        reason,
    };
    let certs = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| bad(e.to_string()))?;
    if certs.is_empty() {
        return Err(bad("no CERTIFICATE block".into()));
    }
    Ok(())
}

/// Refuse a plain-text listener off loopback unless the operator allowed it explicitly.
pub fn check_listen(addr: SocketAddr, tls: bool, allow_plaintext: bool) -> Result<(), TlsError> {
    if tls || allow_plaintext || addr.ip().is_loopback() {
        Ok(())
    } else {
        Err(TlsError::PlaintextOffLoopback { addr })
    }
}

/// Check a peer URL's scheme against the TLS mode: tonic would silently use plain text for an
/// `http://` URL even with TLS configured.
pub fn check_scheme(url: &str, tls: bool) -> Result<(), TlsError> {
    let https = url.starts_with("https://");
    match (tls, https) {
        (true, false) => Err(TlsError::NeedsHttps { url: url.into() }),
        (false, true) => Err(TlsError::NeedsHttp { url: url.into() }),
        _ => Ok(()),
    }
}

/// The URL scheme peers use in this mode.
pub fn scheme(tls: bool) -> &'static str {
    if tls { "https" } else { "http" }
}

/// PEM files of one certificate and its key.
#[derive(Debug, Clone)]
pub struct IssuedPem {
    pub cert: String,
    pub key: String,
}

/// A development certificate authority for one cluster.
pub struct DevCa {
    issuer: rcgen::Issuer<'static, rcgen::KeyPair>,
    /// The CA certificate (PEM), what every node trusts.
    pub cert_pem: String,
    /// The CA key (PEM): keep it off the nodes.
    pub key_pem: String,
}

const CA_NAME: &str = "Baton cluster CA";

fn ca_params(days: u32) -> Result<rcgen::CertificateParams, TlsError> {
    let mut p = rcgen::CertificateParams::new(Vec::<String>::new()).map_err(gen_err)?;
    p.distinguished_name = rcgen::DistinguishedName::new();
    p.distinguished_name.push(rcgen::DnType::CommonName, CA_NAME);
    p.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Constrained(0));
    p.key_usages = vec![rcgen::KeyUsagePurpose::KeyCertSign, rcgen::KeyUsagePurpose::CrlSign];
    let now = time::OffsetDateTime::now_utc();
    p.not_before = now - time::Duration::hours(1);
    p.not_after = now + time::Duration::days(days.into());
    Ok(p)
}

fn gen_err(e: rcgen::Error) -> TlsError {
    TlsError::Generate(e.to_string())
}

impl DevCa {
    /// A new CA valid for `days`.
    pub fn generate(days: u32) -> Result<Self, TlsError> {
        let key = rcgen::KeyPair::generate().map_err(gen_err)?;
        let params = ca_params(days)?;
        let cert = params.self_signed(&key).map_err(gen_err)?;
        let key_pem = key.serialize_pem();
        Ok(Self {
            cert_pem: cert.pem(),
            key_pem,
            issuer: rcgen::Issuer::new(params, key),
        })
    }

    /// The CA made earlier by [`DevCa::generate`], from its two PEM files, to issue more nodes.
    pub fn load(cert_pem: String, key_pem: String) -> Result<Self, TlsError> {
        let key = rcgen::KeyPair::from_pem(&key_pem).map_err(gen_err)?;
        // The issuer is named by its subject and key, which the saved files fix; validity is the
        // saved certificate's and is not needed to sign.
        let params = ca_params(1)?;
        Ok(Self {
            cert_pem,
            key_pem,
            issuer: rcgen::Issuer::new(params, key),
        })
    }

    /// A node certificate for `names` (DNS names or IP addresses), usable as server and client,
    /// valid from `not_before` for `days` (tests make expired ones with a past start).
    pub fn issue(&self, names: &[String], not_before: time::OffsetDateTime, days: u32) -> Result<IssuedPem, TlsError> {
        let first = names
            .first()
            .ok_or_else(|| TlsError::Generate("a node certificate needs at least one name".into()))?;
        let mut p = rcgen::CertificateParams::new(names.to_vec()).map_err(gen_err)?;
        p.distinguished_name = rcgen::DistinguishedName::new();
        p.distinguished_name.push(rcgen::DnType::CommonName, first.as_str());
        p.key_usages = vec![
            rcgen::KeyUsagePurpose::DigitalSignature,
            rcgen::KeyUsagePurpose::KeyEncipherment,
        ];
        p.extended_key_usages = vec![
            rcgen::ExtendedKeyUsagePurpose::ServerAuth,
            rcgen::ExtendedKeyUsagePurpose::ClientAuth,
        ];
        p.use_authority_key_identifier_extension = true;
        p.not_before = not_before;
        p.not_after = not_before + time::Duration::days(days.into());
        let key = rcgen::KeyPair::generate().map_err(gen_err)?;
        let cert = p.signed_by(&key, &self.issuer).map_err(gen_err)?;
        Ok(IssuedPem {
            cert: cert.pem(),
            key: key.serialize_pem(),
        })
    }

    /// A node certificate valid from now for `days`.
    pub fn issue_now(&self, names: &[String], days: u32) -> Result<IssuedPem, TlsError> {
        self.issue(names, time::OffsetDateTime::now_utc() - time::Duration::hours(1), days)
    }
}

/// Whether `name` is an IP address (an IP SAN) rather than a DNS name.
pub fn is_ip(name: &str) -> bool {
    name.parse::<IpAddr>().is_ok()
}

/// Write `contents` to `path`, readable by the owner only when `secret`.
pub fn write_pem(path: &Path, contents: &str, secret: bool) -> Result<(), TlsError> {
    let err = |source| TlsError::Write {
        path: path.to_path_buf(),
        source,
    };
    std::fs::write(path, contents).map_err(err)?;
    #[cfg(unix)]
    if secret {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).map_err(err)?;
    }
    #[cfg(not(unix))]
    let _ = secret;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn listen_rule() {
        let lo: SocketAddr = "127.0.0.1:1".parse().unwrap();
        let any: SocketAddr = "0.0.0.0:1".parse().unwrap();
        assert!(check_listen(lo, false, false).is_ok());
        assert!(check_listen("[::1]:1".parse().unwrap(), false, false).is_ok());
        let e = check_listen(any, false, false).unwrap_err().to_string();
        assert!(e.contains("0.0.0.0:1") && e.contains("allow_plaintext"), "{e}");
        assert!(check_listen(any, true, false).is_ok());
        assert!(check_listen(any, false, true).is_ok());
    }

    #[test]
    fn scheme_rule() {
        assert!(check_scheme("https://w:1", true).is_ok());
        assert!(check_scheme("http://w:1", false).is_ok());
        assert!(matches!(
            check_scheme("http://w:1", true),
            Err(TlsError::NeedsHttps { .. })
        ));
        assert!(matches!(
            check_scheme("https://w:1", false),
            Err(TlsError::NeedsHttp { .. })
        ));
    }

    #[test]
    fn partial_paths_name_the_missing_one() {
        let p = TlsPaths {
            cert: Some("c.pem".into()),
            key: None,
            ca: Some("ca.pem".into()),
        };
        assert!(p.load().unwrap_err().to_string().contains("tls_key"));
        assert!(TlsPaths::default().load().unwrap().is_none());
        // Empty strings (how `baton serve` clears inherited settings) mean unset.
        let empty = TlsPaths {
            cert: Some("".into()),
            key: Some("".into()),
            ca: Some("".into()),
        };
        assert!(empty.load().unwrap().is_none());
    }

    #[test]
    fn generated_files_load_and_bad_ones_are_named() {
        let dir = tempfile::tempdir().unwrap();
        let ca = DevCa::generate(30).unwrap();
        let node = ca.issue_now(&["worker-0".into(), "127.0.0.1".into()], 30).unwrap();
        let (c, k, a) = (
            dir.path().join("n.pem"),
            dir.path().join("n.key"),
            dir.path().join("ca.pem"),
        );
        write_pem(&c, &node.cert, false).unwrap();
        write_pem(&k, &node.key, true).unwrap();
        write_pem(&a, &ca.cert_pem, false).unwrap();
        ClusterTls::load(&c, &k, &a).unwrap();
        // A key where the certificate belongs, and a missing file.
        let e = ClusterTls::load(&k, &k, &a).unwrap_err().to_string();
        assert!(e.contains("tls_cert") && e.contains("n.key"), "{e}");
        let e = ClusterTls::load(&c, &dir.path().join("nope"), &a)
            .unwrap_err()
            .to_string();
        assert!(e.contains("tls_key") && e.contains("nope"), "{e}");
        // A reloaded CA issues certificates that chain to the saved CA certificate.
        let again = DevCa::load(ca.cert_pem.clone(), ca.key_pem.clone()).unwrap();
        assert!(again.issue_now(&["worker-1".into()], 1).is_ok());
    }
}
