//! Why a metadata command was refused, and the AMQP reply each refusal maps to.

use crate::amqp::{AmqpError, ReplyCode};

/// A refused metadata command. Texts follow RabbitMQ's wording.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum MetaError {
    /// The vhost does not exist.
    #[error("no vhost '{0}'")]
    NoVhost(String),
    /// A named resource does not exist.
    #[error("no {kind} '{name}' in vhost '{vhost}'")]
    NotFound {
        /// `exchange` or `queue`.
        kind: &'static str,
        /// Its name.
        name: String,
        /// Its vhost.
        vhost: String,
    },
    /// A redeclaration differs from what exists.
    #[error("inequivalent arg '{arg}' for {kind} '{name}' in vhost '{vhost}': received {received} but current is {current}")]
    Inequivalent {
        /// `exchange` or `queue`.
        kind: &'static str,
        /// Its name.
        name: String,
        /// Its vhost.
        vhost: String,
        /// The differing property.
        arg: String,
        /// What the client sent.
        received: String,
        /// What exists.
        current: String,
    },
    /// The resource is in use (if-unused / if-empty deletes).
    #[error("{0}")]
    InUse(String),
    /// The name uses a reserved prefix.
    #[error("{kind} name '{name}' contains reserved prefix 'amq.*'")]
    Reserved {
        /// `exchange` or `queue`.
        kind: &'static str,
        /// Its name.
        name: String,
    },
    /// An exclusive queue belongs to another connection.
    #[error("cannot obtain exclusive access to locked queue '{name}' in vhost '{vhost}'. It could be originally declared on another connection or the exclusive property value does not match that of the original declaration.")]
    Locked {
        /// The queue.
        name: String,
        /// Its vhost.
        vhost: String,
    },
    /// An argument or value is invalid.
    #[error("{0}")]
    Invalid(String),
    /// An exchange type we do not know.
    #[error("invalid exchange type '{0}'")]
    UnknownExchangeType(String),
    /// Binding to or from, declaring or deleting the default exchange.
    #[error("operation not permitted on the default exchange")]
    DefaultExchange,
    /// A new queue would exceed its vhost's `max-queues` (RabbitMQ's channel error).
    #[error("cannot declare queue '{queue}': queue limit in vhost '{vhost}' ({limit}) is reached")]
    QueueLimit {
        /// The queue.
        queue: String,
        /// Its vhost.
        vhost: String,
        /// The vhost's `max-queues`.
        limit: u64,
    },
    /// The change could not be made durable.
    #[error("cannot store definitions: {0}")]
    Storage(String),
    /// A user, vhost or permission operation was refused.
    #[error("{0}")]
    Admin(String),
    /// The metadata Raft group refused the command (on whichever node applied it): the
    /// reply code and text the refusal had there.
    #[error("{text}")]
    Replicated {
        /// The AMQP reply code.
        code: u16,
        /// RabbitMQ's text.
        text: String,
    },
    /// The command could not be committed: no leader, no quorum, or no outcome in time.
    /// With `maybe_applied` it may still take effect.
    #[error("metadata store unavailable: {reason}")]
    Unavailable {
        /// What went wrong.
        reason: String,
        /// Whether the command may still be applied.
        maybe_applied: bool,
    },
}

impl From<MetaError> for AmqpError {
    fn from(e: MetaError) -> AmqpError {
        let code = match &e {
            MetaError::NoVhost(_) => ReplyCode::NotAllowed,
            MetaError::NotFound { .. } => ReplyCode::NotFound,
            MetaError::Inequivalent { .. }
            | MetaError::InUse(_)
            | MetaError::Invalid(_)
            | MetaError::QueueLimit { .. } => ReplyCode::PreconditionFailed,
            MetaError::Reserved { .. } | MetaError::DefaultExchange => ReplyCode::AccessRefused,
            MetaError::Locked { .. } => ReplyCode::ResourceLocked,
            MetaError::UnknownExchangeType(_) => ReplyCode::CommandInvalid,
            MetaError::Admin(_) => ReplyCode::PreconditionFailed,
            MetaError::Storage(_) | MetaError::Unavailable { .. } => ReplyCode::InternalError,
            MetaError::Replicated { code, .. } => {
                ReplyCode::from_code(*code).unwrap_or(ReplyCode::InternalError)
            }
        };
        AmqpError::new(code, e.to_string())
    }
}
