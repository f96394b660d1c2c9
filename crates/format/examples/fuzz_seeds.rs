//! Writes the seed corpora of the fuzz targets (`fuzz/`) from the published test vectors: each
//! target starts from valid messages of its protocol, so the fuzzer mutates real structure.
//! `cargo run -p tessera-format --example fuzz_seeds -- fuzz/corpus`

use std::path::Path;

fn main() {
    let dir = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "fuzz/corpus".into());
    let v: Vec<(String, Vec<u8>)> = tessera_format::vectors::all()
        .into_iter()
        .map(|(n, b)| (n.to_string(), b))
        .collect();
    let named = |prefix: &str| -> Vec<Vec<u8>> {
        v.iter()
            .filter(|(n, _)| n.starts_with(prefix))
            .map(|(_, b)| b.clone())
            .collect()
    };
    let one = |prefix: &str| named(prefix).into_iter().next().expect(prefix);
    let mut seeds: Vec<(&str, Vec<u8>)> = Vec::new();
    // A source's stream: two control bytes (read cut, expected source), then the bytes.
    let stream = [
        one("hello, source"),
        one("fragment, source"),
        one("end of stream"),
    ]
    .concat();
    for (cut, mode) in [(0u8, 0u8), (3, 1), (60, 0)] {
        seeds.push(("wire_stream", [vec![cut, mode], stream.clone()].concat()));
    }
    seeds.push((
        "wire_stream",
        [vec![7, 0], one("fragment, source")].concat(),
    ));
    for p in [
        "peer hello",
        "peer end",
        "super-fragment",
        "progress",
        "ack",
        "event record",
    ] {
        for b in named(p) {
            seeds.push(("builder_link", b));
        }
    }
    seeds.push((
        "builder_link",
        [
            one("peer hello, readout"),
            one("super-fragment"),
            one("progress"),
            one("peer end"),
        ]
        .concat(),
    ));
    let file = [
        one("file header"),
        one("block header"),
        one("event record"),
        one("file trailer"),
    ]
    .concat();
    seeds.push(("file_format", file));
    for p in [
        "hello, builder",
        "request",
        "answer",
        "clear",
        "announce",
        "credit",
        "assign",
        "done",
        "heartbeat, sequence",
        "throttle",
        "end, 3 units",
    ] {
        seeds.push(("request_protocol", one(p)));
    }
    for p in [
        "welcome",
        "command",
        "get,",
        "events:",
        "put back",
        "heartbeat from",
        "error",
        "bye",
    ] {
        seeds.push(("monitor_protocol", one(p)));
    }
    for text in [
        "event_id % 100 == 0",
        "flags & 1 != 0",
        "trigger_type == 2 && size > 65536",
        "missing > 0 || builder == 3 && timestamp >= 0x10",
    ] {
        seeds.push((
            "predicate",
            [vec![0x5a; 24], text.as_bytes().to_vec()].concat(),
        ));
    }
    for f in std::fs::read_dir("examples").expect("run from the repository root") {
        let f = f.unwrap().path();
        if f.extension().is_some_and(|e| e == "toml") {
            seeds.push(("configuration", std::fs::read(&f).unwrap()));
        }
    }
    seeds.push(("configuration", b"[sources]\ncount = 4\n".to_vec()));
    let mut n = 0;
    for (i, (target, bytes)) in seeds.iter().enumerate() {
        let d = Path::new(&dir).join(target);
        std::fs::create_dir_all(&d).unwrap();
        std::fs::write(d.join(format!("seed-{i:03}")), bytes).unwrap();
        n += 1;
    }
    println!("{n} seeds written under {dir}");
}
