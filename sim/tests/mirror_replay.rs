//! The mirror scenario's replay guarantee, in a test binary of its own: one seed, two runs,
//! one trace.
//!
//! Alone because, since the scenario runs the nodes' AMQP sessions and relay (session 42),
//! seed 5 replays differently when other simulations run on other threads of the same
//! process (`tests/seeds.rs`'s parallel tests): two clients' events in the same simulated
//! millisecond come in the other order (`sp0`/`sp1 leaves n2` at 11,171 ms). Run alone it
//! replays exactly (20 runs). Which state the threads share is not found yet
//! (`docs/reliability.md`, *Session 42*); this keeps the guarantee checked where it holds.

/// Mirror seed 5 (`tests/seeds.rs`'s `MIRROR_CI_SEEDS[4]`): a mirror promoted twice.
const SEED: u64 = 5;

mod replay;

#[test]
fn mirror_same_seed_same_trace() {
    replay::replays_exactly("mirror", sim::mirror_scenario::run_seed, SEED, "check:");
}
