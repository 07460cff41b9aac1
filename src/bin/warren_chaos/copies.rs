//! The copies checker: once the clients have stopped, and before the drain, every copy of a
//! queue that the cluster records synchronised, and the master's own, must hold every
//! confirmed persistent message of the queue that no client has been given yet.
//!
//! Each copy is read from its node's files with `warren inspect-queue --bodies` (read-only,
//! safe next to the running node): a confirm promises the message was fsynced by the master
//! and every synchronised mirror, so it is in their files. The drain alone cannot see a
//! mirror that lacks messages as long as it is never promoted; this checker can.
//!
//! Transient messages are not required (a restarted mirror's copy may drop them), nor are
//! messages a client was given (acked, or requeued and redelivered: the drain judges them),
//! nor messages of a queue incarnation deleted by request (the checker's rule).

use std::collections::HashSet;

use super::checker;
use super::cluster::Cluster;
use super::history::{self, History, Outcome};
use super::schedule::QUEUES;
use super::workload::queue_name;

/// The reasons to fail the run (empty: every copy holds what it must).
pub async fn check(cluster: &Cluster, history: &History) -> Vec<String> {
    let mut reasons = Vec::new();
    let states = match cluster.masters(None).await {
        Ok(s) => s,
        Err(e) => return vec![format!("copies: cannot list the queues' copies: {e:#}")],
    };
    for q in 0..QUEUES {
        let name = queue_name(q);
        let Some(state) = states.iter().find(|s| s.name == name) else {
            reasons.push(format!("copies: {name} is not listed"));
            continue;
        };
        let required = required(history, q);
        let holders: Vec<usize> = state
            .master
            .into_iter()
            .chain(state.synced.iter().copied())
            .collect();
        let names: Vec<String> = holders.iter().map(|n| format!("node{}", n + 1)).collect();
        println!(
            "  | copies: {name} must hold {} messages on {}",
            required.len(),
            names.join(", ")
        );
        for node in holders {
            let listing = match cluster.inspect_queue(node, &name).await {
                Ok(l) => l,
                Err(e) => {
                    reasons.push(format!("copies: {name} on node{}: {e:#}", node + 1));
                    continue;
                }
            };
            let held = held(&listing);
            let mut missing: Vec<&(u32, u64)> = required.difference(&held).collect();
            if missing.is_empty() {
                continue;
            }
            missing.sort();
            let role = if Some(node) == state.master {
                "the master"
            } else {
                "a mirror recorded synchronised"
            };
            let examples: Vec<String> = missing
                .iter()
                .take(3)
                .map(|(p, s)| format!("p{p}/#{s}"))
                .collect();
            reasons.push(format!(
                "copies: {name} on node{} ({role}) lacks {} of {} confirmed persistent messages no client was given, e.g. {}",
                node + 1,
                missing.len(),
                required.len(),
                examples.join(", ")
            ));
        }
    }
    reasons
}

/// (publisher, seq) of the confirmed persistent messages of queue `q` that no client has
/// been given and that no later re-declare of the queue excuses.
fn required(history: &History, q: usize) -> HashSet<(u32, u64)> {
    let h = history.lock();
    let given: HashSet<(u32, u64)> = h.deliveries.iter().map(|d| (d.publisher, d.seq)).collect();
    let mut out = HashSet::new();
    for (&p, msgs) in &h.published {
        for (seq, m) in msgs.iter().enumerate() {
            if m.queue == q
                && m.persistent
                && matches!(m.outcome, Outcome::Ack(_))
                && !given.contains(&(p, seq as u64))
                && !checker::excused_by_redeclare(&h, m)
            {
                out.insert((p, seq as u64));
            }
        }
    }
    out
}

/// (publisher, seq) of every body of this tool in an `inspect-queue --bodies` listing.
fn held(listing: &str) -> HashSet<(u32, u64)> {
    listing
        .lines()
        .skip(1)
        .filter_map(|l| {
            let hex = l.rsplit('\t').next()?;
            let bytes: Option<Vec<u8>> = (0..hex.len() / 2)
                .map(|i| u8::from_str_radix(hex.get(2 * i..2 * i + 2)?, 16).ok())
                .collect();
            history::parse(&bytes?).map(|(p, _, s)| (p, s))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_listing_yields_the_tools_messages_and_skips_the_rest() {
        let hex = |b: &[u8]| b.iter().map(|x| format!("{x:02x}")).collect::<String>();
        let listing = format!(
            "seq\tmsg_id\tdelivered\tsize\tstored\texpires_at_ms\tbody_hex\n\
             0\tab\tfalse\t64\tembedded\t-\t{}\n\
             1\tcd\tfalse\t64\tmsg_store\t-\t-\n\
             2\tef\ttrue\t3\tembedded\t-\t{}\n",
            hex(&history::body(3, 7, 42)),
            hex(b"abc")
        );
        assert_eq!(held(&listing), HashSet::from([(3, 42)]));
    }
}
