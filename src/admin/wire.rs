//! The admin wire: TCP carrying length-prefixed frames, a big-endian `u32` length and then a
//! bincode-encoded body. The client's first frame is an [`Auth`]; every later frame is a
//! `Request`, answered by one `Response` (`super::requests`).

use serde::{de::DeserializeOwned, Deserialize, Serialize};

/// The largest frame body either side accepts.
pub const MAX_FRAME: usize = 16 << 20;

/// The client's first frame.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Auth {
    /// User name.
    pub user: String,
    /// Password.
    pub password: String,
}

/// Why a frame could not be encoded or decoded.
#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    /// The body is larger than [`MAX_FRAME`].
    #[error("frame of {0} bytes exceeds the {MAX_FRAME}-byte limit")]
    TooLarge(usize),
    /// The body is not a valid encoding.
    #[error("malformed frame: {0}")]
    Codec(#[from] bincode::Error),
}

/// Encodes `value` as a full frame (length prefix included).
pub fn encode_frame<T: Serialize>(value: &T) -> Result<Vec<u8>, FrameError> {
    let body = bincode::serialize(value)?;
    if body.len() > MAX_FRAME {
        return Err(FrameError::TooLarge(body.len()));
    }
    let mut out = Vec::with_capacity(4 + body.len());
    out.extend_from_slice(&(body.len() as u32).to_be_bytes());
    out.extend_from_slice(&body);
    Ok(out)
}

/// Checks a length prefix.
pub fn frame_len(prefix: [u8; 4]) -> Result<usize, FrameError> {
    let n = u32::from_be_bytes(prefix) as usize;
    if n > MAX_FRAME {
        return Err(FrameError::TooLarge(n));
    }
    Ok(n)
}

/// Decodes a frame body (without its prefix); trailing bytes are refused.
pub fn decode_body<T: DeserializeOwned>(body: &[u8]) -> Result<T, FrameError> {
    use bincode::Options;
    Ok(bincode::DefaultOptions::new()
        .with_fixint_encoding()
        .with_limit(MAX_FRAME as u64 * 4)
        .reject_trailing_bytes()
        .deserialize(body)?)
}
