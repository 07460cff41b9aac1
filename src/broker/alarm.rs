//! Resource alarms as RabbitMQ's `rabbit_alarm` names them: the bits of a node's set. An
//! alarm on any node blocks publishers on every node (`broker::Broker::remote_alarm`); the
//! node links carry each node's set with their heartbeats.

/// `memory`: message bytes held above the high watermark.
pub const MEMORY: u8 = 1;
/// `disk`: free space below `disk_free_limit_bytes`.
pub const DISK: u8 = 2;

/// The resources of a set, with RabbitMQ's names (`memory`, `disk space` as its health
/// checks spell them), in that order.
pub fn resources(bits: u8) -> Vec<&'static str> {
    [(MEMORY, "memory"), (DISK, "disk space")]
        .into_iter()
        .filter(|(bit, _)| bits & bit != 0)
        .map(|(_, name)| name)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resources_are_named_as_rabbitmq_names_them() {
        assert_eq!(resources(0), Vec::<&str>::new());
        assert_eq!(resources(MEMORY | DISK), vec!["memory", "disk space"]);
        assert_eq!(resources(DISK), vec!["disk space"]);
    }
}
