//! Every run starts tokio's task ids at the same residue, so a seed replays the same in a
//! sweep as alone.
//!
//! Tokio numbers tasks from one counter per process, and a current-thread runtime (one per
//! turmoil host) keeps its tasks in four lists chosen by the id's two low bits. A crashed
//! host's runtime is dropped and shuts its tasks down list by list: which of its sockets
//! closes first, and so which client hears first, depended on how many tasks the process
//! had spawned before the run (mirror seed 5: `sp0`/`sp1 leaves n2` at 11,171 ms came in
//! the other order in a process's second run). Runs on other threads of the same process
//! (parallel tests) still take ids in between; a replay in a process of its own, as
//! `sim --seed N` is, is exact.

/// How many lists a current-thread runtime spreads its tasks over (tokio 1.54: `OwnedTasks::new(1)`
/// makes `1.next_power_of_two() * 4`).
const LISTS: u64 = 4;

/// Spawns throwaway tasks until the next task id is 1 modulo [`LISTS`], as in a fresh
/// process (whose first task is 1).
pub fn align() {
    let Ok(rt) = tokio::runtime::Builder::new_current_thread().build() else {
        return;
    };
    rt.block_on(async {
        loop {
            let id = match tokio::spawn(async { tokio::task::id() }).await {
                Ok(id) => id.to_string().parse::<u64>().unwrap_or(0),
                Err(_) => return,
            };
            if id % LISTS == 0 {
                return;
            }
        }
    });
}
