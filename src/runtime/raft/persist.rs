//! How the Raft state reaches the [`Disk`]: bincode payloads behind a format byte, framed by
//! [`crate::store::record`] so a torn or flipped write is detected, and small files replaced
//! atomically (write a temporary, fsync, rename, fsync the folder).

use std::path::{Path, PathBuf};

use bincode::Options;
use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::store::{record, Disk, DiskError};

/// Format byte in front of every payload this module writes; bump it on an incompatible change
/// (or give the changed payload its own, as the snapshot image does with [`encode_as`]).
pub const FORMAT: u8 = 1;

/// Why Raft state could not be stored or read back.
#[derive(Debug, thiserror::Error)]
pub enum PersistError {
    /// The disk failed.
    #[error(transparent)]
    Disk(#[from] DiskError),
    /// A value did not encode (a bug: every stored type is plain data).
    #[error("cannot encode {what}: {reason}")]
    Encode {
        /// What was being written.
        what: &'static str,
        /// The encoder's complaint.
        reason: String,
    },
    /// Stored bytes passed their checksum but do not decode, or use an unknown format.
    #[error("{path}: cannot decode {what}: {reason}")]
    Decode {
        /// The file.
        path: PathBuf,
        /// What was being read.
        what: &'static str,
        /// The decoder's complaint.
        reason: String,
    },
    /// Data that was acknowledged as durable is damaged or missing.
    #[error("{path}: {reason}")]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
}

/// bincode with fixed-width integers, refusing trailing bytes: a payload read back as the
/// wrong type then fails instead of decoding as garbage.
fn codec() -> impl bincode::Options {
    bincode::DefaultOptions::new()
        .with_fixint_encoding()
        .reject_trailing_bytes()
}

/// The versioned bincode payload of `value`.
pub fn encode<T: Serialize>(what: &'static str, value: &T) -> Result<Vec<u8>, PersistError> {
    encode_as(FORMAT, what, value)
}

/// The bincode payload of `value` behind format byte `format`: for a payload whose layout
/// changed (the snapshot image), so readers tell the layouts apart by that byte.
pub fn encode_as<T: Serialize>(
    format: u8,
    what: &'static str,
    value: &T,
) -> Result<Vec<u8>, PersistError> {
    let mut out = vec![format];
    codec()
        .serialize_into(&mut out, value)
        .map_err(|e| PersistError::Encode {
            what,
            reason: e.to_string(),
        })?;
    Ok(out)
}

/// Decodes a payload written by [`encode`]; `path` only names the source in errors.
pub fn decode<T: DeserializeOwned>(
    what: &'static str,
    path: &Path,
    payload: &[u8],
) -> Result<T, PersistError> {
    decode_as(FORMAT, what, path, payload)
}

/// Decodes a payload written by [`encode_as`] with `format`; another format byte is an error.
pub fn decode_as<T: DeserializeOwned>(
    format: u8,
    what: &'static str,
    path: &Path,
    payload: &[u8],
) -> Result<T, PersistError> {
    let err = |reason: String| PersistError::Decode {
        path: path.to_path_buf(),
        what,
        reason,
    };
    match payload.split_first() {
        Some((&f, body)) if f == format => {
            codec().deserialize(body).map_err(|e| err(e.to_string()))
        }
        Some((other, _)) => Err(err(format!("unknown format {other}"))),
        None => Err(err("empty payload".into())),
    }
}

/// One framed record holding `payload`.
pub fn frame(payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(payload.len() + record::RECORD_OVERHEAD);
    record::encode(&mut out, payload);
    out
}

/// Replaces `dir/name` with one record holding `value`, durably: once this returns, a crash
/// leaves either the old or the new value, never a mix.
pub fn write_durable<T: Serialize>(
    disk: &dyn Disk,
    dir: &Path,
    name: &str,
    what: &'static str,
    value: &T,
) -> Result<(), PersistError> {
    let bytes = frame(&encode(what, value)?);
    let tmp = dir.join(format!("{name}.tmp"));
    disk.write_file(&tmp, &bytes)?;
    disk.sync(&tmp)?;
    disk.rename(&tmp, &dir.join(name))?;
    disk.sync_dir(dir)?;
    Ok(())
}

/// Replaces `dir/name` without waiting for the disk: for hints whose loss or damage is
/// harmless (a damaged file reads back as absent through [`read_hint`]).
pub fn write_hint<T: Serialize>(
    disk: &dyn Disk,
    dir: &Path,
    name: &str,
    what: &'static str,
    value: &T,
) -> Result<(), PersistError> {
    let bytes = frame(&encode(what, value)?);
    disk.write_file(&dir.join(name), &bytes)?;
    Ok(())
}

/// The value in `dir/name`, `None` when the file does not exist. A damaged file is an error:
/// [`write_durable`] never leaves one behind.
pub fn read_durable<T: DeserializeOwned>(
    disk: &dyn Disk,
    dir: &Path,
    name: &str,
    what: &'static str,
) -> Result<Option<T>, PersistError> {
    let path = dir.join(name);
    let bytes = match disk.read(&path) {
        Ok(b) => b,
        Err(DiskError::NotFound(_)) => return Ok(None),
        Err(e) => return Err(e.into()),
    };
    let (found, _) = record::scan(&bytes);
    match found.first() {
        Some(r) => decode(what, &path, r.payload).map(Some),
        None => Err(PersistError::Corrupt {
            path,
            reason: format!("{what} record is torn or fails its checksum"),
        }),
    }
}

/// The value in `dir/name` written by [`write_hint`]; absent or damaged reads as `None`.
pub fn read_hint<T: DeserializeOwned>(
    disk: &dyn Disk,
    dir: &Path,
    name: &str,
    what: &'static str,
) -> Result<Option<T>, PersistError> {
    match read_durable(disk, dir, name, what) {
        Ok(v) => Ok(v),
        Err(PersistError::Corrupt { .. } | PersistError::Decode { .. }) => {
            tracing::warn!(file = name, "ignoring a damaged {what} hint");
            Ok(None)
        }
        Err(e) => Err(e),
    }
}
