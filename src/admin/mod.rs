//! The admin protocol behind `warrenctl`, sans-IO: frames, requests and their handling.
//!
//! The client's first frame is an [`Auth`]; only users tagged `administrator` pass, anyone
//! else gets a refusal and the connection is closed. Every later frame is a [`Request`],
//! answered by one [`Response`]. This module turns a request into a response from a
//! [`crate::broker::Broker`] and the current time; the socket side lives in
//! `runtime::admin`. Command names, arguments and columns follow `rabbitmqctl`.
//!
//! - [`wire`]: the frames (length prefix, bincode body, size limit) and [`Auth`].
//! - [`requests`]: [`Request`], [`Response`] and what the handler knows of its node.
//! - [`plans`]: authentication, and what a request does: an answer, or a command to commit.
//! - [`listing`]: the `list_*` and `cluster_status` tables.
//! - [`json`]: the small JSON reader (policy definitions) and writer (`--formatter json`).
//! - [`cli`]: parses a `rabbitmqctl`-style argument list into a [`Request`].
//! - [`mirrors`]: the mirror columns of `list_queues` and the `force_promote_mirror` choice.

pub mod cli;
pub mod json;
pub mod listing;
pub mod mirrors;
pub mod plans;
pub mod queue_info;
pub mod requests;
pub mod wire;

#[cfg(test)]
mod tests;

pub use listing::{channel_pid, connection_pid, consumer_activity, format_table};
pub use plans::{authenticate, handle, plan, plan_with_counts, Handled, ADMIN_TAG};
pub use requests::{NodeInfo, RemoteCounts, Request, Response};
pub use wire::{decode_body, encode_frame, frame_len, Auth, FrameError, MAX_FRAME};
