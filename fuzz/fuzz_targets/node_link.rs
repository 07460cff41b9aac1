//! libFuzzer target `node_link`: the body is [`warren::fuzzing::node_link`], which
//! `tests/fuzz_corpus.rs` also runs on every corpus file.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| warren::fuzzing::node_link(data));
