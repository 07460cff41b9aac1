//! Partitions of the node links with nftables: a table `ip warren_chaos_<pid>_<n>` whose
//! output-hook chain drops `ip saddr {A} ip daddr {B}` (the rules of `tests/common/faults.rs`).
//! Nodes dial their peers from their own link address, so this cuts node links; clients
//! connect from 127.0.0.1 and pass. Every table made is remembered until deleted, so the run's
//! end, an error and Ctrl-C all remove what is left ([`remove_all`]).

use std::io::Write;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Mutex;

use anyhow::{bail, Context, Result};

static NEXT_TABLE: AtomicU32 = AtomicU32::new(0);
static LIVE: Mutex<Vec<String>> = Mutex::new(Vec::new());

/// Root and a working `nft`, or an error that says what is missing.
pub fn check_available() -> Result<()> {
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    let nft = Command::new("nft")
        .args(["list", "tables"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .output();
    let nft_ok = matches!(&nft, Ok(o) if o.status.success());
    if root && nft_ok {
        return Ok(());
    }
    let why = match nft {
        Err(e) => format!("`nft` cannot run ({e}): install nftables"),
        Ok(o) if !o.status.success() => format!(
            "`nft list tables` fails: {}",
            String::from_utf8_lossy(&o.stderr).trim()
        ),
        Ok(_) => "nft works".to_string(),
    };
    bail!(
        "warren-chaos needs root (for nftables partitions) and a working `nft`: root={root}; {why}"
    )
}

/// A cut in place while this lives (and after, until [`remove_all`] if dropping failed).
pub struct Cut {
    table: String,
}

impl Cut {
    /// Drops what `from` sends to `to`, and what `to` sends to `from` when `both`.
    pub fn new(from: &[String], to: &[String], both: bool) -> Result<Cut> {
        let table = format!(
            "warren_chaos_{}_{}",
            std::process::id(),
            NEXT_TABLE.fetch_add(1, Ordering::Relaxed)
        );
        let set = |xs: &[String]| format!("{{ {} }}", xs.join(", "));
        let mut rules = format!(
            "table ip {table} {{\n chain output {{\n  type filter hook output priority 0; policy accept;\n  ip saddr {} ip daddr {} drop\n",
            set(from),
            set(to)
        );
        if both {
            rules.push_str(&format!(
                "  ip saddr {} ip daddr {} drop\n",
                set(to),
                set(from)
            ));
        }
        rules.push_str(" }\n}\n");
        LIVE.lock().unwrap().push(table.clone());
        nft(&["-f", "-"], Some(&rules)).context("install a partition")?;
        Ok(Cut { table })
    }

    /// Removes the cut now.
    pub fn heal(self) -> Result<()> {
        let table = self.table.clone();
        std::mem::forget(self);
        remove(&table)
    }
}

impl Drop for Cut {
    fn drop(&mut self) {
        let _ = remove(&self.table);
    }
}

fn remove(table: &str) -> Result<()> {
    nft(&["delete", "table", "ip", table], None)?;
    LIVE.lock().unwrap().retain(|t| t != table);
    Ok(())
}

/// Deletes every table this process made that is still there.
pub fn remove_all() {
    let tables: Vec<String> = LIVE.lock().map(|l| l.clone()).unwrap_or_default();
    for t in tables {
        if let Err(e) = remove(&t) {
            eprintln!("warren-chaos: could not delete nft table {t}: {e:#}");
        }
    }
}

fn nft(args: &[&str], input: Option<&str>) -> Result<()> {
    let mut child = Command::new("nft")
        .args(args)
        .stdin(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .context("run nft")?;
    if let Some(text) = input {
        child
            .stdin
            .take()
            .context("nft stdin")?
            .write_all(text.as_bytes())?;
    }
    drop(child.stdin.take());
    let out = child.wait_with_output()?;
    if !out.status.success() {
        bail!(
            "nft {args:?}: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}
