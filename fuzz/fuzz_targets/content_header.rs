//! libFuzzer target `content_header`: the body is [`warren::fuzzing::content_header`], which
//! `tests/fuzz_corpus.rs` also runs on every corpus file.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| warren::fuzzing::content_header(data));
