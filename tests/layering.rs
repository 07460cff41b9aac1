//! Guards the layering (`docs/ARCHITECTURE.md`, "Layers").
//!
//! - The sans-IO cores never touch tokio, sockets, files, clocks or OS randomness. Only
//!   `src/runtime/` (the Raft driver included), `src/main.rs`, `src/bin/` and `src/config.rs`
//!   may.
//! - Imports between the cores go one way: each core has a rank and imports only cores of a
//!   lower rank. So no core imports `crate::runtime`, `meta` imports neither `mirror` nor
//!   `broker`, and `admin` (the `warrenctl` protocol) is held to the same rules as the rest.
//!
//! Test modules (`tests.rs`, `*_tests.rs`, a trailing `#[cfg(test)] mod tests`) may use the
//! runtime's real disk to test a core against it, so they are left out of the import check.

use std::path::{Path, PathBuf};

/// The cores and their ranks: a core may import only cores of a lower rank.
const RANKS: &[(&str, u8)] = &[
    ("time", 0),
    ("config", 0),
    ("shared_bytes", 0),
    ("amqp", 1),
    ("gm", 1),
    ("store", 1),
    ("metrics", 1),
    ("meta", 2),
    ("cluster", 3),
    ("broker", 3),
    ("mirror", 4),
    ("session", 4),
    ("admin", 5),
    ("mgmt", 6),
];

/// Top-level modules that are not cores: no core may import them.
const DRIVERS: &[&str] = &["runtime", "fuzzing"];

/// The cores checked for I/O (`config` loads files, so it is only a rank for imports).
const SANS_IO: &[&str] = &[
    "amqp",
    "session",
    "broker",
    "meta",
    "store",
    "gm",
    "mirror",
    "cluster",
    "mgmt",
    "metrics",
    "admin",
    "time.rs",
    "shared_bytes.rs",
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

fn src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    if dir.is_file() {
        out.push(dir.to_path_buf());
        return;
    }
    // A module is `name.rs`, `name/`, or both.
    let file = dir.with_extension("rs");
    if file.is_file() {
        out.push(file);
    }
    if !dir.is_dir() {
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

/// A file's code lines with their numbers, comments cut off.
fn code_lines(text: &str) -> impl Iterator<Item = (usize, &str)> {
    text.lines()
        .enumerate()
        .map(|(n, line)| (n + 1, line.split("//").next().unwrap_or("")))
}

fn rank(module: &str) -> Option<u8> {
    RANKS.iter().find(|(m, _)| *m == module).map(|(_, r)| *r)
}

/// The `crate::<module>` paths a line names.
fn imported_modules(line: &str) -> Vec<&str> {
    let mut found = Vec::new();
    let mut rest = line;
    while let Some(at) = rest.find("crate::") {
        let tail = &rest[at + "crate::".len()..];
        let end = tail
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(tail.len());
        found.push(&tail[..end]);
        rest = &tail[end..];
    }
    found
}

/// What is wrong with `core` importing what `text` imports.
fn import_violations(core: &str, text: &str) -> Vec<String> {
    let own = rank(core).expect("a ranked core");
    // A trailing inline test module is test code.
    let text = text.split("#[cfg(test)]\nmod tests").next().unwrap_or(text);
    let mut out = Vec::new();
    for (n, code) in code_lines(text) {
        for module in imported_modules(code) {
            if module == core {
                continue;
            }
            let wrong = match rank(module) {
                Some(r) => r >= own,
                None => DRIVERS.contains(&module),
            };
            if wrong {
                out.push(format!(
                    "line {n}: {core} imports {module}: {}",
                    code.trim()
                ));
            }
        }
    }
    out
}

fn is_test_file(path: &Path) -> bool {
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
    name == "tests.rs"
        || name.ends_with("_tests.rs")
        || path.components().any(|c| c.as_os_str() == "tests")
}

#[test]
fn sans_io_cores_use_no_runtime_io_or_clocks() {
    let mut files = Vec::new();
    for core in SANS_IO {
        rust_files(&src().join(core), &mut files);
    }
    assert!(
        files.len() >= 10,
        "expected the core modules, found {files:?}"
    );
    let mut violations = Vec::new();
    for f in &files {
        let text = std::fs::read_to_string(f).expect("readable source");
        for (n, code) in code_lines(&text) {
            for word in FORBIDDEN {
                if code.contains(word) {
                    violations.push(format!("{}:{n}: {}", f.display(), code.trim()));
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
fn cores_import_only_lower_ranked_cores() {
    let mut violations = Vec::new();
    let mut checked = 0;
    for (core, _) in RANKS {
        let mut files = Vec::new();
        rust_files(&src().join(core), &mut files);
        for f in files.iter().filter(|f| !is_test_file(f)) {
            let text = std::fs::read_to_string(f).expect("readable source");
            checked += 1;
            for v in import_violations(core, &text) {
                violations.push(format!("{}: {v}", f.display()));
            }
        }
    }
    assert!(checked >= 60, "expected the cores' files, read {checked}");
    assert!(
        violations.is_empty(),
        "imports against the layering:\n{}",
        violations.join("\n")
    );
}

#[test]
fn every_top_level_module_is_ranked_or_a_driver() {
    // A new top-level module must be placed in the layering, not slip past it.
    let mut unplaced = Vec::new();
    for entry in std::fs::read_dir(src()).expect("readable src dir") {
        let p = entry.expect("dir entry").path();
        let name = p
            .file_stem()
            .and_then(|n| n.to_str())
            .unwrap_or("")
            .to_string();
        if ["lib", "main", "bin"].contains(&name.as_str()) {
            continue;
        }
        if rank(&name).is_none() && !DRIVERS.contains(&name.as_str()) {
            unplaced.push(name);
        }
    }
    assert!(
        unplaced.is_empty(),
        "modules outside the layering: {unplaced:?}"
    );
}

#[test]
fn the_scans_catch_violations() {
    // The guards themselves must be able to fail.
    let line = "use tokio::net::TcpStream;";
    assert!(FORBIDDEN.iter().any(|w| line.contains(w)));
    assert_eq!(
        import_violations("meta", "use crate::mirror::HaPolicy;\n").len(),
        1
    );
    assert_eq!(
        import_violations("meta", "let x = crate::broker::Broker::new();\n").len(),
        1
    );
    assert_eq!(
        import_violations("admin", "use crate::runtime::raft::NodeId;\n").len(),
        1
    );
    assert_eq!(
        import_violations("gm", "fn f() { crate::gm::x(); crate::meta::y(); }\n").len(),
        1
    );
    // Lower ranks, comments and a trailing test module are allowed.
    assert!(import_violations(
        "mirror",
        "use crate::meta::NodeId;\n// crate::runtime\n#[cfg(test)]\nmod tests {\n use crate::runtime::file_disk::FileDisk;\n}\n"
    )
    .is_empty());
    assert!(is_test_file(Path::new(
        "src/store/msg_store/fault_tests.rs"
    )));
    assert!(!is_test_file(Path::new("src/store/msg_store/mod.rs")));
}
