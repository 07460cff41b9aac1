//! A user's configure / write / read permissions in the connection's vhost, compiled once.

use regex::Regex;

use crate::amqp::reply_code::{access_refused, AmqpError};
use crate::meta::Permission;

/// The three permission kinds.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Access {
    /// Declare and delete.
    Configure,
    /// Publish to, bind to.
    Write,
    /// Consume from, bind from.
    Read,
}

/// Compiled permission regexes for one user in one vhost.
#[derive(Debug, Clone)]
pub struct Permissions {
    user: String,
    vhost: String,
    configure: Option<Regex>,
    write: Option<Regex>,
    read: Option<Regex>,
}

fn compile(re: &str) -> Option<Regex> {
    // RabbitMQ treats the empty string as "nothing"; anchor as RabbitMQ's re:run does not,
    // so a pattern matches anywhere unless the user anchors it, exactly like RabbitMQ.
    if re.is_empty() {
        None
    } else {
        Regex::new(re).ok()
    }
}

impl Permissions {
    /// Compiles `p` (or no permissions at all).
    pub fn new(user: &str, vhost: &str, p: Option<&Permission>) -> Permissions {
        Permissions {
            user: user.to_string(),
            vhost: vhost.to_string(),
            configure: p.and_then(|p| compile(&p.configure)),
            write: p.and_then(|p| compile(&p.write)),
            read: p.and_then(|p| compile(&p.read)),
        }
    }

    /// Checks `access` to the `kind` resource `name`; 403 when refused.
    pub fn check(&self, access: Access, kind: &str, name: &str) -> Result<(), AmqpError> {
        let re = match access {
            Access::Configure => &self.configure,
            Access::Write => &self.write,
            Access::Read => &self.read,
        };
        if re.as_ref().is_some_and(|r| r.is_match(name)) {
            return Ok(());
        }
        let what = match access {
            Access::Configure => "configure",
            Access::Write => "write",
            Access::Read => "read",
        };
        Err(access_refused(format!(
            "{what} access to {kind} '{name}' in vhost '{}' refused for user '{}'",
            self.vhost, self.user
        )))
    }
}
