//! Replays the fuzz corpora on stable Rust: every file of `fuzz/corpus/<target>/` and of
//! `fuzz/regressions/<target>/` (the inputs that once crashed a target, kept after the fix)
//! is fed to the entry point the libFuzzer target calls (`warren::fuzzing`), so CI checks
//! them without a nightly toolchain or cargo-fuzz. A panic fails the test and names the file.

use std::path::{Path, PathBuf};

use warren::fuzzing::TARGETS;

fn files(dir: &Path) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut files: Vec<PathBuf> = entries
        .map(|e| e.expect("read corpus folder entry").path())
        .filter(|p| p.is_file())
        .collect();
    files.sort();
    files
}

fn replay(kind: &str, require_files: bool) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fuzz")
        .join(kind);
    let mut total = 0;
    for (name, run) in TARGETS {
        let inputs = files(&root.join(name));
        assert!(
            !require_files || !inputs.is_empty(),
            "no {kind} files for target {name} in {}",
            root.join(name).display()
        );
        for path in &inputs {
            let bytes = std::fs::read(path).expect("read corpus file");
            let result = std::panic::catch_unwind(|| run(&bytes));
            assert!(
                result.is_ok(),
                "target {name} panicked on {}",
                path.display()
            );
        }
        println!("{kind}/{name}: {} files", inputs.len());
        total += inputs.len();
    }
    println!("{kind}: {total} files");
}

#[test]
fn every_corpus_file_decodes_without_panicking() {
    replay("corpus", true);
}

#[test]
fn every_crash_regression_decodes_without_panicking() {
    replay("regressions", false);
}
