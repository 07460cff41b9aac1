//! Entry points for the fuzz targets in `fuzz/` (cargo-fuzz, libFuzzer) and for their corpus
//! replay in `tests/fuzz_corpus.rs`.
//!
//! Each function takes arbitrary bytes, runs them through one decoder the way the broker
//! does and then through the code that consumes what was decoded; it must return normally
//! whatever the bytes. A panic, an abort (an allocation too big) or a hang is a bug. The fuzz
//! targets and the stable replay test call these same bodies, so a corpus or crash file
//! checked here is checked exactly as the fuzzer ran it (`docs/security.md`, *Fuzzing*).
//!
//! Inputs that carry several frames or files use the layouts of the real wire or disk where
//! one exists (AMQP, node link, admin); where none does (a GM call's payload travels inside
//! a node-link request, a data folder is several files) the layout is the small one
//! documented on the function, so a seed can be made from real bytes.

use std::path::Path;
use std::sync::Arc;

use bytes::BytesMut;

use crate::admin::{self, Auth, NodeInfo, Request};
use crate::amqp::frame::{self, FrameKind, PROTOCOL_HEADER};
use crate::broker::dead_letter;
use crate::broker::queue::DeathReason;
use crate::broker::{exchange, message, Broker, DeadLetter, Message};
use crate::config::Config;
use crate::gm::{GmMsg, Inbox};
use crate::meta::args::QueueArgs;
use crate::meta::definitions::Definitions;
use crate::mirror::message::MirrorMsg;
use crate::runtime::node_link::wire as link_wire;
use crate::store::msg_store::{MsgStore, MsgStoreConfig};
use crate::store::queue_index::{IndexConfig, QueueIndex};
use crate::store::MemDisk;
use crate::time::Instant;

/// A target's entry point.
pub type Target = fn(&[u8]);

/// Every target by name (the `fuzz/fuzz_targets/<name>.rs` file and the corpus folder
/// `fuzz/corpus/<name>/`), for the replay test.
pub const TARGETS: &[(&str, Target)] = &[
    ("amqp_frames", amqp_frames),
    ("content_header", content_header),
    ("node_link", node_link),
    ("gm_wire", gm_wire),
    ("admin", admin),
    ("definitions", definitions),
    ("store", store),
];

/// The `frame_max` a client gets by default (RabbitMQ's 128 KiB).
const FRAME_MAX: u32 = 131_072;

/// A client's byte stream: the optional protocol header, then frames. Each frame is split
/// as the session splits it; method payloads and content headers are decoded, and a content
/// header goes on to [`properties`].
pub fn amqp_frames(data: &[u8]) {
    let mut rest = data.strip_prefix(&PROTOCOL_HEADER[..]).unwrap_or(data);
    while let Ok(Some((f, used))) = frame::split(rest, FRAME_MAX) {
        match f.kind {
            FrameKind::Method => {
                let _ = frame::decode_method(f.payload);
            }
            FrameKind::Header => content_header(f.payload),
            FrameKind::Body | FrameKind::Heartbeat => {}
        }
        rest = &rest[used..];
    }
}

/// One content header frame's payload (class, weight, body size, property flags and
/// values, field tables among them), then everything the broker reads from the properties.
pub fn content_header(data: &[u8]) {
    if let Ok(header) = frame::decode_content_header(data) {
        properties(header.properties, header.raw_properties);
    }
}

/// What the broker does with a publisher's properties: expiration and priority checks, the
/// headers table in headers-exchange routing, `x-` arguments, listings, a dead letter's
/// `x-death` bookkeeping, and the stored form that is read back at recovery.
fn properties(properties: amq_protocol::protocol::basic::AMQPProperties, raw: bytes::Bytes) {
    let _ = message::validate_expiration(&properties);
    let msg = Arc::new(Message {
        id: 1,
        exchange: "x".into(),
        routing_key: "rk".into(),
        properties_raw: raw,
        properties,
        body: bytes::Bytes::from_static(b"body"),
    });
    let _ = (
        msg.persistent(),
        msg.expiration_ms(),
        msg.priority(),
        msg.size(),
    );
    if let Some(headers) = msg.properties.headers() {
        // The headers as binding arguments and as the message's headers, both ways round.
        let _ = exchange::headers_match(headers, Some(headers));
        let _ = exchange::headers_match(headers, None);
        let _ = QueueArgs::parse(headers);
        let _ = admin::format_table(headers);
    }
    let _ = dead_letter::is_cycle(&msg, "q");
    for reason in [
        DeathReason::Rejected,
        DeathReason::Expired,
        DeathReason::Maxlen,
    ] {
        let letter = DeadLetter {
            message: msg.clone(),
            reason,
            held: None,
        };
        let dead = Arc::new(dead_letter::rewrite(&letter, "q", "dlx", None, 1_000, 2));
        let _ = dead_letter::is_cycle(&dead, "q");
    }
    let stored = msg.to_stored();
    let _ = Message::from_stored(&stored, 1);
}

/// The largest node-link frame body the fuzzer uses (the default is larger; a smaller one
/// keeps the fuzzer's allocations small and exercises the same checks).
const LINK_FRAME_MAX: usize = 1 << 20;

/// A peer's byte stream on a node link: length-delimited frames of bincode envelopes,
/// decoded by the code the link's reader runs ([`link_wire::next_envelope`]) until the
/// stream is used up or broken. A request for the GM service goes on to [`gm_wire`]'s
/// decoder, as the GM host would receive it.
pub fn node_link(data: &[u8]) {
    let mut codec = link_wire::codec(LINK_FRAME_MAX);
    let mut buf = BytesMut::from(data);
    while let Ok(Some(env)) = link_wire::next_envelope(&mut codec, &mut buf, LINK_FRAME_MAX) {
        if let link_wire::Envelope::Request {
            service: link_wire::Service::Gm,
            payload,
            ..
        } = env
        {
            let _ = crate::gm::wire::decode_frame(&payload);
        }
    }
}

/// GM calls' payloads as one member host receives them: a sequence of `u32` big-endian
/// length, payload (a bincode [`crate::gm::GmFrame`], what the node link's `Request`
/// carries). Each decoded frame goes into one [`Inbox`] (resends, gaps, message parts);
/// every message it releases has its mirror payloads decoded.
pub fn gm_wire(data: &[u8]) {
    let mut inbox = Inbox::new();
    for payload in length_prefixed(data) {
        let Ok(frame) = crate::gm::wire::decode_frame(&bytes::Bytes::copy_from_slice(payload))
        else {
            continue;
        };
        let (msgs, _reply) = inbox.accept(frame);
        for msg in msgs {
            mirror_payloads(&msg);
        }
    }
}

/// What a mirror does with a GM message's payloads: decodes each as a [`MirrorMsg`], and the
/// queue operations a round or a sync batch carries.
fn mirror_payloads(msg: &GmMsg<bytes::Bytes>) {
    let payloads: Vec<&bytes::Bytes> = match msg {
        GmMsg::Activity { items, .. } => items
            .iter()
            .flat_map(|item| item.pubs.iter().map(|(_, m)| m))
            .collect(),
        GmMsg::Catchup { state, .. } => state
            .values()
            .flat_map(|p| p.pending_ack.iter().map(|(_, m)| m))
            .collect(),
    };
    for m in payloads {
        match MirrorMsg::decode(m) {
            Some(MirrorMsg::Ops { ops, .. }) | Some(MirrorMsg::SyncBatch { ops, .. }) => {
                let _ = crate::mirror::ops::decode(&ops);
            }
            _ => {}
        }
    }
}

/// A `warrenctl` session as the admin listener reads it: frames of `u32` big-endian length
/// then a bincode body, the first an [`Auth`], the others [`Request`]s, each handled against
/// a fresh broker. (The listener refuses requests after a failed login; here they are
/// handled whatever the login, so the fuzzer reaches the handlers.)
pub fn admin(data: &[u8]) {
    let broker = Broker::new(&Config::default(), 1, 1 << 30, 0);
    let node = NodeInfo {
        name: "warren@fuzz".into(),
    };
    let mut frames = length_prefixed(data);
    let Some(first) = frames.next() else {
        return;
    };
    if let Ok(auth) = admin::decode_body::<Auth>(first) {
        let _ = admin::authenticate(&broker, &auth);
    }
    for (i, body) in frames.enumerate() {
        if let Ok(request) = admin::decode_body::<Request>(body) {
            let _ = admin::handle(&broker, &node, &request, Instant::from_millis(i as u64));
        }
    }
}

/// A definitions file (RabbitMQ's JSON) as `POST /api/definitions`, `warrenctl
/// import_definitions` and `[definitions] load_file` import it: planned against a fresh
/// broker, and the commands applied.
pub fn definitions(data: &[u8]) {
    let broker = Broker::new(&Config::default(), 1, 1 << 30, 0);
    let node = NodeInfo {
        name: "warren@fuzz".into(),
    };
    if let Ok(commands) = crate::mgmt::definitions::plan_json(&broker, &node, data) {
        for (i, c) in commands.iter().enumerate() {
            let _ = broker.apply(c, Instant::from_millis(i as u64));
        }
    }
}

/// Where [`store`] puts the files of each kind (the names of a node's data folder).
const MSG_STORE_DIR: &str = "/data/msg_store_persistent";
const QUEUE_DIR: &str = "/data/queues/q";

/// A node's data files, as recovery reads them after a crash: a sequence of entries, each
/// `u8` name length, the name (`m/<file>`: the persistent message store's folder,
/// `q/<file>`: one queue's index folder, `definitions`: the durable definitions file), `u32`
/// little-endian length, the bytes. The message store and the queue index are opened
/// (recovering, cutting what is damaged) on an in-memory disk and every message read back.
///
/// Each input is recovered twice: as it is, and with every record's checksum made right
/// (most record-framed files are, and a mutation that breaks a checksum only reaches the
/// cut at the first bad record; the second pass reaches the decoders behind the checksums,
/// as a damaged disk whose checksums still match would).
pub fn store(data: &[u8]) {
    let mut files = packed_files(data);
    recover(&files);
    for (_, bytes) in &mut files {
        fix_record_checksums(bytes);
    }
    recover(&files);
}

/// Walks `bytes` as [`crate::store::record`] framing and rewrites each record's checksum.
fn fix_record_checksums(bytes: &mut [u8]) {
    let overhead = crate::store::record::RECORD_OVERHEAD;
    let mut pos = 0;
    while bytes.len() - pos >= overhead {
        let len = u32::from_le_bytes([bytes[pos], bytes[pos + 1], bytes[pos + 2], bytes[pos + 3]]);
        let Some(end) = (len as usize)
            .checked_add(pos + overhead)
            .filter(|e| *e <= bytes.len())
        else {
            break;
        };
        let crc = crc32fast::hash(&bytes[pos + overhead..end]);
        bytes[pos + 4..pos + 8].copy_from_slice(&crc.to_le_bytes());
        pos = end;
    }
}

fn recover(files: &[(String, Vec<u8>)]) {
    let disk = MemDisk::new();
    for (name, bytes) in files {
        let (dir, file) = if let Some(f) = name.strip_prefix("m/") {
            (MSG_STORE_DIR, f)
        } else if let Some(f) = name.strip_prefix("q/") {
            (QUEUE_DIR, f)
        } else if name == "definitions" {
            // Replayed into a fresh broker at start, as `runtime::node` does.
            if let Ok(defs) = Definitions::decode(bytes) {
                let broker = Broker::new(&Config::default(), 1, 1 << 30, 0);
                for c in defs.commands() {
                    let _ = broker.apply(&c, Instant::from_millis(0));
                }
            }
            continue;
        } else {
            continue;
        };
        // A data folder holds plain names; anything else is not a file recovery would see.
        if file.is_empty() || file == "." || file == ".." || file.contains('/') {
            continue;
        }
        let dir = Path::new(dir);
        let _ = crate::store::Disk::create_dir_all(&disk, dir);
        let _ = crate::store::Disk::write_file(&disk, &dir.join(file), bytes);
    }
    if let Ok((store, _report)) =
        MsgStore::open(disk.clone(), MSG_STORE_DIR, MsgStoreConfig::default())
    {
        for (id, _, _) in store.index().snapshot() {
            if let Ok(Some(body)) = store.read(id) {
                let _ = Message::from_stored(&body, 1);
            }
        }
    }
    if let Ok((index, _recovered)) =
        QueueIndex::open(disk, Path::new(QUEUE_DIR), IndexConfig::default())
    {
        for n in index.segments() {
            if let Ok(entries) = index.read_segment(n) {
                for e in entries {
                    if let Some(body) = &e.publish.embedded {
                        let _ = Message::from_stored(body, 1);
                    }
                }
            }
        }
    }
}

/// Packs files in [`store`]'s input layout (for making seeds from a data folder).
pub fn pack_files(files: &[(String, Vec<u8>)]) -> Vec<u8> {
    let mut out = Vec::new();
    for (name, bytes) in files {
        let name = &name.as_bytes()[..name.len().min(255)];
        out.push(name.len() as u8);
        out.extend_from_slice(name);
        out.extend_from_slice(&(bytes.len() as u32).to_le_bytes());
        out.extend_from_slice(bytes);
    }
    out
}

/// The entries of [`store`]'s input layout; a truncated last entry keeps what is there.
fn packed_files(mut data: &[u8]) -> Vec<(String, Vec<u8>)> {
    let mut files = Vec::new();
    while let Some((&n, rest)) = data.split_first() {
        let Some(name) = rest.get(..n as usize) else {
            break;
        };
        let rest = &rest[n as usize..];
        let Some(len) = rest.get(..4) else {
            break;
        };
        let len = u32::from_le_bytes([len[0], len[1], len[2], len[3]]) as usize;
        let rest = &rest[4..];
        let body = &rest[..len.min(rest.len())];
        files.push((String::from_utf8_lossy(name).into_owned(), body.to_vec()));
        data = &rest[body.len()..];
    }
    files
}

/// Packs payloads in the `u32` big-endian length-prefixed layout [`gm_wire`] and [`admin`]
/// read (for making seeds).
pub fn pack_length_prefixed(payloads: &[Vec<u8>]) -> Vec<u8> {
    let mut out = Vec::new();
    for p in payloads {
        out.extend_from_slice(&(p.len() as u32).to_be_bytes());
        out.extend_from_slice(p);
    }
    out
}

/// The payloads of a `u32` big-endian length-prefixed sequence; a truncated last one keeps
/// what is there.
fn length_prefixed(mut data: &[u8]) -> impl Iterator<Item = &[u8]> {
    std::iter::from_fn(move || {
        let len = data.get(..4)?;
        let len = u32::from_be_bytes([len[0], len[1], len[2], len[3]]) as usize;
        let rest = &data[4..];
        let body = &rest[..len.min(rest.len())];
        data = &rest[body.len()..];
        Some(body)
    })
}
