//! The cluster under test: real `warren` processes on loopback, one address per node
//! (127.X.Y.i, X and Y from the seed and this process's id so concurrent runs never meet),
//! standard ports on that address, a data dir each under the run's folder; and `warrenctl`
//! against their admin endpoints. Configs follow `tests/common/procs.rs` (`config_text`),
//! the reference for a working cluster config.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

/// The failure detector's settings, as the repo's real-process tests use them.
pub const PEER_TIMEOUT_MS: u64 = 1500;
pub const HEARTBEAT_MS: u64 = 100;

/// How long a node may take to serve clients after it is started.
const START_TIMEOUT: Duration = Duration::from_secs(45);

pub struct Node {
    pub index: usize,
    pub ip: String,
    pub name: String,
    /// The data folder (its own file system with `--extended`).
    pub data: PathBuf,
    config: PathBuf,
    log: PathBuf,
    child: Option<Child>,
    /// Bytes of the log before the current process started: "node listening" is looked
    /// for after it, so one log holds every run of the node (kept whole for the report).
    log_start: u64,
    paused: bool,
}

pub struct Cluster {
    pub nodes: Vec<Node>,
    warren: PathBuf,
    warrenctl: PathBuf,
    /// Whether each data folder is a mounted image (`--extended`).
    mounted: bool,
    /// Spares added so far: each gets a new id (a forgotten id is never reused).
    spares: usize,
}

fn config_text(id: usize, ip: &str, cluster: &str, ips: &[String], data: &Path) -> String {
    let mut members = String::new();
    for (i, peer) in ips.iter().enumerate() {
        members.push_str(&format!(
            "[[cluster.initial_members]]\nid = {}\nlink = \"{peer}:25672\"\n\n",
            i + 1
        ));
    }
    format!(
        r#"[node]
name = "warren{id}@chaos"
data_dir = "{data}"

[amqp]
listen = "{ip}:5672"

[admin]
listen = "{ip}:5679"

[management]
listen = "{ip}:15672"

[prometheus]
listen = "{ip}:15692"

[limits]
memory_high_watermark_bytes = 1073741824

[cluster]
node_id = {id}
cluster_id = "chaos-{cluster}"
listen = "{ip}:25672"
peer_timeout_ms = {PEER_TIMEOUT_MS}
heartbeat_ms = {HEARTBEAT_MS}
commit_timeout_ms = 5000

{members}"#,
        data = data.display(),
    )
}

impl Node {
    pub fn amqp_uri(&self) -> String {
        format!("amqp://guest:guest@{}:5672/%2f", self.ip)
    }

    pub fn admin(&self) -> String {
        format!("{}:5679", self.ip)
    }

    pub fn running(&self) -> bool {
        self.child.is_some()
    }

    /// The process id while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    fn spawn(&mut self, warren: &Path) -> Result<()> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .context("node log")?;
        self.log_start = log.metadata().map(|m| m.len()).unwrap_or(0);
        let child = Command::new(warren)
            .arg("--config")
            .arg(&self.config)
            .env(
                "RUST_LOG",
                std::env::var("CHAOS_NODE_LOG").unwrap_or_else(|_| "info,openraft=warn".into()),
            )
            .env("NO_COLOR", "1")
            .stdout(log.try_clone()?)
            .stderr(log)
            .stdin(Stdio::null())
            .spawn()
            .with_context(|| format!("start {}", warren.display()))?;
        self.child = Some(child);
        self.paused = false;
        Ok(())
    }

    fn signal(&self, sig: i32) {
        if let Some(c) = &self.child {
            // SAFETY: a signal to our own child process, by its pid.
            unsafe {
                libc::kill(c.id() as i32, sig);
            }
        }
    }

    /// `kill -9` (a paused process dies too).
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        self.paused = false;
    }

    pub fn pause(&mut self) {
        self.signal(libc::SIGSTOP);
        self.paused = true;
    }

    pub fn resume(&mut self) {
        self.signal(libc::SIGCONT);
        self.paused = false;
    }

    /// Sends SIGTERM (after SIGCONT if paused); [`Node::wait_exit`] reaps it.
    fn term(&mut self) {
        if self.paused {
            self.resume();
        }
        self.signal(libc::SIGTERM);
    }

    /// Waits for the process to exit after SIGTERM; `kill -9` after 30 s (said in the log).
    fn wait_exit(&mut self) -> Result<Duration> {
        let start = Instant::now();
        if let Some(mut c) = self.child.take() {
            loop {
                if let Ok(Some(_)) = c.try_wait() {
                    break;
                }
                if start.elapsed() > Duration::from_secs(30) {
                    let _ = c.kill();
                    let _ = c.wait();
                    bail!("node{} did not exit within 30 s of SIGTERM", self.index + 1);
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        Ok(start.elapsed())
    }

    fn serving(&self) -> bool {
        let Ok(text) = std::fs::read(&self.log) else {
            return false;
        };
        let start = (self.log_start as usize).min(text.len());
        String::from_utf8_lossy(&text[start..]).contains("node listening")
    }

    /// Whether the process exited on its own (a crash).
    pub fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child
            .as_mut()
            .and_then(|c| c.try_wait().ok().flatten())
    }
}

impl Cluster {
    /// The run's folder (where the configs and logs are).
    pub fn dir(&self) -> PathBuf {
        self.nodes[0]
            .config
            .parent()
            .map(Path::to_path_buf)
            .unwrap_or_default()
    }

    /// Writes configs for `n` nodes under `dir` (created fresh); nothing is started. With
    /// `disks`, each node's data folder is its own small file system (for disk faults).
    pub fn new(dir: PathBuf, n: usize, prefix: &str, bin: &Path, disks: bool) -> Result<Cluster> {
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).context("run folder")?;
        let ips: Vec<String> = (1..=n).map(|i| format!("{prefix}.{i}")).collect();
        let mut nodes = Vec::new();
        for (i, ip) in ips.iter().enumerate() {
            let id = i + 1;
            let config = dir.join(format!("node{id}.toml"));
            let data = dir.join(format!("data{id}"));
            std::fs::write(&config, config_text(id, ip, &ips[0], &ips, &data))?;
            if disks {
                super::disk::mount_fresh(&data)?;
            }
            nodes.push(Node {
                index: i,
                ip: ip.clone(),
                name: format!("warren{id}@chaos"),
                data,
                config,
                log: dir.join(format!("node{id}.log")),
                child: None,
                log_start: 0,
                paused: false,
            });
        }
        let (warren, warrenctl) = (bin.join("warren"), bin.join("warrenctl"));
        for b in [&warren, &warrenctl] {
            if !b.is_file() {
                bail!(
                    "{} not found: build it (cargo build --release --bin warren --bin warrenctl) or pass --bin DIR",
                    b.display()
                );
            }
        }
        Ok(Cluster {
            nodes,
            warren,
            warrenctl,
            mounted: disks,
            spares: 0,
        })
    }

    pub fn ips(&self) -> Vec<String> {
        self.nodes.iter().map(|n| n.ip.clone()).collect()
    }

    /// Adds a node outside the cluster (no initial members: it waits for `join_cluster`)
    /// and starts it; its index. Its data folder is on the run's disk, not an image.
    pub fn spawn_spare(&mut self, dir: &Path) -> Result<usize> {
        let i = self.nodes.len();
        self.spares += 1;
        let id = i + self.spares;
        let prefix = self.nodes[0]
            .ip
            .rsplit_once('.')
            .map(|(p, _)| p.to_string())
            .context("an address")?;
        let ip = format!("{prefix}.{id}");
        let config = dir.join(format!("node{id}.toml"));
        let data = dir.join(format!("data{id}"));
        std::fs::write(&config, config_text(id, &ip, &self.nodes[0].ip, &[], &data))?;
        let mut node = Node {
            index: i,
            ip,
            name: format!("warren{id}@chaos"),
            data,
            config,
            log: dir.join(format!("node{id}.log")),
            child: None,
            log_start: 0,
            paused: false,
        };
        node.spawn(&self.warren)?;
        self.nodes.push(node);
        Ok(i)
    }

    /// Starts the nodes `which` and waits until each serves clients.
    pub async fn start(&mut self, which: &[usize]) -> Result<()> {
        for &i in which {
            let warren = self.warren.clone();
            self.nodes[i].spawn(&warren)?;
        }
        self.wait_serving(which).await
    }

    /// Waits until each of the started nodes `which` serves clients.
    pub async fn wait_serving(&mut self, which: &[usize]) -> Result<()> {
        let deadline = Instant::now() + START_TIMEOUT;
        for &i in which {
            while !self.nodes[i].serving() {
                if let Some(status) = self.nodes[i].exited() {
                    bail!("node{} exited while starting: {status}", i + 1);
                }
                if Instant::now() > deadline {
                    bail!("node{} did not serve within {START_TIMEOUT:?}", i + 1);
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
        Ok(())
    }

    /// SIGTERM to every node in `which` at once, then waits for each to exit.
    pub fn stop(&mut self, which: &[usize]) -> Result<()> {
        for &i in which {
            self.nodes[i].term();
        }
        let mut first_err = None;
        for &i in which {
            if let Err(e) = self.nodes[i].wait_exit() {
                first_err.get_or_insert(e);
            }
        }
        first_err.map_or(Ok(()), Err)
    }

    pub fn kill_all(&mut self) {
        for n in &mut self.nodes {
            n.kill();
        }
    }

    /// A node that crashed on its own (not one we stopped), if any.
    pub fn crashed(&mut self) -> Option<(usize, String)> {
        self.nodes
            .iter_mut()
            .find_map(|n| n.exited().map(|s| (n.index, s.to_string())))
    }

    /// Runs warrenctl against node `i`: stdout on success, an error with stderr otherwise.
    pub async fn ctl(&self, i: usize, args: &[&str]) -> Result<String> {
        let mut cmd = Command::new(&self.warrenctl);
        cmd.arg("--node")
            .arg(self.nodes[i].admin())
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        // The output is small: it fits the pipe while the child is waited for.
        let out = run_bounded(cmd, Duration::from_secs(15))
            .await
            .with_context(|| format!("warrenctl {args:?} on node{}", i + 1))?;
        if !out.status.success() {
            bail!(
                "warrenctl {args:?} on node{}: {}",
                i + 1,
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// `warren inspect-queue --bodies` of `queue` in node `i`'s files (read-only, safe next
    /// to the running node). The listing is also left in the run's folder, which is kept
    /// when the run fails.
    pub async fn inspect_queue(&self, i: usize, queue: &str) -> Result<String> {
        let node = &self.nodes[i];
        let path = node
            .log
            .with_file_name(format!("copy-{queue}-node{}.tsv", i + 1));
        let file =
            std::fs::File::create(&path).with_context(|| format!("create {}", path.display()))?;
        let mut cmd = Command::new(&self.warren);
        cmd.args(["inspect-queue", "--bodies", "--queue", queue, "--data-dir"])
            .arg(&node.data)
            .env("RUST_LOG", "error")
            .stdin(Stdio::null())
            .stdout(file)
            .stderr(Stdio::piped());
        // The listing goes to a file, so a large one cannot fill a pipe nobody reads while
        // the child is waited for.
        let out = run_bounded(cmd, Duration::from_secs(60))
            .await
            .context("run warren inspect-queue")?;
        if !out.status.success() {
            bail!(
                "warren inspect-queue: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        std::fs::read_to_string(&path).with_context(|| format!("read {}", path.display()))
    }

    /// warrenctl on the first running, unpaused node that answers.
    pub async fn ctl_any(&self, args: &[&str]) -> Result<String> {
        let mut last = None;
        for n in self.nodes.iter().filter(|n| n.running() && !n.paused) {
            match self.ctl(n.index, args).await {
                Ok(out) => return Ok(out),
                Err(e) => last = Some(e),
            }
        }
        Err(last.unwrap_or_else(|| anyhow::anyhow!("no node is running")))
    }

    /// Node index of a node name (`warren2@chaos` -> 1).
    pub fn index_of(&self, name: &str) -> Option<usize> {
        let name = name
            .trim()
            .trim_matches(|c| c == '[' || c == ']' || c == '"');
        self.nodes.iter().position(|n| n.name == name)
    }

    /// The Raft leader's index as the answering node sees it.
    pub async fn leader(&self) -> Option<usize> {
        let out = self.ctl_any(&["cluster_status"]).await.ok()?;
        out.lines()
            .skip(1)
            .map(|l| l.split('\t').collect::<Vec<_>>())
            .find(|c| c.get(3) == Some(&"leader"))
            .and_then(|c| c.get(1)?.parse::<usize>().ok())
            .map(|id| id - 1)
    }

    /// Each queue's master and synchronised mirrors (node indexes), as `via` (or any node) lists them.
    pub async fn masters(&self, via: Option<usize>) -> Result<Vec<QueueState>> {
        let args = ["list_queues", "name", "pid", "synchronised_slave_pids"];
        let out = match via {
            Some(i) => self.ctl(i, &args).await?,
            None => self.ctl_any(&args).await?,
        };
        Ok(out
            .lines()
            .skip(1)
            .filter_map(|l| {
                let c: Vec<&str> = l.split('\t').collect();
                let synced = c
                    .get(2)?
                    .trim_matches(|c| c == '[' || c == ']')
                    .split(',')
                    .filter_map(|n| self.index_of(n))
                    .collect();
                Some(QueueState {
                    name: c.first()?.to_string(),
                    master: self.index_of(c.get(1)?),
                    synced,
                })
            })
            .collect())
    }
}

/// Runs `cmd` to its end, killed after `limit`. tokio's process support is not among the
/// crate's features: a blocking thread waits.
async fn run_bounded(mut cmd: Command, limit: Duration) -> Result<std::process::Output> {
    tokio::task::spawn_blocking(move || -> Result<std::process::Output> {
        let mut child = cmd.spawn().context("spawn")?;
        let deadline = Instant::now() + limit;
        while child.try_wait()?.is_none() {
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                bail!("timed out");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(child.wait_with_output()?)
    })
    .await?
}

#[derive(Clone, Debug)]
pub struct QueueState {
    pub name: String,
    pub master: Option<usize>,
    pub synced: Vec<usize>,
}

impl Drop for Cluster {
    fn drop(&mut self) {
        self.kill_all();
        if self.mounted {
            // The images stay in the run's folder (kept when the run failed). Spares added
            // by joins have no image.
            for n in self
                .nodes
                .iter()
                .filter(|n| n.data.with_extension("img").exists())
            {
                if let Err(e) = super::disk::unmount(&n.data) {
                    eprintln!("warren-chaos: {e:#}");
                }
            }
        }
    }
}
