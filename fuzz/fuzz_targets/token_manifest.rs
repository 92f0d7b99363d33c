//! Feeds arbitrary bytes to the token-shard manifest parser (`limpet-tokens.json`, read from
//! a data directory that may be shared or half-written) and, as JSON, to the Hugging Face
//! `config.json` reader. Each must return an error, never panic; a manifest it accepts must
//! serialize back to one it accepts as the same.
#![no_main]

use libfuzzer_sys::fuzz_target;
use limpet_trainer::data::tokens::Manifest;

fuzz_target!(|data: &[u8]| {
    if let Ok(m) = Manifest::parse(data) {
        let again = Manifest::parse(&m.to_bytes()).expect("a parsed manifest parses again");
        assert_eq!(again, m);
    }
    if let Ok(v) = serde_json::from_slice::<serde_json::Value>(data) {
        let _ = limpet_trainer::hf::parse_config(&v, None);
    }
});
