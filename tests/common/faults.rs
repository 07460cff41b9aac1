//! Network faults between real nodes on loopback: an nftables table that drops the packets
//! between chosen node addresses (nodes dial their peers from their own link address, so
//! node links are told apart by address; clients connect from 127.0.0.1 and pass). The
//! table is removed when the [`Partition`] is dropped, a failing test included.
//!
//! Needs root and `nft`. Without them a test that asks for a partition is skipped with a
//! message, unless `WARREN_REQUIRE_FAULTS=1` (set by `.ci/run`, which installs nftables),
//! where it fails.

use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};

static NEXT_TABLE: AtomicU32 = AtomicU32::new(0);

/// Whether partitions can be made here; `false` (after saying why) when a test should be
/// skipped, a panic when `WARREN_REQUIRE_FAULTS=1` and they cannot.
pub fn available() -> bool {
    let root = unsafe { libc::geteuid() } == 0;
    let nft = Command::new("nft")
        .args(["list", "tables"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if root && nft {
        return true;
    }
    let why = format!("partitions need root and nft (root: {root}, nft usable: {nft})");
    assert!(
        std::env::var("WARREN_REQUIRE_FAULTS").as_deref() != Ok("1"),
        "{why}, and WARREN_REQUIRE_FAULTS=1"
    );
    eprintln!("SKIPPED: {why}");
    false
}

/// Packets between `side` and `others` dropped, both ways, while this lives.
pub struct Partition {
    table: String,
}

impl Partition {
    /// Cuts every address in `side` off from every address in `others` (both directions).
    pub fn cut(side: &[&str], others: &[&str]) -> Partition {
        Partition::build(side, others, true)
    }

    /// Drops only what `from` sends to `to` (a one-way partition).
    pub fn one_way(from: &[&str], to: &[&str]) -> Partition {
        Partition::build(from, to, false)
    }

    fn build(a: &[&str], b: &[&str], both: bool) -> Partition {
        let table = format!(
            "warren_test_{}_{}",
            std::process::id(),
            NEXT_TABLE.fetch_add(1, Ordering::Relaxed)
        );
        let set = |xs: &[&str]| format!("{{ {} }}", xs.join(", "));
        let mut rules = format!(
            "table ip {table} {{\n chain output {{\n  type filter hook output priority 0; policy accept;\n  ip saddr {} ip daddr {} drop\n",
            set(a),
            set(b)
        );
        if both {
            rules.push_str(&format!("  ip saddr {} ip daddr {} drop\n", set(b), set(a)));
        }
        rules.push_str(" }\n}\n");
        let p = Partition { table };
        nft(&["-f", "-"], Some(&rules));
        p
    }
}

impl Drop for Partition {
    fn drop(&mut self) {
        nft(&["delete", "table", "ip", &self.table], None);
    }
}

fn nft(args: &[&str], input: Option<&str>) {
    use std::io::Write;
    let mut child = Command::new("nft")
        .args(args)
        .stdin(Stdio::piped())
        .spawn()
        .expect("run nft");
    if let Some(text) = input {
        child
            .stdin
            .take()
            .expect("stdin")
            .write_all(text.as_bytes())
            .expect("write nft rules");
    }
    drop(child.stdin.take());
    let status = child.wait().expect("nft");
    if !std::thread::panicking() {
        assert!(status.success(), "nft {args:?} failed");
    }
}

/// A folder and every file in it made immutable (`chattr +i`) while this lives: writes to
/// its files and new files in it fail (EPERM), root's included, as a failing disk refuses
/// them. Cleared when dropped, a failing test included. `None` (after saying why) when a
/// test should be skipped; a panic when `WARREN_REQUIRE_FAULTS=1` and it cannot be done.
pub struct Immutable {
    dir: std::path::PathBuf,
}

impl Immutable {
    pub fn set(dir: &std::path::Path) -> Option<Immutable> {
        let ok = Command::new("chattr")
            .args(["-R", "+i"])
            .arg(dir)
            .status()
            .is_ok_and(|s| s.success());
        if ok {
            return Some(Immutable { dir: dir.into() });
        }
        let why = format!(
            "cannot make {} immutable (root and chattr needed)",
            dir.display()
        );
        assert!(
            std::env::var("WARREN_REQUIRE_FAULTS").as_deref() != Ok("1"),
            "{why}, and WARREN_REQUIRE_FAULTS=1"
        );
        eprintln!("SKIPPED: {why}");
        None
    }
}

impl Drop for Immutable {
    fn drop(&mut self) {
        let _ = Command::new("chattr")
            .args(["-R", "-i"])
            .arg(&self.dir)
            .status();
    }
}
