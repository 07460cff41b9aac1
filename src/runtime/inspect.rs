//! Read-only inspection of a node's storage (`warren inspect-queue`, `warren inspect-message`):
//! list a queue's index entries, read a message body by id from the message store. Nothing
//! here writes, truncates or repairs, so it is safe next to a running node; what it reports is
//! what the files hold at that moment (recent writes may still be in the syncer's batch).

use std::fmt::Write as _;
use std::path::Path;

use amq_protocol::protocol::basic::parse_properties;

use super::file_disk::FileDisk;
use super::storage::queue_dir_name;
use crate::store::message_codec::StoredMessage;
use crate::store::msg_store::{parse_file_name, MsgId};
use crate::store::queue_index::codec;
use crate::store::queue_index::rebuild::Rebuild;
use crate::store::queue_index::{IndexConfig, IndexEntry, JOURNAL_FILE, META_FILE, SEGMENT_SUFFIX};
use crate::store::{record, Disk, DiskError};

/// Why inspection failed.
#[derive(Debug, thiserror::Error)]
pub enum InspectError {
    /// A file could not be read.
    #[error("{0}")]
    Disk(#[from] DiskError),
    /// The queue has no index folder (not durable, or nothing persistent was ever written).
    #[error("no index for queue '{name}' in vhost '{vhost}' under {dir}")]
    NoQueue {
        /// Vhost.
        vhost: String,
        /// Queue.
        name: String,
        /// Where it was looked for.
        dir: String,
    },
    /// The id is not 32 hex digits.
    #[error("message id must be 32 hex digits, got '{0}'")]
    BadId(String),
    /// No such message in the store.
    #[error("message {0} is not in the message store (embedded in a queue index, or gone)")]
    NotFound(String),
    /// The stored bytes do not decode.
    #[error("message {0} is stored but does not decode")]
    Undecodable(String),
}

/// The live (un-acked) entries of a queue's index, in seq order, from its files.
pub fn queue_entries(
    data_dir: &Path,
    vhost: &str,
    name: &str,
) -> Result<Vec<IndexEntry>, InspectError> {
    let disk = FileDisk::new();
    let dir = data_dir.join("queues").join(queue_dir_name(vhost, name));
    let names = disk.list(&dir)?;
    if names.is_empty() {
        return Err(InspectError::NoQueue {
            vhost: vhost.into(),
            name: name.into(),
            dir: dir.display().to_string(),
        });
    }
    // The same fold the index does at open (sans-IO `Rebuild`), without writing anything.
    let entries_per_segment = match disk.read(&dir.join(META_FILE)) {
        Ok(bytes) => {
            codec::decode_meta(&bytes).unwrap_or(IndexConfig::default().segment_entry_count)
        }
        Err(_) => IndexConfig::default().segment_entry_count,
    };
    let mut rebuild = Rebuild::new(entries_per_segment, false);
    if names.iter().any(|n| n == JOURNAL_FILE) {
        for r in codec::scan(&disk.read(&dir.join(JOURNAL_FILE))?).records {
            rebuild.journal_record(r);
        }
    }
    let files: std::collections::BTreeSet<u64> = names
        .iter()
        .filter_map(|n| n.strip_suffix(SEGMENT_SUFFIX).and_then(|s| s.parse().ok()))
        .collect();
    let mut entries = Vec::new();
    for n in rebuild.segments(files.iter().copied()) {
        let mut fold = rebuild.start_segment(n, files.contains(&n));
        if files.contains(&n) {
            let bytes = disk.read(&dir.join(format!("{n}{SEGMENT_SUFFIX}")))?;
            for r in codec::scan(&bytes).records {
                fold.file_record(r);
            }
        }
        entries.extend(rebuild.finish_segment(fold, false).live);
    }
    Ok(entries)
}

/// The body of each of `entries`, in order (`inspect-queue --bodies`): an embedded one from
/// the index, the others from the persistent message store, read in one pass. `None`: not
/// found (gone from the store) or undecodable.
pub fn entry_bodies(
    data_dir: &Path,
    entries: &[IndexEntry],
) -> Result<Vec<Option<Vec<u8>>>, InspectError> {
    let decode = |bytes: &[u8]| StoredMessage::decode(bytes).ok().map(|m| m.body.to_vec());
    let wanted: std::collections::HashSet<[u8; 16]> = entries
        .iter()
        .filter(|e| e.publish.embedded.is_none())
        .map(|e| e.publish.msg_id)
        .collect();
    let mut stored: std::collections::HashMap<[u8; 16], Vec<u8>> = Default::default();
    if !wanted.is_empty() {
        let disk = FileDisk::new();
        let dir = data_dir.join("msg_store_persistent");
        // The newest copy wins, as in `message_bytes`.
        for name in store_files(&disk, &dir)? {
            let bytes = disk.read(&dir.join(&name))?;
            for r in record::scan(&bytes).0 {
                if let Some(MsgId(id)) = MsgId::from_prefix(r.payload) {
                    if wanted.contains(&id) {
                        stored.insert(id, r.payload[MsgId::LEN..].to_vec());
                    }
                }
            }
        }
    }
    Ok(entries
        .iter()
        .map(|e| match &e.publish.embedded {
            Some(bytes) => decode(bytes),
            None => stored.get(&e.publish.msg_id).and_then(|b| decode(b)),
        })
        .collect())
}

/// `inspect-queue` output: tab-separated, with a header; with `bodies` (as
/// [`entry_bodies`] gives them) a last column holds each body in hex (`-`: not found).
pub fn format_queue(entries: &[IndexEntry], bodies: Option<&[Option<Vec<u8>>]>) -> String {
    let mut out = String::from("seq\tmsg_id\tdelivered\tsize\tstored\texpires_at_ms");
    out.push_str(if bodies.is_some() {
        "\tbody_hex\n"
    } else {
        "\n"
    });
    for (i, e) in entries.iter().enumerate() {
        let p = &e.publish;
        let _ = write!(
            out,
            "{}\t{}\t{}\t{}\t{}\t{}",
            p.seq,
            MsgId(p.msg_id),
            e.delivered,
            p.size,
            if p.embedded.is_some() {
                "embedded"
            } else {
                "msg_store"
            },
            p.expires_at_ms.map_or("-".to_string(), |t| t.to_string())
        );
        if let Some(bodies) = bodies {
            out.push('\t');
            match bodies.get(i).and_then(|b| b.as_ref()) {
                Some(b) => b.iter().for_each(|x| {
                    let _ = write!(out, "{x:02x}");
                }),
                None => out.push('-'),
            }
        }
        out.push('\n');
    }
    out
}

/// Reads a message's stored bytes by id from the persistent message store's files.
pub fn message_bytes(data_dir: &Path, id_hex: &str) -> Result<Vec<u8>, InspectError> {
    let id = parse_id(id_hex)?;
    let disk = FileDisk::new();
    let dir = data_dir.join("msg_store_persistent");
    // The newest copy wins (compaction may leave an older duplicate behind a crash).
    let mut found = None;
    for name in store_files(&disk, &dir)? {
        let bytes = disk.read(&dir.join(&name))?;
        let (records, _) = record::scan(&bytes);
        for r in records {
            if r.payload.len() >= MsgId::LEN && MsgId::from_prefix(r.payload) == Some(id) {
                found = Some(r.payload[MsgId::LEN..].to_vec());
            }
        }
    }
    found.ok_or_else(|| InspectError::NotFound(id_hex.to_string()))
}

/// `inspect-message` output: routing information, properties and the body (lossy UTF-8,
/// first 1 KiB).
pub fn format_message(id_hex: &str, bytes: &[u8]) -> Result<String, InspectError> {
    let m = StoredMessage::decode(bytes).map_err(|_| InspectError::Undecodable(id_hex.into()))?;
    // The recursive parser must not overflow the stack on a damaged file.
    let props = if crate::amqp::nesting::properties_too_deep(&m.properties_raw) {
        "(headers nested too deep)".into()
    } else {
        parse_properties(&m.properties_raw[..])
            .map(|(_, p)| format!("{p:?}"))
            .unwrap_or_else(|_| "(undecodable)".into())
    };
    let shown = &m.body[..m.body.len().min(1024)];
    Ok(format!(
        "id\t{id_hex}\nexchange\t{}\nrouting_key\t{}\nproperties\t{props}\nbody_bytes\t{}\nbody\t{}\n",
        m.exchange,
        m.routing_key,
        m.body.len(),
        String::from_utf8_lossy(shown)
    ))
}

/// The message store's file names in `dir`, oldest first.
fn store_files(disk: &FileDisk, dir: &Path) -> Result<Vec<String>, InspectError> {
    let mut files: Vec<(u64, String)> = disk
        .list(dir)?
        .into_iter()
        .filter_map(|n| parse_file_name(&n).map(|k| (k, n)))
        .collect();
    files.sort();
    Ok(files.into_iter().map(|(_, n)| n).collect())
}

fn parse_id(hex: &str) -> Result<MsgId, InspectError> {
    let bad = || InspectError::BadId(hex.to_string());
    if hex.len() != 32 {
        return Err(bad());
    }
    let mut id = [0u8; 16];
    for (i, b) in id.iter_mut().enumerate() {
        *b = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).map_err(|_| bad())?;
    }
    Ok(MsgId(id))
}
