//! Topology files: any text through the parser and every check (`tessera check` without
//! binding ports); and the same text as a scenario file of trigger times and as a histogram of
//! fragment sizes.
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
    if let Ok(h) = tessera_config::parse_size_histogram(text) {
        // Every probability lands on a size of the file.
        for u in [0.0, 0.5, 1.0] {
            assert!(h.quantile(u) <= h.max());
        }
    }
});
