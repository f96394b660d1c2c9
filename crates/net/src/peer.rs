//! The opening of a link between Tessera's own roles (docs/wire-format.md, section 2.1).

use std::net::TcpStream;
use std::time::Duration;

use tessera_format::link::{decode_link, LinkItem, PeerHello, PeerRole, PEER_HELLO_SIZE};

/// Reads the peer hello of a freshly accepted link and checks the peer's role. The stream gets
/// the data-path settings (no Nagle, a read timeout) first.
pub fn read_hello(stream: &mut TcpStream, role: PeerRole) -> Result<PeerHello, String> {
    crate::io::tune(stream, Some(Duration::from_millis(100))).map_err(|e| e.to_string())?;
    let mut b = [0u8; PEER_HELLO_SIZE];
    crate::io::read_exact_patient(stream, &mut b, crate::acceptor::HELLO_PATIENCE)
        .map_err(|e| e.to_string())?;
    check_hello(&b, role)
}

/// Decodes a peer's hello (read already) and checks that it comes from a `role`.
pub fn check_hello(b: &[u8], role: PeerRole) -> Result<PeerHello, String> {
    match decode_link(b, 0) {
        Ok((LinkItem::Hello(h), _)) if h.role == role => Ok(h),
        Ok((LinkItem::Hello(h), _)) => Err(format!("peer is a {:?}, expected a {role:?}", h.role)),
        Ok(_) => Err("first message is not a hello".into()),
        Err(e) => Err(e.to_string()),
    }
}
