//! Carries out a schedule's steps against the running cluster: signals to node processes,
//! nftables cuts, and the admin steps (policy changes, sync, delete and re-declare). Each
//! step ends with the cluster whole again (every node running, no cut), so the next one
//! starts from a known state. What the checker needs is recorded in the history.

use std::time::{Duration, Instant};

use anyhow::{anyhow, Context, Result};
use lapin::options::{QueueDeclareOptions, QueueDeleteOptions};
use lapin::types::FieldTable;
use lapin::{Connection, ConnectionProperties};

use super::cluster::{Cluster, PEER_TIMEOUT_MS};
use super::history::{History, PartitionRec, Redeclare};
use super::net::Cut;
use super::schedule::{Policy, Side, Step, Target, QUEUES};
use super::workload::queue_name;

pub struct Runner<'a> {
    pub cluster: &'a mut Cluster,
    pub history: &'a History,
    /// Lines describing how symbolic targets resolved, for the run's log.
    pub notes: Vec<String>,
}

fn policy_json(p: Policy, names: &[String]) -> Option<String> {
    match p {
        Policy::All => Some(r#"{"ha-mode":"all","ha-sync-mode":"automatic"}"#.to_string()),
        Policy::Exactly2 => {
            Some(r#"{"ha-mode":"exactly","ha-params":2,"ha-sync-mode":"automatic"}"#.to_string())
        }
        Policy::Nodes => Some(format!(
            r#"{{"ha-mode":"nodes","ha-params":["{}","{}"],"ha-sync-mode":"automatic"}}"#,
            names[0], names[1]
        )),
        Policy::Cleared => None,
    }
}

impl Runner<'_> {
    fn note(&mut self, s: String) {
        println!("  | {s}");
        self.notes.push(s);
    }

    async fn resolve(&mut self, t: &Target) -> usize {
        let found = match t {
            Target::Node(i) => Some(*i),
            Target::Leader => self.cluster.leader().await,
            Target::Master(q) => self.cluster.masters(None).await.ok().and_then(|qs| {
                qs.into_iter()
                    .find(|s| s.name == queue_name(*q))
                    .and_then(|s| s.master)
            }),
        };
        let i = found.unwrap_or(0);
        if !matches!(t, Target::Node(_)) {
            self.note(format!(
                "{t} is node{}{}",
                i + 1,
                if found.is_none() {
                    " (not found: node1)"
                } else {
                    ""
                }
            ));
        }
        i
    }

    async fn side(&mut self, s: &Side) -> Vec<usize> {
        match s {
            Side::Nodes(ns) => ns.clone(),
            Side::Of(t) => vec![self.resolve(t).await],
        }
    }

    /// The queues mastered on one of `nodes`, from a listing taken just before they are
    /// restarted (every queue if the listing fails), for the transient-message rule.
    async fn mastered_on(&mut self, nodes: &[usize]) -> Vec<usize> {
        let masters = self.cluster.masters(None).await.ok();
        (0..QUEUES)
            .filter(|q| match &masters {
                Some(qs) => qs
                    .iter()
                    .find(|s| s.name == queue_name(*q))
                    .is_none_or(|s| s.master.is_none_or(|m| nodes.contains(&m))),
                None => true,
            })
            .collect()
    }

    /// Records the restart of `queues`' masters as of now: call it once the processes are
    /// gone, so every publish sent before their end counts as sent before the restart.
    fn note_master_restarts(&self, queues: &[usize]) {
        let now = Instant::now();
        let mut h = self.history.lock();
        h.master_restarts.extend(queues.iter().map(|&q| (q, now)));
    }

    pub async fn run(&mut self, step: &Step) -> Result<()> {
        let ms = |m: u64| tokio::time::sleep(Duration::from_millis(m));
        match step {
            Step::Quiet { ms: m } => ms(*m).await,
            Step::Kill { target, down_ms } => {
                let i = self.resolve(target).await;
                let queues = self.mastered_on(&[i]).await;
                self.cluster.nodes[i].kill();
                self.note_master_restarts(&queues);
                ms(*down_ms).await;
                self.cluster.start(&[i]).await?;
            }
            Step::Restart { target, down_ms } => {
                let i = self.resolve(target).await;
                let queues = self.mastered_on(&[i]).await;
                let stopped = self.cluster.stop(&[i]);
                self.note_master_restarts(&queues);
                stopped?;
                ms(*down_ms).await;
                self.cluster.start(&[i]).await?;
            }
            Step::Pause { target, ms: m } => {
                let i = self.resolve(target).await;
                self.cluster.nodes[i].pause();
                ms(*m).await;
                self.cluster.nodes[i].resume();
            }
            Step::ClusterRestart { clean, down_ms } => {
                let all: Vec<usize> = (0..self.cluster.nodes.len()).collect();
                let queues: Vec<usize> = (0..QUEUES).collect();
                let stopped = if *clean {
                    self.cluster.stop(&all)
                } else {
                    self.cluster.kill_all();
                    Ok(())
                };
                self.note_master_restarts(&queues);
                stopped?;
                ms(*down_ms).await;
                self.cluster.start(&all).await?;
            }
            Step::Partition { side, ms: m } => {
                let minority = self.side(side).await;
                self.partition(minority, *m).await?;
            }
            Step::OneWay { side, ms: m } => {
                let minority = self.side(side).await;
                let (a, b) = self.split(minority);
                let cut = Cut::new(&a, &b, false)?;
                ms(*m).await;
                cut.heal()?;
            }
            Step::Flapping {
                side,
                cycles,
                on_ms,
                off_ms,
            } => {
                let minority = self.side(side).await;
                let (a, b) = self.split(minority);
                for _ in 0..*cycles {
                    let cut = Cut::new(&a, &b, true)?;
                    ms(*on_ms).await;
                    cut.heal()?;
                    ms(*off_ms).await;
                }
            }
            Step::SetPolicy(p) => {
                let names: Vec<String> =
                    self.cluster.nodes.iter().map(|n| n.name.clone()).collect();
                let args: Vec<String> = match policy_json(*p, &names) {
                    Some(json) => vec![
                        "set_policy".into(),
                        "ha".into(),
                        r"^ha\.".into(),
                        json,
                        "--apply-to".into(),
                        "queues".into(),
                    ],
                    None => vec!["clear_policy".into(), "ha".into()],
                };
                self.admin(&args, &[]).await?;
            }
            Step::Sync { queue, cancel } => {
                let verb = if *cancel {
                    "cancel_sync_queue"
                } else {
                    "sync_queue"
                };
                // Refused for a queue the current policy leaves unmirrored: that is right.
                self.admin(&[verb.into(), queue_name(*queue)], &["not mirrored"])
                    .await?;
            }
            Step::Redeclare { queue } => self.redeclare(*queue).await?,
            Step::JoinForget { ms: m } => self.join_forget(*m).await?,
            Step::DiskFull { target, ms: m } => {
                let i = self.resolve(target).await;
                let queues = self.mastered_on(&[i]).await;
                let full = super::disk::Full::new(&self.cluster.nodes[i].data)?;
                let stopped = self.hold(i, *m, &queues).await;
                full.end()?;
                self.restart_if_stopped(i, stopped, &queues).await?;
            }
            Step::SlowDisk { target, ms: m } => {
                let i = self.resolve(target).await;
                let queues = self.mastered_on(&[i]).await;
                let pid = self.cluster.nodes[i]
                    .pid()
                    .ok_or_else(|| anyhow!("node{} is not running", i + 1))?;
                // 256 KiB/s and 20 writes/s: a group commit's fsync takes a second or more.
                let slow = super::disk::Slow::new(pid, &self.cluster.nodes[i].data, 256 << 10, 20)?;
                let stopped = self.hold(i, *m, &queues).await;
                slow.end()?;
                self.restart_if_stopped(i, stopped, &queues).await?;
            }
        }
        Ok(())
    }

    /// A new node joins through a running one, serves for `ms` (the `ha-mode: all` mirrors
    /// sync to it), is killed and forgotten; it leaves the node list, so later steps see the
    /// cluster as before.
    async fn join_forget(&mut self, ms: u64) -> Result<()> {
        let dir = self.cluster.dir();
        let i = self.cluster.spawn_spare(&dir)?;
        let name = self.cluster.nodes[i].name.clone();
        let joined: Result<()> = async {
            let deadline = Instant::now() + Duration::from_secs(30);
            let mut k = 0;
            loop {
                let seed = self.cluster.nodes[k % i].admin();
                k += 1;
                match self.cluster.ctl(i, &["join_cluster", &seed]).await {
                    Ok(_) => break,
                    Err(e) if Instant::now() > deadline => return Err(e.context("join_cluster")),
                    Err(_) => tokio::time::sleep(Duration::from_millis(500)).await,
                }
            }
            self.cluster.wait_serving(&[i]).await?;
            self.note(format!("{name} joined"));
            tokio::time::sleep(Duration::from_millis(ms)).await;
            Ok(())
        }
        .await;
        let queues = self.mastered_on(&[i]).await;
        self.cluster.nodes[i].kill();
        self.note_master_restarts(&queues);
        let forgot = self
            .admin(&["forget_cluster_node".into(), name.clone()], &[])
            .await;
        self.cluster.nodes.pop();
        joined?;
        forgot.with_context(|| format!("forget {name}"))
    }

    /// Waits `ms` while node `i` suffers a disk fault; whether it stopped itself meanwhile
    /// (a node whose storage fails exits for its supervisor to restart it), recording the
    /// restart of `queues`' masters when it did.
    async fn hold(&mut self, i: usize, ms: u64, queues: &[usize]) -> Option<String> {
        let end = Instant::now() + Duration::from_millis(ms);
        let mut stopped = None;
        while Instant::now() < end {
            if stopped.is_none() {
                if let Some(status) = self.cluster.nodes[i].exited() {
                    self.note_master_restarts(queues);
                    stopped = Some(status.to_string());
                }
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        stopped
    }

    /// Does what a supervisor (systemd's `Restart=on-failure`) does for a node that stopped
    /// itself during a disk fault: starts it again, now that the fault is over.
    async fn restart_if_stopped(
        &mut self,
        i: usize,
        mut stopped: Option<String>,
        queues: &[usize],
    ) -> Result<()> {
        if stopped.is_none() {
            if let Some(status) = self.cluster.nodes[i].exited() {
                self.note_master_restarts(queues);
                stopped = Some(status.to_string());
            }
        }
        if let Some(status) = stopped {
            self.note(format!(
                "node{} stopped itself during the disk fault ({status}): started again",
                i + 1
            ));
            self.cluster.nodes[i].kill();
            self.cluster.start(&[i]).await?;
        }
        Ok(())
    }

    /// (minority addresses, majority addresses).
    fn split(&self, minority: Vec<usize>) -> (Vec<String>, Vec<String>) {
        let ips = self.cluster.ips();
        let (a, b): (Vec<_>, Vec<_>) = ips
            .into_iter()
            .enumerate()
            .partition(|(i, _)| minority.contains(i));
        (
            a.into_iter().map(|(_, ip)| ip).collect(),
            b.into_iter().map(|(_, ip)| ip).collect(),
        )
    }

    /// A both-ways cut of `minority` for `ms`, watched from the majority side: when every
    /// queue that can be is mastered there with no synchronised mirror left on the minority.
    async fn partition(&mut self, minority: Vec<usize>, ms: u64) -> Result<()> {
        let before = self.cluster.masters(None).await.unwrap_or_default();
        let majority: Vec<usize> = (0..self.cluster.nodes.len())
            .filter(|i| !minority.contains(i))
            .collect();
        let eligible: Vec<usize> = (0..QUEUES)
            .filter(|q| {
                before.iter().any(|s| {
                    s.name == queue_name(*q)
                        && (s.master.is_some_and(|m| majority.contains(&m))
                            || s.synced.iter().any(|m| majority.contains(m)))
                })
            })
            .collect();
        let (a, b) = self.split(minority.clone());
        let cut = Cut::new(&a, &b, true)?;
        let at = Instant::now();
        let idx = {
            let mut h = self.history.lock();
            h.partitions.push(PartitionRec {
                minority: minority.clone(),
                cut: at,
                heal: None,
                eligible_queues: eligible.clone(),
                settled: None,
            });
            h.partitions.len() - 1
        };
        let end = at + Duration::from_millis(ms);
        let mut settled = None;
        while Instant::now() < end {
            if settled.is_none() {
                if let Ok(qs) = self.cluster.masters(Some(majority[0])).await {
                    let done = eligible.iter().all(|q| {
                        qs.iter().any(|s| {
                            s.name == queue_name(*q)
                                && s.master.is_some_and(|m| majority.contains(&m))
                                && !s.synced.iter().any(|m| minority.contains(m))
                        })
                    });
                    if done && Instant::now() < end {
                        settled = Some(Instant::now());
                    }
                }
            }
            let left = end.saturating_duration_since(Instant::now());
            tokio::time::sleep(left.min(Duration::from_millis(250))).await;
        }
        cut.heal()?;
        let heal = Instant::now();
        self.note(format!(
            "partition of {:?}: settled {}",
            minority.iter().map(|i| i + 1).collect::<Vec<_>>(),
            settled.map_or("never".to_string(), |s| format!(
                "{:.1}s after the cut",
                (s - at).as_secs_f64()
            ))
        ));
        let mut h = self.history.lock();
        h.partitions[idx].heal = Some(heal);
        h.partitions[idx].settled = settled;
        Ok(())
    }

    /// warrenctl on any node, retried for a while; errors containing one of `fine` are fine.
    async fn admin(&mut self, args: &[String], fine: &[&str]) -> Result<()> {
        let a: Vec<&str> = args.iter().map(String::as_str).collect();
        let deadline = Instant::now() + Duration::from_millis(PEER_TIMEOUT_MS + 20_000);
        loop {
            match self.cluster.ctl_any(&a).await {
                Ok(_) => return Ok(()),
                Err(e) if fine.iter().any(|f| format!("{e:#}").contains(f)) => {
                    self.note(format!("{e:#} (expected)"));
                    return Ok(());
                }
                Err(e) if Instant::now() > deadline => return Err(e),
                Err(_) => tokio::time::sleep(Duration::from_millis(500)).await,
            }
        }
    }

    /// Deletes `ha.q<queue>` and declares it again (durable) through some node; messages
    /// published before the declare-ok belong to the old incarnation or to no queue.
    async fn redeclare(&mut self, queue: usize) -> Result<()> {
        let name = queue_name(queue);
        let started = Instant::now();
        let idx = {
            let mut h = self.history.lock();
            h.redeclares.push(Redeclare { queue, done: None });
            h.redeclares.len() - 1
        };
        let deadline = started + Duration::from_secs(30);
        let mut deleted = false;
        let mut k = 0;
        loop {
            let node = &self.cluster.nodes[k % self.cluster.nodes.len()];
            k += 1;
            let r: Result<()> = async {
                let conn = tokio::time::timeout(
                    Duration::from_secs(3),
                    Connection::connect(&node.amqp_uri(), ConnectionProperties::default()),
                )
                .await??;
                let r = async {
                    let ch = conn.create_channel().await?;
                    if !deleted {
                        ch.queue_delete(name.as_str().into(), QueueDeleteOptions::default())
                            .await?;
                        deleted = true;
                    }
                    let ch = conn.create_channel().await?;
                    ch.queue_declare(
                        name.as_str().into(),
                        QueueDeclareOptions {
                            durable: true,
                            ..Default::default()
                        },
                        FieldTable::default(),
                    )
                    .await?;
                    Ok::<(), lapin::Error>(())
                }
                .await;
                let _ = conn.close(200, "bye".into()).await;
                Ok(r?)
            }
            .await;
            match r {
                Ok(()) => break,
                Err(e) if Instant::now() > deadline => {
                    return Err(e).with_context(|| format!("delete and re-declare {name}"));
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(300)).await,
            }
        }
        self.history.lock().redeclares[idx].done = Some(Instant::now());
        Ok(())
    }
}

/// Waits (bounded) until both queues list a synchronised mirror, so the run starts mirrored.
pub async fn wait_mirrored(cluster: &Cluster, within: Duration) -> Result<()> {
    let deadline = Instant::now() + within;
    loop {
        if let Ok(qs) = cluster.masters(None).await {
            let ok = (0..QUEUES).all(|q| {
                qs.iter()
                    .any(|s| s.name == queue_name(q) && s.master.is_some() && !s.synced.is_empty())
            });
            if ok {
                return Ok(());
            }
        }
        if Instant::now() > deadline {
            return Err(anyhow!("the queues were not mirrored within {within:?}"));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
