//! Guards the layering: the sans-IO cores never touch tokio, sockets, files, clocks or OS
//! randomness. Only `src/runtime/`, `src/main.rs`, `src/bin/` and `src/config.rs` may.

use std::path::Path;

const CORES: &[&str] = &[
    "amqp", "session", "broker", "meta", "store", "gm", "mirror", "cluster", "mgmt", "metrics",
    "time.rs",
];
const FORBIDDEN: &[&str] = &[
    "tokio",
    "std::net",
    "std::fs",
    "Instant::now",
    "SystemTime::now",
    "thread_rng",
    "rand::random",
    "OsRng",
    "std::thread::sleep",
];

fn rust_files(dir: &Path, out: &mut Vec<std::path::PathBuf>) {
    if dir.is_file() {
        out.push(dir.to_path_buf());
        return;
    }
    for entry in std::fs::read_dir(dir).expect("readable src dir") {
        let p = entry.expect("dir entry").path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|e| e == "rs") {
            out.push(p);
        }
    }
}

#[test]
fn sans_io_cores_use_no_runtime_io_or_clocks() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    for core in CORES {
        rust_files(&src.join(core), &mut files);
    }
    // src/meta/raft/ is the tokio driver that replicates the meta core with openraft (whose
    // runtime trait itself requires a `thread_rng`); like src/runtime/ it is not a core.
    let raft_driver = src.join("meta").join("raft");
    files.retain(|f| !f.starts_with(&raft_driver));
    assert!(
        files.len() >= 10,
        "expected the core modules, found {files:?}"
    );
    let mut violations = Vec::new();
    for f in &files {
        let text = std::fs::read_to_string(f).expect("readable source");
        for (n, line) in text.lines().enumerate() {
            let code = line.split("//").next().unwrap_or("");
            for word in FORBIDDEN {
                if code.contains(word) {
                    violations.push(format!("{}:{}: {}", f.display(), n + 1, line.trim()));
                }
            }
        }
    }
    assert!(
        violations.is_empty(),
        "sans-IO violations:\n{}",
        violations.join("\n")
    );
}

#[test]
fn the_scan_catches_a_violation() {
    // The guard itself must be able to fail: a line using tokio in a core is reported.
    let line = "use tokio::net::TcpStream;";
    assert!(FORBIDDEN.iter().any(|w| line.contains(w)));
}
