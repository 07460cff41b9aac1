//! Partitions that cut a node's links both ways or one way only (issue 17's fault mix).
//!
//! A one-way cut is the case a failure detector and a ring of neighbours find hardest: the
//! node cut on its way out still hears the others and acts on what they send (a Raft
//! append, a GM frame), but its answers are lost; the node cut on its way in is heard but
//! hears nothing. turmoil drops the segments, and a stream left with a hole is thrown away
//! by the transport (`transport.rs`), as a real link would time out.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Which way a partition cuts the node's links to the others.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Cut {
    /// Nothing passes.
    Both,
    /// What the node sends is lost; it still hears the others.
    Out,
    /// What the node is sent is lost; what it sends arrives.
    In,
}

impl Cut {
    /// The cuts for a seed's partitions: a third of them one way (either way equally). A
    /// stream of its own (from `seed` and the scenario's `salt`), so the rest of each
    /// seed's plan is what it was before one-way cuts existed.
    pub fn stream(seed: u64, salt: u64) -> impl FnMut() -> Cut {
        let mut rng = StdRng::seed_from_u64(seed ^ salt ^ 0x0e1a_0000);
        move || match rng.gen_range(0..6) {
            0 => Cut::Out,
            1 => Cut::In,
            _ => Cut::Both,
        }
    }

    /// Cuts `node`'s links to `others` (host names) in `sim`. [`turmoil::Sim::repair`]
    /// heals either kind.
    pub fn apply(self, sim: &mut turmoil::Sim<'_>, node: &str, others: &[String]) {
        for o in others {
            match self {
                Cut::Both => sim.partition(node, o.as_str()),
                Cut::Out => sim.partition_oneway(node, o.as_str()),
                Cut::In => sim.partition_oneway(o.as_str(), node),
            }
        }
    }
}
