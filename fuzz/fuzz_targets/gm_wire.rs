//! libFuzzer target `gm_wire`: the body is [`warren::fuzzing::gm_wire`], which
//! `tests/fuzz_corpus.rs` also runs on every corpus file.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| warren::fuzzing::gm_wire(data));
