//! Prints the test vectors of docs/wire-format.md, file-format.md, request-protocol.md and
//! monitor-protocol.md as hex:
//! `cargo run -p tessera-format --example vectors`.

fn main() {
    for (name, b) in tessera_format::vectors::all() {
        println!("Vector: {name} ({} bytes)", b.len());
        println!("```hex");
        for line in b.chunks(16) {
            println!(
                "{}",
                line.iter()
                    .map(|x| format!("{x:02x}"))
                    .collect::<Vec<_>>()
                    .join(" ")
            );
        }
        println!("```");
    }
}
