//! Frames over a blocking stream (TCP, or TLS over TCP).

use std::io::{Read, Write};

use tessera_node_protocol as proto;

pub(crate) fn send<T: serde::Serialize>(s: &mut impl Write, msg: &T) -> std::io::Result<()> {
    // One write of the whole frame, flushed: under TLS a frame is one record where it fits.
    s.write_all(&proto::encode(msg))?;
    s.flush()
}

/// Reads one frame (its length checked against `max` before the body is read).
pub(crate) fn recv<T: serde::de::DeserializeOwned>(
    s: &mut impl Read,
    max: usize,
) -> std::io::Result<T> {
    let mut h = [0u8; 4];
    s.read_exact(&mut h)?;
    let len = proto::frame_len(&h, max)
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))?
        .unwrap_or(0);
    let mut body = vec![0u8; len];
    s.read_exact(&mut body)?;
    proto::decode(&body).map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))
}
