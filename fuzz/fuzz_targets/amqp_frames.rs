//! libFuzzer target `amqp_frames`: the body is [`warren::fuzzing::amqp_frames`], which
//! `tests/fuzz_corpus.rs` also runs on every corpus file.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| warren::fuzzing::amqp_frames(data));
