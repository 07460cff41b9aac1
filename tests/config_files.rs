//! Every shipped config file loads and validates; the reference file documents every key.

use std::path::Path;

use warren::config::Config;

#[test]
fn every_file_under_config_loads() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("config");
    let mut n = 0;
    let mut stack = vec![dir];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).expect("config dir") {
            let p = e.expect("entry").path();
            if p.is_dir() {
                stack.push(p);
            } else if p.extension().is_some_and(|x| x == "toml") {
                Config::load(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
                n += 1;
            }
        }
    }
    assert!(n >= 1, "no config files found");
}

#[test]
fn reference_config_mentions_every_key_of_the_defaults() {
    let text =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("config/warren.toml"))
            .expect("reference config");
    for key in [
        "name",
        "data_dir",
        "listen",
        "heartbeat_s",
        "frame_max_bytes",
        "channel_max",
        "handshake_timeout_ms",
        "loopback_users",
        "max_message_size_bytes",
        "memory_high_watermark_bytes",
        "memory_high_watermark_fraction",
        "connection_outbound_bytes_max",
        "enabled",
        "fsync_interval_ms",
        "queue_index_embed_msgs_below",
        "queue_index_segment_entry_count",
        "queue_index_journal_max_entries",
        "msg_store_file_size_limit_bytes",
    ] {
        assert!(
            text.contains(&format!("{key} =")),
            "config/warren.toml does not document `{key}`"
        );
    }
}
