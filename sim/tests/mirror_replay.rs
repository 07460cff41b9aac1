//! The mirror scenario's replay guarantee, in a test binary of its own (no simulation runs
//! on another thread of it): one seed, one trace, whether replayed as `sim --seed N` is, in
//! a process of its own, or run again in the same process after other tasks.
//!
//! A host's crash drops its tokio runtime, which shuts its tasks down in four lists chosen
//! by task id, from a counter the whole process shares: the order in which a crashed
//! node's sockets closed depended on how many tasks the process had spawned before (seed
//! 5: `sp0`/`sp1 leaves n2` at 11,171 ms). Every run now starts the ids at the same
//! residue (`sim::task_ids`).

use std::process::Command;

mod replay;

/// Mirror seed 5 (`tests/seeds.rs`'s `MIRROR_CI_SEEDS[4]`): a mirror promoted twice.
const SEED: u64 = 5;

fn trace() -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_sim"))
        .args(["--scenario", "mirror", "--seed", &SEED.to_string()])
        .env_remove("RUST_LOG")
        .output()
        .expect("run the sim binary");
    let text = String::from_utf8(out.stdout).expect("utf-8 trace");
    assert!(
        out.status.success(),
        "mirror seed {SEED} failed:\n{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    text
}

#[test]
fn mirror_same_seed_same_trace_in_fresh_processes() {
    let (a, b) = (trace(), trace());
    assert!(a.contains("check:"), "the mirror trace has content");
    same(&a, &b);
}

#[test]
fn mirror_same_seed_same_trace_after_other_tasks_in_the_process() {
    let run = || sim::mirror_scenario::run_seed(SEED).trace.join("\n");
    let first = run();
    assert!(first.contains("check:"), "the mirror trace has content");
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .expect("runtime");
    // One, then two, then three more tasks than the run before: each residue of the ids.
    for extra in 1..=3 {
        for _ in 0..extra {
            rt.block_on(async { tokio::spawn(async {}).await.expect("task") });
        }
        same(&first, &run());
    }
}

fn same(a: &str, b: &str) {
    replay::assert_same("mirror", SEED, a, b);
}
