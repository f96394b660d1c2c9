//! TLS for the node protocol (and the run control's HTTP service, which takes its
//! certificate the same way): certificates and keys read from PEM files, one provider
//! (aws-lc-rs, which the S3 client links already), no home-made verification.
//!
//! The node protocol's challenge proves that each side holds the token without sending it;
//! TLS adds what that cannot: what follows the hellos (the topology, the reports, the log) is
//! neither read nor changed on the way, and a connection cannot be taken over after its
//! hellos.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::sync::Arc;

use anyhow::{anyhow, Context, Result};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};

/// Whether the first bytes a peer sent open a TLS handshake (a record of type 22, version
/// 3.x) rather than a node protocol frame. A frame starts with its length, little-endian; any
/// frame a peer may send before its hello passed is under 64 KiB, so its third byte is 0,
/// while a TLS record's third byte (the version's minor number) is 1 to 4: the two never look
/// alike, and an agent can tell a peer it is speaking the wrong way.
pub fn opens_tls(first: &[u8]) -> bool {
    matches!(first, [0x16, 0x03, 1..=4, ..])
}

/// Looks at a connection's first three bytes without taking them (within the socket's read
/// timeout). `None` when the peer closed or said less.
pub(crate) fn peek_opening(s: &TcpStream) -> Option<[u8; 3]> {
    let mut b = [0u8; 3];
    for _ in 0..50 {
        match s.peek(&mut b) {
            Ok(0) | Err(_) => return None,
            Ok(n) if n >= 3 => return Some(b),
            // A peer that sent one or two bytes so far: wait for the rest, briefly.
            Ok(_) => std::thread::sleep(std::time::Duration::from_millis(10)),
        }
    }
    None
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::aws_lc_rs::default_provider())
}

/// A server's configuration from its certificate chain and private key (PEM files).
pub fn server_config(certificate: &Path, key: &Path) -> Result<Arc<rustls::ServerConfig>> {
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(certificate)
        .with_context(|| format!("reading the certificate {}", certificate.display()))?
        .collect::<Result<_, _>>()
        .with_context(|| format!("{}: not a PEM certificate chain", certificate.display()))?;
    if chain.is_empty() {
        return Err(anyhow!("{}: no certificate in it", certificate.display()));
    }
    let key = PrivateKeyDer::from_pem_file(key)
        .with_context(|| format!("{}: no PEM private key in it", key.display()))?;
    let config = rustls::ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .context("TLS protocol versions")?
        .with_no_client_auth()
        .with_single_cert(chain, key)
        .with_context(|| {
            format!(
                "{} and its key: not a usable certificate and key",
                certificate.display()
            )
        })?;
    Ok(Arc::new(config))
}

/// A client's configuration trusting the certificate authorities of `ca` (a PEM bundle) and
/// only those: a site's own CA, not the web's.
pub fn client_config(ca: &Path) -> Result<Arc<rustls::ClientConfig>> {
    let mut roots = rustls::RootCertStore::empty();
    let certs = CertificateDer::pem_file_iter(ca)
        .with_context(|| format!("reading the certificate authorities {}", ca.display()))?;
    for c in certs {
        let c = c.with_context(|| format!("{}: not a PEM certificate", ca.display()))?;
        roots
            .add(c)
            .with_context(|| format!("{}: a certificate that cannot be trusted", ca.display()))?;
    }
    if roots.is_empty() {
        return Err(anyhow!("{}: no certificate in it", ca.display()));
    }
    let config = rustls::ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .context("TLS protocol versions")?
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok(Arc::new(config))
}

/// A node protocol connection: in clear, or TLS as either side.
pub(crate) enum Stream {
    Plain(TcpStream),
    Server(Box<rustls::StreamOwned<rustls::ServerConnection, TcpStream>>),
    Client(Box<rustls::StreamOwned<rustls::ClientConnection, TcpStream>>),
}

impl Stream {
    /// The agent's side: TLS when it has a certificate.
    pub(crate) fn accept(s: TcpStream, tls: Option<&Arc<rustls::ServerConfig>>) -> Result<Stream> {
        Ok(match tls {
            None => Stream::Plain(s),
            Some(c) => Stream::Server(Box::new(rustls::StreamOwned::new(
                rustls::ServerConnection::new(c.clone()).context("a TLS session")?,
                s,
            ))),
        })
    }

    /// The run control's side: TLS to `host` (a name or an address its certificate holds)
    /// when it trusts a CA for its agents.
    pub(crate) fn connect(
        s: TcpStream,
        tls: Option<&Arc<rustls::ClientConfig>>,
        host: &str,
    ) -> Result<Stream> {
        Ok(match tls {
            None => Stream::Plain(s),
            Some(c) => {
                let name = ServerName::try_from(host.to_string())
                    .map_err(|e| anyhow!("{host:?}: not a name a certificate can hold: {e}"))?;
                Stream::Client(Box::new(rustls::StreamOwned::new(
                    rustls::ClientConnection::new(c.clone(), name).context("a TLS session")?,
                    s,
                )))
            }
        })
    }

    pub(crate) fn tcp(&self) -> &TcpStream {
        match self {
            Stream::Plain(s) => s,
            Stream::Server(s) => &s.sock,
            Stream::Client(s) => &s.sock,
        }
    }
}

impl Read for Stream {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        match self {
            Stream::Plain(s) => s.read(buf),
            Stream::Server(s) => s.read(buf),
            Stream::Client(s) => s.read(buf),
        }
    }
}

impl Write for Stream {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        match self {
            Stream::Plain(s) => s.write(buf),
            Stream::Server(s) => s.write(buf),
            Stream::Client(s) => s.write(buf),
        }
    }

    fn flush(&mut self) -> std::io::Result<()> {
        match self {
            Stream::Plain(s) => s.flush(),
            Stream::Server(s) => s.flush(),
            Stream::Client(s) => s.flush(),
        }
    }
}
