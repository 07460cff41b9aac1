//! AMQP reply codes and the error that carries one to a channel or connection close.

/// Reply codes from the AMQP 0-9-1 spec (constants section), as RabbitMQ uses them.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
#[repr(u16)]
pub enum ReplyCode {
    /// 200: normal close.
    ReplySuccess = 200,
    /// 311: message body too large (soft).
    ContentTooLarge = 311,
    /// 312: mandatory message could not be routed (basic.return only).
    NoRoute = 312,
    /// 313: immediate message had no consumer (basic.return only).
    NoConsumers = 313,
    /// 320: the server closed the connection (shutdown).
    ConnectionForced = 320,
    /// 402: invalid path.
    InvalidPath = 402,
    /// 403: access refused (soft).
    AccessRefused = 403,
    /// 404: not found (soft).
    NotFound = 404,
    /// 405: resource locked (soft).
    ResourceLocked = 405,
    /// 406: precondition failed (soft).
    PreconditionFailed = 406,
    /// 501: frame error.
    FrameError = 501,
    /// 502: syntax error.
    SyntaxError = 502,
    /// 503: command invalid.
    CommandInvalid = 503,
    /// 504: channel error.
    ChannelError = 504,
    /// 505: unexpected frame.
    UnexpectedFrame = 505,
    /// 506: resource error.
    ResourceError = 506,
    /// 530: not allowed.
    NotAllowed = 530,
    /// 540: not implemented.
    NotImplemented = 540,
    /// 541: internal error.
    InternalError = 541,
}

impl ReplyCode {
    /// The numeric code.
    pub fn code(self) -> u16 {
        self as u16
    }

    /// The reply code with number `code`, if it is one.
    pub fn from_code(code: u16) -> Option<ReplyCode> {
        use ReplyCode::*;
        [
            ReplySuccess,
            ContentTooLarge,
            NoRoute,
            NoConsumers,
            ConnectionForced,
            InvalidPath,
            AccessRefused,
            NotFound,
            ResourceLocked,
            PreconditionFailed,
            FrameError,
            SyntaxError,
            CommandInvalid,
            ChannelError,
            UnexpectedFrame,
            ResourceError,
            NotAllowed,
            NotImplemented,
            InternalError,
        ]
        .into_iter()
        .find(|c| c.code() == code)
    }

    /// Hard errors close the connection; soft errors close only the channel.
    pub fn is_hard(self) -> bool {
        !matches!(
            self,
            ReplyCode::ReplySuccess
                | ReplyCode::ContentTooLarge
                | ReplyCode::NoRoute
                | ReplyCode::NoConsumers
                | ReplyCode::AccessRefused
                | ReplyCode::NotFound
                | ReplyCode::ResourceLocked
                | ReplyCode::PreconditionFailed
        )
    }

    /// The spec's name, used as the start of reply texts as RabbitMQ does.
    pub fn name(self) -> &'static str {
        match self {
            ReplyCode::ReplySuccess => "OK",
            ReplyCode::ContentTooLarge => "CONTENT_TOO_LARGE",
            ReplyCode::NoRoute => "NO_ROUTE",
            ReplyCode::NoConsumers => "NO_CONSUMERS",
            ReplyCode::ConnectionForced => "CONNECTION_FORCED",
            ReplyCode::InvalidPath => "INVALID_PATH",
            ReplyCode::AccessRefused => "ACCESS_REFUSED",
            ReplyCode::NotFound => "NOT_FOUND",
            ReplyCode::ResourceLocked => "RESOURCE_LOCKED",
            ReplyCode::PreconditionFailed => "PRECONDITION_FAILED",
            ReplyCode::FrameError => "FRAME_ERROR",
            ReplyCode::SyntaxError => "SYNTAX_ERROR",
            ReplyCode::CommandInvalid => "COMMAND_INVALID",
            ReplyCode::ChannelError => "CHANNEL_ERROR",
            ReplyCode::UnexpectedFrame => "UNEXPECTED_FRAME",
            ReplyCode::ResourceError => "RESOURCE_ERROR",
            ReplyCode::NotAllowed => "NOT_ALLOWED",
            ReplyCode::NotImplemented => "NOT_IMPLEMENTED",
            ReplyCode::InternalError => "INTERNAL_ERROR",
        }
    }
}

/// An error that closes a channel (soft code) or the connection (hard code).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{} - {text}", code.name())]
pub struct AmqpError {
    /// The reply code.
    pub code: ReplyCode,
    /// Human-readable text (RabbitMQ style, without the code name).
    pub text: String,
    /// Class of the method that failed (0 when none).
    pub class_id: u16,
    /// Method that failed (0 when none).
    pub method_id: u16,
}

impl AmqpError {
    /// An error not tied to a method.
    pub fn new(code: ReplyCode, text: impl Into<String>) -> AmqpError {
        AmqpError {
            code,
            text: text.into(),
            class_id: 0,
            method_id: 0,
        }
    }

    /// Attributes the error to a method (only when not attributed yet).
    pub fn at(mut self, class_id: u16, method_id: u16) -> AmqpError {
        if self.class_id == 0 && self.method_id == 0 {
            self.class_id = class_id;
            self.method_id = method_id;
        }
        self
    }

    /// Whether this error closes the whole connection.
    pub fn is_hard(&self) -> bool {
        self.code.is_hard()
    }

    /// The reply text as sent: `NAME - text`, cut to 255 bytes.
    pub fn reply_text(&self) -> String {
        let mut s = format!("{} - {}", self.code.name(), self.text);
        if s.len() > 255 {
            let mut end = 255;
            while !s.is_char_boundary(end) {
                end -= 1;
            }
            s.truncate(end);
        }
        s
    }
}

/// Shorthands for the common errors.
macro_rules! err_fn {
    ($name:ident, $code:ident) => {
        /// Builds an [`AmqpError`] with this code.
        pub fn $name(text: impl Into<String>) -> AmqpError {
            AmqpError::new(ReplyCode::$code, text)
        }
    };
}
err_fn!(not_found, NotFound);
err_fn!(access_refused, AccessRefused);
err_fn!(resource_locked, ResourceLocked);
err_fn!(precondition_failed, PreconditionFailed);
err_fn!(command_invalid, CommandInvalid);
err_fn!(not_allowed, NotAllowed);
err_fn!(channel_error, ChannelError);
err_fn!(unexpected_frame, UnexpectedFrame);
err_fn!(frame_error, FrameError);
err_fn!(syntax_error, SyntaxError);
err_fn!(not_implemented, NotImplemented);
err_fn!(internal_error, InternalError);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hard_and_soft_codes_follow_the_spec() {
        for c in [
            ReplyCode::AccessRefused,
            ReplyCode::NotFound,
            ReplyCode::ResourceLocked,
            ReplyCode::PreconditionFailed,
        ] {
            assert!(!c.is_hard(), "{c:?}");
        }
        for c in [
            ReplyCode::FrameError,
            ReplyCode::SyntaxError,
            ReplyCode::CommandInvalid,
            ReplyCode::ChannelError,
            ReplyCode::UnexpectedFrame,
            ReplyCode::NotAllowed,
            ReplyCode::NotImplemented,
            ReplyCode::ConnectionForced,
        ] {
            assert!(c.is_hard(), "{c:?}");
        }
        assert_eq!(ReplyCode::NotImplemented.code(), 540);
    }

    #[test]
    fn reply_text_is_cut_to_a_short_string() {
        let e = not_found("x".repeat(400));
        assert_eq!(e.reply_text().len(), 255);
        assert!(e.reply_text().starts_with("NOT_FOUND - "));
    }
}
