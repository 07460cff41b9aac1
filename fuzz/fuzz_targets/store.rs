//! libFuzzer target `store`: the body is [`warren::fuzzing::store`], which
//! `tests/fuzz_corpus.rs` also runs on every corpus file.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| warren::fuzzing::store(data));
