//! The replay check both test binaries use.

/// Runs `scenario` twice for `seed`; the traces must be identical (and not trivial).
#[allow(dead_code)] // `tests/mirror_replay.rs` compares its own runs with `assert_same`.
pub fn replays_exactly(name: &str, run: fn(u64) -> sim::Outcome, seed: u64, marker: &str) {
    let a = run(seed).trace.join("\n");
    let b = run(seed).trace.join("\n");
    assert!(a.contains(marker), "the {name} trace has content");
    assert_same(name, seed, &a, &b);
}

/// Fails, naming the first line that differs, unless traces `a` and `b` are the same.
pub fn assert_same(name: &str, seed: u64, a: &str, b: &str) {
    if a != b {
        let first = a
            .lines()
            .zip(b.lines())
            .position(|(x, y)| x != y)
            .unwrap_or(a.lines().count().min(b.lines().count()));
        panic!(
            "{name} seed {seed} replayed differently from line {first}:\n  {:?}\n  {:?}",
            a.lines().nth(first),
            b.lines().nth(first)
        );
    }
}
