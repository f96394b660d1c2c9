//! Time per CRC-32C call by length: this crate's choice against `crc-fast` and the `crc32c`
//! crate, best of five rounds, each call on another offset of a 1 MiB buffer. The figures
//! behind the sizes at which `crc.rs` changes implementation (docs/PERFORMANCE.md):
//!
//! `cargo run --release -p tessera-format --example crc_rate [LEN ...]`
use std::hint::black_box;
use std::time::Instant;

fn main() {
    let lens: Vec<usize> = std::env::args()
        .skip(1)
        .map(|a| a.parse().expect("a length in bytes"))
        .collect();
    let lens = if lens.is_empty() {
        vec![256, 1024, 1536, 2048, 4096, 16384, 16420, 32768, 65536]
    } else {
        lens
    };
    let data: Vec<u8> = (0..1usize << 20).map(|i| (i * 131 + 7) as u8).collect();
    type Crc = fn(&[u8]) -> u32;
    let ways: [(&str, Crc); 3] = [
        ("tessera", tessera_format::crc::crc32c),
        ("crc-fast", |d| {
            crc_fast::checksum(crc_fast::CrcAlgorithm::Crc32Iscsi, d) as u32
        }),
        ("crc32c", crc32c::crc32c),
    ];
    for n in lens {
        assert!(n <= data.len() / 2, "at most {} bytes", data.len() / 2);
        let calls = (400_000_000 / n.max(1)).max(1_000);
        let mut best = [f64::MAX; 3];
        for _ in 0..5 {
            for (k, (_, f)) in ways.iter().enumerate() {
                let t = Instant::now();
                let mut acc = 0u32;
                for i in 0..calls {
                    let at = (i * 4096) % (data.len() - n);
                    acc ^= f(black_box(&data[at..at + n]));
                }
                black_box(acc);
                best[k] = best[k].min(t.elapsed().as_nanos() as f64 / calls as f64);
            }
        }
        let cells: Vec<String> = ways
            .iter()
            .zip(best)
            .map(|((name, _), ns)| format!("{name} {ns:7.1} ns ({:4.1} GB/s)", n as f64 / ns))
            .collect();
        println!("{n:6} B: {}", cells.join("  "));
    }
}
