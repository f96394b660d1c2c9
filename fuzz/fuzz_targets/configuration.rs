//! Topology files: any text through the parser and every check (`tessera check` without
//! binding ports).
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let _ = tessera_config::Topology::parse(text, "fuzz.toml");
});
