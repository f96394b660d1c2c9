//! What a memory of 2^20 recent event IDs costs: resident bytes as 40 million IDs pass through
//! it (nearly rising, as events leave a unit), and the time of a million lookups of the latest.
//! `cargo run --release -p tessera-assembly --example recent_memory` (docs/PERFORMANCE.md,
//! "Memories of event IDs").

fn resident_mb() -> f64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: f64 = statm
        .split_whitespace()
        .nth(1)
        .and_then(|p| p.parse().ok())
        .unwrap_or(0.0);
    pages * 4096.0 / 1e6
}

fn main() {
    const IDS: u64 = 40_000_000;
    let before = resident_mb();
    let mut recent = tessera_assembly::RecentSet::new(1 << 20);
    let t = std::time::Instant::now();
    for i in 0..IDS {
        // Rising, each group of eight in another order.
        recent.insert(i ^ ((i >> 3) & 7));
        if i % 8_000_000 == 0 {
            println!("{i:>9} IDs: {:.1} MB resident", resident_mb() - before);
        }
    }
    let inserted = t.elapsed();
    let t = std::time::Instant::now();
    let found = (IDS - 1_000_000..IDS)
        .filter(|&i| recent.contains(i))
        .count();
    println!(
        "{IDS} IDs in {inserted:.2?} ({:.0} ns each), {:.1} MB resident; 1 000 000 lookups of the latest in {:.2?}, {found} found",
        inserted.as_nanos() as f64 / IDS as f64,
        resident_mb() - before,
        t.elapsed()
    );
}
