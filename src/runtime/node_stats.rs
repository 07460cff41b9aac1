//! Reads a node's figures ([`NodeStats`]) from the process (`/proc`, `getrlimit`), the
//! broker and the facts fixed at start; for `GET /api/nodes`, for other nodes asking over
//! the node links, and for the Prometheus endpoint's process figures.

use std::time::Instant;

use crate::broker::node_stats::{ClusterLink, Endpoint, ListenerInfo, NodeStats};
use crate::broker::Broker;
use crate::runtime::node_link::TcpTransport;

/// What a node knows about itself from its start.
#[derive(Clone, Debug)]
pub struct NodeFacts {
    /// When the node started.
    pub started: Instant,
    /// `disk_free_limit_bytes`.
    pub disk_free_limit: u64,
    /// The configuration file, if the node was started with one.
    pub config_file: Option<String>,
    /// The data folder.
    pub data_dir: String,
    /// Its listeners, once all are bound.
    pub listeners: std::sync::OnceLock<Vec<ListenerInfo>>,
    /// A clustered node's node links, once they run.
    pub links: std::sync::OnceLock<TcpTransport>,
}

/// The node's figures now.
pub fn read(broker: &Broker, facts: &NodeFacts) -> NodeStats {
    let (fd_used, fd_total) = fds();
    let disk_free = broker
        .metrics()
        .disk_free_bytes
        .load(std::sync::atomic::Ordering::Relaxed);
    NodeStats {
        mem_used: resident_memory().unwrap_or(0),
        mem_limit: broker.memory_high_watermark(),
        mem_alarm: broker.memory_alarm(),
        disk_free: u64::try_from(disk_free).ok(),
        disk_free_limit: facts.disk_free_limit,
        disk_free_alarm: broker.disk_alarm(),
        fd_used,
        fd_total,
        sockets_used: broker.sessions().connections().len() as u64,
        uptime_ms: u64::try_from(facts.started.elapsed().as_millis()).unwrap_or(u64::MAX),
        os_pid: std::process::id(),
        processors: std::thread::available_parallelism().map_or(1, |n| n.get() as u32),
        config_file: facts.config_file.clone(),
        db_dir: facts.data_dir.clone(),
        listeners: facts.listeners.get().cloned().unwrap_or_default(),
        io: broker.metrics().io.snapshot(),
        cluster_links: cluster_links(broker, facts),
    }
}

/// The open node links, named by the metadata's node names (`#ID` for one it does not
/// know).
fn cluster_links(broker: &Broker, facts: &NodeFacts) -> Vec<ClusterLink> {
    let Some(t) = facts.links.get() else {
        return Vec::new();
    };
    let meta = broker.snapshot();
    t.link_stats()
        .into_iter()
        .map(|l| ClusterLink {
            name: meta
                .nodes
                .get(&l.peer)
                .map_or_else(|| format!("#{}", l.peer), |n| n.name.clone()),
            sock: l.sock_addr.map(endpoint),
            peer: l.peer_addr.map(endpoint),
            send_bytes: l.send_bytes,
            recv_bytes: l.recv_bytes,
        })
        .collect()
}

/// A socket address as the listings show it.
pub fn endpoint(a: std::net::SocketAddr) -> Endpoint {
    Endpoint {
        ip: a.ip().to_string(),
        port: a.port(),
    }
}

/// Resident memory of this process, from `/proc/self/statm` (Linux).
pub fn resident_memory() -> Option<u64> {
    let statm = std::fs::read_to_string("/proc/self/statm").ok()?;
    let pages: u64 = statm.split_whitespace().nth(1)?.parse().ok()?;
    // SAFETY: sysconf only reads a system constant.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    u64::try_from(page).ok().map(|p| pages * p)
}

/// (open file descriptors, their limit), where the platform tells.
pub fn fds() -> (Option<u64>, Option<u64>) {
    let open = std::fs::read_dir("/proc/self/fd")
        .ok()
        .map(|d| d.count() as u64);
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes into the struct it is given.
    let max = (unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } == 0)
        .then_some(limit.rlim_cur);
    (open, max)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_process_has_resident_memory_and_open_descriptors_under_its_limit() {
        let rss = resident_memory().expect("statm");
        assert!(rss > 1 << 20, "resident memory {rss}");
        let (open, max) = fds();
        let (open, max) = (open.expect("/proc/self/fd"), max.expect("getrlimit"));
        assert!(open >= 3 && open <= max, "{open} of {max}");
    }
}
