//! A source written from docs/wire-format.md alone, without the project's encoder: shared by
//! the tests that need an external source (crates/run and crates/cli tests include this file).
#![allow(dead_code)]

use std::io::Write;
use std::net::TcpStream;

fn le16(v: u16) -> [u8; 2] {
    v.to_le_bytes()
}
fn le32(v: u32) -> [u8; 4] {
    v.to_le_bytes()
}
fn le64(v: u64) -> [u8; 8] {
    v.to_le_bytes()
}

pub fn hello(source: u32) -> Vec<u8> {
    let mut b = Vec::new();
    b.extend(le32(0xEE11_AAEE));
    b.extend(le16(1));
    b.extend(le16(16));
    b.extend(le32(source));
    b.extend(le32(0));
    b
}

pub fn fragment(source: u32, event: u64, trigger: u16, payload: &[u8]) -> Vec<u8> {
    let mut b = Vec::new();
    b.extend(le32(0xEE12_34EE));
    b.push(1); // format version
    b.push(40); // header size
    b.extend(le16(0)); // status
    b.extend(le32(source));
    b.extend(le16(trigger));
    b.extend(le16(0));
    b.extend(le64(event));
    b.extend(le64(event * 1000));
    b.extend(le32(payload.len() as u32));
    let hcrc = crc32c::crc32c(&b);
    b.extend(le32(hcrc));
    b.extend(payload);
    while b.len() % 4 != 0 {
        b.push(0);
    }
    let crc = crc32c::crc32c(&b);
    b.extend(le32(crc));
    b.extend(le32(0xDD56_78EE));
    b
}

pub fn end(source: u32, sent: u64) -> Vec<u8> {
    let mut b = Vec::new();
    b.extend(le32(0xEE0E_05EE));
    b.extend(le16(1));
    b.extend(le16(24));
    b.extend(le32(source));
    b.extend(le32(0));
    b.extend(le64(sent));
    b
}

pub fn send(addr: &str, source: u32, events: u64) {
    stream(TcpStream::connect(addr).unwrap(), source, events)
}

/// A source that listens (SiTCP style): its readout unit connects, and it sends as [`send`].
#[allow(dead_code)]
pub fn serve(listener: std::net::TcpListener, source: u32, events: u64) {
    let (s, _) = listener.accept().unwrap();
    stream(s, source, events)
}

fn stream(mut s: TcpStream, source: u32, events: u64) {
    s.write_all(&hello(source)).unwrap();
    for ev in 0..events {
        let payload: Vec<u8> = (0..(100 + ev % 50))
            .map(|i| (i as u8) ^ (ev as u8))
            .collect();
        s.write_all(&fragment(source, ev, 1, &payload)).unwrap();
    }
    s.write_all(&end(source, events)).unwrap();
    s.shutdown(std::net::Shutdown::Write).unwrap();
    let _ = std::io::Read::read(&mut s, &mut [0u8; 8]);
}
