//! One run of the campaign: start the cluster, set up the policy and queues, run the workload
//! under the seed's schedule, heal, drain, check, and say PASS or FAIL in one line.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use lapin::options::QueueDeclareOptions;
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Connection, ConnectionProperties};

use super::checker::{self, Verdict};
use super::cluster::Cluster;
use super::copies;
use super::faults::{self, Runner};
use super::history::History;
use super::schedule::{self, Step, QUEUES};
use super::workload::{self, queue_name, Ctx, Mode, DL_SOURCE, DL_TARGET, DL_TTL_MS};

pub struct Opts {
    pub nodes: usize,
    pub duration_ms: u64,
    pub bin: PathBuf,
    pub keep: bool,
    /// Disk faults in the schedule, data folders on their own file systems.
    pub extended: bool,
    /// A dead-letter stream too (`workload::DL_SOURCE`).
    pub dead_letters: bool,
}

/// After the faults: how long the workload goes on before it stops (liveness is judged here).
const TAIL: Duration = Duration::from_secs(8);
/// After the tail, the publishers go on alone for this long: the backlog they leave is what
/// the copies checker finds in every copy's files and what the drain must bring back.
const BACKLOG: Duration = Duration::from_secs(2);

/// 127.X.Y for this process and seed; X avoids the range the repo's tests use (10..210).
fn prefix(seed: u64) -> String {
    let pid = std::process::id() as u64;
    for k in 0..250 {
        let (x, y) = (210 + pid % 40, (pid / 40 + seed + k) % 250 + 1);
        let p = format!("127.{x}.{y}");
        // A node of another run still on these addresses would be joined by mistake.
        if std::net::TcpListener::bind(format!("{p}.1:5672")).is_ok() {
            return p;
        }
    }
    format!("127.{}.{}", 210 + pid % 40, seed % 250 + 1)
}

/// Runs seed `seed`; the result line and whether it passed.
pub async fn run(seed: u64, opts: &Opts) -> (String, bool) {
    let steps = schedule::plan(seed, opts.nodes, opts.duration_ms, opts.extended);
    println!("seed={seed} schedule:");
    for s in &steps {
        if !matches!(s, Step::Quiet { .. }) {
            println!("  - {s}");
        }
    }
    let mut faults: Vec<&str> = Vec::new();
    for f in steps.iter().filter_map(Step::fault_name) {
        if !faults.contains(&f) {
            faults.push(f);
        }
    }
    let dir = std::env::temp_dir().join(format!("warren-chaos-{}-{seed}", std::process::id()));
    let history = Arc::new(History::default());
    let mut reasons = Vec::new();
    let mut verdict = Verdict::default();
    match Cluster::new(
        dir.clone(),
        opts.nodes,
        &prefix(seed),
        &opts.bin,
        opts.extended,
    ) {
        Err(e) => reasons.push(format!("setup: {e:#}")),
        Ok(mut cluster) => {
            let run = campaign(
                &mut cluster,
                &steps,
                &history,
                &mut reasons,
                opts.dead_letters,
            );
            if let Err(e) = run.await {
                reasons.push(format!("{e:#}"));
            }
            super::net::remove_all();
            if let Some((i, status)) = cluster.crashed() {
                reasons.push(format!("node{} exited on its own: {status}", i + 1));
            }
            cluster.kill_all();
            drop(cluster);
            super::disk::remove_all();
            verdict = checker::check(&history.lock());
            for n in &verdict.notes {
                println!("  | {n}");
            }
            for s in &history.lock().stalls {
                println!("  | client stall: {s}");
            }
            reasons.extend(verdict.reasons.iter().cloned());
        }
    }
    let passed = reasons.is_empty();
    let ok = |n: u64| if n == 0 { "ok" } else { "FAIL" };
    let mut line = format!(
        "seed={seed} nodes={} faults={} published={} confirmed={} delivered={} lost={} dup_unflagged={} order={} liveness={} result={}",
        opts.nodes,
        if faults.is_empty() { "none".to_string() } else { faults.join(",") },
        verdict.published,
        verdict.confirmed,
        verdict.delivered,
        verdict.lost,
        verdict.dup_unflagged,
        ok(verdict.order_errors),
        ok(verdict.liveness_errors),
        if passed { "PASS" } else { "FAIL" },
    );
    let stalls = history.lock().stalls.len();
    if stalls > 0 {
        line.push_str(&format!(" (client_stalls={stalls})"));
    }
    if verdict.returned > 0 {
        line.push_str(&format!(" (returned_unroutable={})", verdict.returned));
    }
    if verdict.dup_dead_letters > 0 {
        line.push_str(&format!(" (dead_letter_dups={})", verdict.dup_dead_letters));
    }
    if verdict.lost_transient_allowed > 0 {
        line.push_str(&format!(
            " (transient_lost_allowed={})",
            verdict.lost_transient_allowed
        ));
    }
    if !passed {
        let first: Vec<&str> = reasons.iter().take(4).map(String::as_str).collect();
        line.push_str(&format!(" reasons: {}", first.join("; ")));
        line.push_str(&format!(" [data and logs kept in {}]", dir.display()));
    } else if !opts.keep {
        let _ = std::fs::remove_dir_all(&dir);
    }
    (line, passed)
}

async fn campaign(
    cluster: &mut Cluster,
    steps: &[Step],
    history: &Arc<History>,
    reasons: &mut Vec<String>,
    dead_letters: bool,
) -> Result<()> {
    let all: Vec<usize> = (0..cluster.nodes.len()).collect();
    cluster.start(&all).await.context("first start")?;
    set_up(cluster, dead_letters).await?;
    let ctx = Ctx {
        uris: Arc::new(cluster.nodes.iter().map(|n| n.amqp_uri()).collect()),
        history: history.clone(),
        stop: Arc::new(AtomicBool::new(false)),
        takers_stop: Arc::new(AtomicBool::new(false)),
        streams: Arc::new(AtomicU64::new(0)),
    };
    let n = cluster.nodes.len();
    let mut tasks = Vec::new();
    for i in 0..n {
        tasks.push((
            format!("publisher p{i}"),
            tokio::spawn(workload::publisher(
                ctx.clone(),
                i as u32,
                i,
                i % QUEUES,
                Mode::Confirms,
            )),
        ));
    }
    // One transactional publisher, on the last node, to the other queue than that node's
    // confirming publisher.
    tasks.push((
        format!("tx publisher p{n}"),
        tokio::spawn(workload::publisher(
            ctx.clone(),
            n as u32,
            n - 1,
            n % QUEUES,
            Mode::Tx,
        )),
    ));
    // The dead-letter stream: a confirming publisher to the source through node 1 (its
    // master's), a consumer of the target through node 3.
    if dead_letters {
        tasks.push((
            format!("dead-letter publisher p{}", n + 1),
            tokio::spawn(workload::publisher(
                ctx.clone(),
                n as u32 + 1,
                0,
                DL_SOURCE,
                Mode::Confirms,
            )),
        ));
    }
    // Consumers and the getter stop first (see BACKLOG).
    let mut takers = Vec::new();
    if dead_letters {
        takers.push((
            format!("consumer of {}", queue_name(DL_TARGET)),
            tokio::spawn(workload::consumer(ctx.clone(), 77, 2 % n, DL_TARGET)),
        ));
    }
    for q in 0..QUEUES {
        for k in 0..2 {
            let home = (q + k + 1) % n;
            takers.push((
                format!("consumer of {} (home node{})", queue_name(q), home + 1),
                tokio::spawn(workload::consumer(ctx.clone(), (q * 2 + k) as u64, home, q)),
            ));
        }
    }
    takers.push((
        "getter".to_string(),
        tokio::spawn(workload::getter(ctx.clone(), 99)),
    ));
    let started = Instant::now();
    history.lock().t0 = Some(started);
    let mut runner = Runner {
        cluster,
        history,
        notes: Vec::new(),
    };
    let mut failed_step = None;
    for step in steps {
        if !matches!(step, Step::Quiet { .. }) {
            println!("  {:>6.1}s {step}", started.elapsed().as_secs_f64());
        }
        if let Err(e) = runner.run(step).await {
            failed_step = Some(format!("step `{step}` failed: {e:#}"));
            break;
        }
        if let Some((i, status)) = runner.cluster.crashed() {
            failed_step = Some(format!(
                "node{} exited on its own ({status}) during `{step}`",
                i + 1
            ));
            break;
        }
    }
    let node_failed = failed_step.is_some();
    // Whether the queues can still be drained: after a node stopped on its own it is
    // started again on its data, so the run still says whether anything confirmed was lost
    // (without the drain, every confirmed message no consumer had taken would count as lost).
    let mut drainable = true;
    if let Some(f) = failed_step {
        reasons.push(f);
        let stopped: Vec<usize> = (0..runner.cluster.nodes.len())
            .filter(|&i| {
                let node = &mut runner.cluster.nodes[i];
                node.exited().is_some() || !node.running()
            })
            .collect();
        if !stopped.is_empty() {
            match runner.cluster.start(&stopped).await {
                Ok(()) => println!(
                    "  {:>6.1}s restarted {stopped:?} (0-based) after the failure, to drain",
                    started.elapsed().as_secs_f64()
                ),
                Err(e) => {
                    reasons.push(format!("restart after the failure: {e:#}"));
                    drainable = false;
                }
            }
        }
    } else {
        history.lock().faults_end = Some(Instant::now());
        println!(
            "  {:>6.1}s faults over, every node serving; workload goes on for {TAIL:?}",
            started.elapsed().as_secs_f64()
        );
        tokio::time::sleep(TAIL).await;
    }
    // One deadline for all of them: hung clients (a node that stopped answering) must not
    // add up to minutes.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(45);
    ctx.takers_stop.store(true, Ordering::Relaxed);
    let mut hung = false;
    for (name, t) in takers {
        if tokio::time::timeout_at(deadline, t).await.is_err() {
            reasons.push(format!("a client did not stop within 45 s: {name}"));
            hung = true;
        }
    }
    if !node_failed && !hung {
        tokio::time::sleep(BACKLOG).await;
    }
    ctx.stop.store(true, Ordering::Relaxed);
    for (name, t) in tasks {
        if tokio::time::timeout_at(deadline, t).await.is_err() {
            reasons.push(format!("a client did not stop within 45 s: {name}"));
        }
    }
    // A hung client is a failure by itself, but the queues are still drained: what the
    // others had confirmed and no consumer took yet must be found there, or it is lost.
    if !drainable {
        return Ok(());
    }
    reasons.extend(copies::check(cluster, history).await);
    let deadline = Instant::now() + Duration::from_secs(120);
    // The source before the target: what expires meanwhile is in the target by then.
    let dl: &[usize] = if dead_letters {
        &[DL_SOURCE, DL_TARGET]
    } else {
        &[]
    };
    for &q in (0..QUEUES).collect::<Vec<_>>().iter().chain(dl) {
        let name = queue_name(q);
        let mut last = None;
        let mut drained = false;
        while Instant::now() < deadline && !drained {
            for node in 0..n {
                match workload::drain(&ctx, node, &name, deadline).await {
                    Ok(taken) => {
                        println!(
                            "  {:>6.1}s drained {name} through node{}: {taken} messages",
                            started.elapsed().as_secs_f64(),
                            node + 1
                        );
                        drained = true;
                        break;
                    }
                    Err(e) => last = Some(e),
                }
            }
            if !drained {
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        }
        if !drained {
            reasons.push(format!(
                "drain of {name} failed: {:#}",
                last.unwrap_or_else(|| anyhow::anyhow!("deadline"))
            ));
        }
    }
    after_drain(cluster).await;
    Ok(())
}

/// What each node still counts after the drains: a drain ends on zero *ready* messages, so
/// a confirmed message held unacknowledged by a consumer nobody has any more shows here,
/// not in the drain (a loss then points at consumer bookkeeping, not at the queue's copy).
async fn after_drain(cluster: &Cluster) {
    let columns = [
        "list_queues",
        "name",
        "messages",
        "messages_ready",
        "messages_unacknowledged",
        "consumers",
    ];
    for i in 0..cluster.nodes.len() {
        let counts = match cluster.ctl(i, &columns).await {
            Ok(out) => out.split_whitespace().collect::<Vec<_>>().join(" "),
            Err(e) => format!("{e:#}"),
        };
        println!("  | after the drain, node{}: {counts}", i + 1);
    }
}

/// The `ha` policy (all, automatic sync), the durable queues, and their mirrors in sync;
/// with `dead_letters`, the dead-letter stream's queues too: the source declared through
/// node 1 and the target through node 2, so their masters (client-local) differ and every
/// dead letter crosses nodes.
async fn set_up(cluster: &Cluster, dead_letters: bool) -> Result<()> {
    let json = r#"{"ha-mode":"all","ha-sync-mode":"automatic"}"#;
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        match cluster
            .ctl_any(&["set_policy", "ha", r"^ha\.", json, "--apply-to", "queues"])
            .await
        {
            Ok(_) => break,
            Err(e) if Instant::now() > deadline => return Err(e.context("set the ha policy")),
            Err(_) => tokio::time::sleep(Duration::from_millis(300)).await,
        }
    }
    let conn = Connection::connect(
        &cluster.nodes[0].amqp_uri(),
        ConnectionProperties::default(),
    )
    .await
    .context("connect to node1")?;
    let ch = conn.create_channel().await?;
    for q in 0..QUEUES {
        ch.queue_declare(
            queue_name(q).as_str().into(),
            QueueDeclareOptions {
                durable: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .with_context(|| format!("declare {}", queue_name(q)))?;
    }
    if dead_letters {
        let mut args = FieldTable::default();
        args.insert("x-message-ttl".into(), AMQPValue::LongLongInt(DL_TTL_MS));
        args.insert(
            "x-dead-letter-exchange".into(),
            AMQPValue::LongString("".into()),
        );
        args.insert(
            "x-dead-letter-routing-key".into(),
            AMQPValue::LongString(queue_name(DL_TARGET).as_str().into()),
        );
        ch.queue_declare(
            queue_name(DL_SOURCE).as_str().into(),
            QueueDeclareOptions {
                durable: true,
                ..Default::default()
            },
            args,
        )
        .await
        .context("declare the dead-letter source")?;
        let target = Connection::connect(
            &cluster.nodes[1].amqp_uri(),
            ConnectionProperties::default(),
        )
        .await
        .context("connect to node2")?;
        target
            .create_channel()
            .await?
            .queue_declare(
                queue_name(DL_TARGET).as_str().into(),
                QueueDeclareOptions {
                    durable: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
            .context("declare the dead-letter target")?;
        let _ = target.close(200, "bye".into()).await;
    }
    let _ = conn.close(200, "bye".into()).await;
    faults::wait_mirrored(cluster, Duration::from_secs(20)).await
}
