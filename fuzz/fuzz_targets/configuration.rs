//! Topology files: any text through the parser and every check (`tessera check` without
//! binding ports); and the same text as a scenario file of trigger times.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let _ = tessera_config::Topology::parse(text, "fuzz.toml");
    if let Ok(times) = tessera_config::parse_scenario(text) {
        assert!(times.windows(2).all(|w| w[0] <= w[1]));
    }
});
