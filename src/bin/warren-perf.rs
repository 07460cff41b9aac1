//! warren-perf: a load generator for AMQP 0-9-1 brokers in the style of
//! RabbitMQ's PerfTest. It is a plain AMQP client (no broker internals), so
//! the same binary measures Warren, RabbitMQ or any other 0-9-1 broker.
//!
//! The client is deliberately small and cheap (its own minimal protocol layer
//! on amq-protocol's frame codec, batched writes, many frames parsed per
//! read, and by default a single runtime thread) so that on a small machine
//! the broker, not the client, is what gets measured.
//!
//! Each message body starts with an 8-byte big-endian send timestamp
//! (nanoseconds since this process started); consumers turn it into
//! end-to-end latency.

#[path = "warren_perf/amqp.rs"]
mod amqp;
#[path = "warren_perf/consumer.rs"]
mod consumer;
#[path = "warren_perf/producer.rs"]
mod producer;
#[path = "warren_perf/stats.rs"]
mod stats;
#[path = "warren_perf/stream.rs"]
mod stream;

use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

use amq_protocol::types::FieldTable;
use amq_protocol::uri::AMQPUri;
use anyhow::{anyhow, bail, Context, Result};
use clap::Parser;
use hdrhistogram::Histogram;

use amqp::{Conn, ServerClose};
use consumer::ConsumerCfg;
use producer::ProducerCfg;
use stats::{q_us, Json, Stats};

#[derive(Parser, Debug)]
#[command(
    name = "warren-perf",
    version,
    about = "AMQP 0-9-1 load generator in the style of RabbitMQ PerfTest (Warren, RabbitMQ, any 0-9-1 broker)",
    after_help = "Examples:\n  \
      warren-perf --producers 1 --consumers 1 --size 16 --autoack --duration 10\n  \
      warren-perf --confirm 100 --duration 10\n  \
      warren-perf --publish-only --queue backlog --count 100000 --persistent\n  \
      warren-perf --consume-only --queue backlog --autoack"
)]
struct Args {
    /// Broker URI (amqp://user:pass@host:port/vhost; the vhost is percent-encoded). Given
    /// more than once (a cluster's nodes), producers, consumers and the declarations of
    /// --queues take the URIs in turn
    #[arg(long, default_value = "amqp://guest:guest@127.0.0.1:5672/%2f")]
    uri: Vec<String>,
    /// Broker URI every consumer connects to (default: --uri): in a cluster, consume on
    /// another node than the one producers publish to
    #[arg(long)]
    consumer_uri: Option<String>,
    /// Number of producers, one connection each [default: 1, 0 with --consume-only]
    #[arg(long, short = 'x')]
    producers: Option<usize>,
    /// Number of consumers, one connection each [default: 1, 0 with --publish-only]
    #[arg(long, short = 'y')]
    consumers: Option<usize>,
    /// Message body size in bytes (at least 8: the body carries the send timestamp)
    #[arg(long, short = 's', default_value_t = 16)]
    size: usize,
    /// Run time in seconds (0 = until Ctrl-C, --count done or queue drained)
    #[arg(long, short = 'z', default_value_t = 0)]
    duration: u64,
    /// Publisher confirms with at most N unconfirmed messages per producer (0 = off)
    #[arg(long, short = 'c', default_value_t = 0)]
    confirm: usize,
    /// Consumer prefetch (basic.qos) with manual acks (0 = unlimited)
    #[arg(long, short = 'q', default_value_t = 0)]
    prefetch: u16,
    /// Consume with no-ack (automatic acknowledgement)
    #[arg(long, short = 'a')]
    autoack: bool,
    /// Manual acks: ack with multiple=true every N messages (1 = ack each message)
    #[arg(long, short = 'A', default_value_t = 1)]
    multi_ack_every: u64,
    /// Publish persistent messages (delivery_mode 2); new named queues are declared durable
    #[arg(long)]
    persistent: bool,
    /// Queue name [default: a fresh server-named queue, deleted at the end;
    /// 'perf-test' with --publish-only/--consume-only]. An existing queue is used as is.
    #[arg(long, short = 'u')]
    queue: Option<String>,
    /// With --queue Q: N queues, Q-1 to Q-N (declared when missing, each through the next
    /// --uri in turn, as PerfTest's --queue-pattern); producer and consumer i use queue
    /// (i mod N) + 1
    #[arg(long, default_value_t = 1, value_name = "N")]
    queues: usize,
    /// Arguments for a queue this tool creates, e.g. x-queue-mode=lazy,x-max-length=1000
    #[arg(long, value_name = "K=V[,K=V...]")]
    queue_args: Vec<String>,
    /// Publish rate cap per producer in msg/s (0 = unlimited)
    #[arg(long, short = 'r', default_value_t = 0)]
    rate: u64,
    /// Messages to publish per producer, then stop (0 = unlimited)
    #[arg(long, short = 'C', default_value_t = 0)]
    count: u64,
    /// Only publish (no consumers); for building a backlog
    #[arg(long, conflicts_with = "consume_only")]
    publish_only: bool,
    /// Only consume: drain an existing queue, stop once it has been empty for 1 s
    #[arg(long)]
    consume_only: bool,
    /// Print the final summary as one JSON object on stdout (per-second lines go to stderr)
    #[arg(long)]
    json: bool,
    /// PEM file of the CA certificates to trust for amqps:// URIs (TLS 1.2 and 1.3; the
    /// URI's host must match the broker's certificate)
    #[arg(long, value_name = "FILE")]
    cacert: Option<std::path::PathBuf>,
    /// Client runtime threads (1 keeps the client on one core, leaving the rest to the broker)
    #[arg(long, default_value_t = 1)]
    threads: usize,
}

fn main() -> ExitCode {
    let args = Args::parse();
    let threads = args.threads.max(1);
    let rt = if threads == 1 {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
    } else {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(threads)
            .enable_all()
            .build()
    };
    let rt = match rt {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("warren-perf: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let code = match rt.block_on(run(args)) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("warren-perf: error: {e:#}");
            ExitCode::FAILURE
        }
    };
    rt.shutdown_timeout(Duration::from_millis(100));
    code
}

fn is_not_found(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        c.downcast_ref::<ServerClose>()
            .is_some_and(|s| s.code == 404)
    })
}

fn plural(n: usize, what: &str) -> String {
    format!("{n} {what}{}", if n == 1 { "" } else { "s" })
}

async fn wait_for_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        if let Ok(mut term) = signal(SignalKind::terminate()) {
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = term.recv() => {}
            }
            return;
        }
    }
    let _ = tokio::signal::ctrl_c().await;
}

async fn run(args: Args) -> Result<bool> {
    let uris: Vec<AMQPUri> = args
        .uri
        .iter()
        .map(|u| u.parse().map_err(|e| anyhow!("invalid --uri '{u}': {e}")))
        .collect::<Result<_>>()?;
    let uri = uris[0].clone();
    if let Some(ca) = &args.cacert {
        stream::trust(ca)?;
    }
    let consumer_uris: Vec<AMQPUri> = match &args.consumer_uri {
        None => uris.clone(),
        Some(s) => vec![s
            .parse()
            .map_err(|e| anyhow!("invalid --consumer-uri '{s}': {e}"))?],
    };
    let producers = match (args.consume_only, args.producers) {
        (true, Some(n)) if n > 0 => bail!("--consume-only conflicts with --producers {n}"),
        (true, _) => 0,
        (false, n) => n.unwrap_or(1),
    };
    let consumers = match (args.publish_only, args.consumers) {
        (true, Some(n)) if n > 0 => bail!("--publish-only conflicts with --consumers {n}"),
        (true, _) => 0,
        (false, n) => n.unwrap_or(1),
    };
    if producers + consumers == 0 {
        bail!("nothing to do: no producers and no consumers");
    }
    let size = args.size.max(8);
    if args.size < 8 {
        eprintln!(
            "note: --size {} is below the 8-byte send timestamp; sending 8-byte bodies",
            args.size
        );
    }
    if !args.autoack && args.prefetch > 0 && args.multi_ack_every > args.prefetch as u64 {
        eprintln!(
            "note: --multi-ack-every {} exceeds --prefetch {}; acking every {} instead",
            args.multi_ack_every, args.prefetch, args.prefetch
        );
    }
    let queue_args = amqp::parse_queue_args(&args.queue_args)?;
    let pattern = args
        .queue
        .clone()
        .or_else(|| (args.publish_only || args.consume_only).then(|| "perf-test".to_string()));
    if args.queues > 1 && pattern.is_none() {
        bail!("--queues {} needs --queue (the names' prefix)", args.queues);
    }
    let names: Vec<String> = match &pattern {
        Some(q) if args.queues > 1 => (1..=args.queues).map(|k| format!("{q}-{k}")).collect(),
        Some(q) => vec![q.clone()],
        None => Vec::new(),
    };
    for q in &names {
        amqp::short(q, "--queue")?;
    }
    // The first is declared (and its depth reported at the end) by the setup connection.
    let named = names.first().cloned();

    // Setup connection: declares the queue, reports its depth at the end,
    // and deletes it if it was server-named.
    let mut setup = Conn::open(&uri, "warren-perf setup").await?;
    let mut sch: u16 = 1;
    setup.channel_open(sch).await?;
    let declared: Result<(String, bool)> = async {
        match &named {
            Some(q) => match setup
                .queue_declare(sch, q, true, false, false, FieldTable::default())
                .await
            {
                Ok((name, depth, _)) => {
                    if !args.queue_args.is_empty() {
                        eprintln!("note: queue '{name}' already exists; --queue-args not applied");
                    }
                    if depth > 0 && !args.consume_only {
                        eprintln!("note: queue '{name}' already holds {depth} messages");
                    }
                    Ok((name, false))
                }
                Err(e) if is_not_found(&e) => {
                    sch = 2; // channel 1 was closed by the 404
                    setup.channel_open(sch).await?;
                    let (name, ..) = setup
                        .queue_declare(sch, q, false, args.persistent, false, queue_args.clone())
                        .await?;
                    Ok((name, false))
                }
                Err(e) => Err(e),
            },
            None => {
                let (name, ..) = setup
                    .queue_declare(sch, "", false, false, true, queue_args.clone())
                    .await?;
                Ok((name, true))
            }
        }
    }
    .await;
    let (queue, server_named) = match declared {
        Ok(d) => d,
        Err(e) => {
            amqp::close_quietly(setup).await;
            return Err(e);
        }
    };

    // The other queues of --queues, each through the next URI in turn.
    if names.len() > 1 {
        let mut conns = Vec::new();
        for u in &uris {
            let mut c = Conn::open(u, "warren-perf declare").await?;
            c.channel_open(1).await?;
            conns.push(c);
        }
        let declared: Result<()> = async {
            for (k, q) in names.iter().enumerate().skip(1) {
                let c = &mut conns[k % uris.len()];
                c.queue_declare(1, q, false, args.persistent, false, queue_args.clone())
                    .await
                    .with_context(|| format!("declare {q}"))?;
            }
            Ok(())
        }
        .await;
        for c in conns {
            amqp::close_quietly(c).await;
        }
        if let Err(e) = declared {
            amqp::close_quietly(setup).await;
            return Err(e);
        }
    }
    let queue_label = match (&pattern, names.len()) {
        (Some(p), n) if n > 1 => format!("{p}-1..{p}-{n}"),
        _ => queue.clone(),
    };
    let queue_of = |i: usize| {
        names
            .get(i % names.len().max(1))
            .cloned()
            .unwrap_or_else(|| queue.clone())
    };
    let ccfg = ConsumerCfg {
        queue: queue.clone(),
        autoack: args.autoack,
        prefetch: args.prefetch,
        multi_ack_every: args.multi_ack_every,
        measure_latency: !args.consume_only,
    };
    let pcfg = ProducerCfg {
        queue: queue.clone(),
        size,
        persistent: args.persistent,
        confirm: args.confirm,
        rate: args.rate,
        count: args.count,
    };
    let mut cconns = Vec::new();
    let mut pconns = Vec::new();
    let opened: Result<()> = async {
        for i in 0..consumers {
            let cfg = ConsumerCfg {
                queue: queue_of(i),
                ..ccfg.clone()
            };
            let u = &consumer_uris[i % consumer_uris.len()];
            cconns.push((
                consumer::setup(u, &format!("warren-perf consumer-{i}"), &cfg).await?,
                cfg,
            ));
        }
        for i in 0..producers {
            let cfg = ProducerCfg {
                queue: queue_of(i),
                ..pcfg.clone()
            };
            let u = &uris[i % uris.len()];
            pconns.push((
                producer::setup(u, &format!("warren-perf producer-{i}"), &cfg).await?,
                cfg,
            ));
        }
        Ok(())
    }
    .await;
    if let Err(e) = opened {
        for (c, _) in cconns {
            amqp::close_quietly(c).await;
        }
        for (c, _) in pconns {
            amqp::close_quietly(c).await;
        }
        amqp::close_quietly(setup).await;
        return Err(e);
    }

    let log = |line: String| {
        if args.json {
            eprintln!("{line}");
        } else {
            println!("{line}");
        }
    };
    let mut desc = format!(
        "warren-perf: {}, {}, {}-byte messages, queue '{}'",
        plural(producers, "producer"),
        plural(consumers, "consumer"),
        size,
        queue_label
    );
    if producers > 0 {
        desc += &match args.confirm {
            0 => ", no confirms".to_string(),
            n => format!(", confirms (max {n} outstanding)"),
        };
        if args.persistent {
            desc += ", persistent";
        }
        if args.rate > 0 {
            desc += &format!(", rate {} msg/s per producer", args.rate);
        }
        if args.count > 0 {
            desc += &format!(", {} msgs per producer", args.count);
        }
    }
    if consumers > 0 {
        desc += &if args.autoack {
            ", autoack".to_string()
        } else if args.multi_ack_every > 1 {
            format!(", manual ack every {}", args.multi_ack_every)
        } else {
            ", manual ack".to_string()
        };
        if args.prefetch > 0 {
            desc += &format!(", prefetch {}", args.prefetch);
        }
    }
    log(desc);

    // Go.
    let stats = Arc::new(Stats::new());
    let interrupted = Arc::new(AtomicBool::new(false));
    {
        let (stats, interrupted) = (stats.clone(), interrupted.clone());
        tokio::spawn(async move {
            wait_for_signal().await;
            interrupted.store(true, Relaxed);
            stats.request_stop();
        });
    }
    let cpu0 = stats::process_cpu();
    let start = Instant::now();
    stats.last_recv_ns.store(stats.now_ns(), Relaxed);
    let mut tasks = Vec::new();
    for (c, cfg) in cconns {
        tasks.push(tokio::spawn(consumer::run(c, cfg, stats.clone())));
    }
    for (p, cfg) in pconns {
        tasks.push(tokio::spawn(producer::run(p, cfg, stats.clone())));
    }

    // Report once per second; check stop conditions 10 times per second.
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let (mut last_t, mut last_sent, mut last_recv, mut last_conf, mut last_nack) =
        (start, 0, 0, 0, 0);
    let mut next_report = 1u64;
    let target = producers as u64 * args.count;
    let (stopped, end) = loop {
        tick.tick().await;
        let now = Instant::now();
        let t = now - start;
        if stats.error().is_some() {
            break ("error", now);
        }
        if stats.stopping() {
            break (
                if interrupted.load(Relaxed) {
                    "interrupted"
                } else {
                    "stopped"
                },
                now,
            );
        }
        if t >= Duration::from_secs(next_report) {
            next_report = t.as_secs() + 1;
            let dt = (now - last_t).as_secs_f64();
            let (s, r) = (stats.sent.load(Relaxed), stats.received.load(Relaxed));
            let (cf, nk) = (stats.confirmed.load(Relaxed), stats.nacked.load(Relaxed));
            let rate = |a: u64, b: u64| ((a - b) as f64 / dt).round() as u64;
            let mut line = format!("time: {:.3}s", t.as_secs_f64());
            if producers > 0 {
                line += &format!(", sent: {} msg/s", rate(s, last_sent));
                if args.confirm > 0 {
                    line += &format!(
                        ", confirmed: {} msg/s, nacked: {} msg/s, longest confirm: {} µs",
                        rate(cf, last_conf),
                        rate(nk, last_nack),
                        stats.confirm_interval_max_ns.swap(0, Relaxed) / 1000
                    );
                }
            }
            if consumers > 0 {
                line += &format!(", received: {} msg/s", rate(r, last_recv));
                if ccfg.measure_latency {
                    let mut l = stats.latency.lock().unwrap();
                    let h = &l.interval;
                    let v: Vec<String> = if h.is_empty() {
                        vec!["0".into(); 5]
                    } else {
                        [
                            h.min() as f64 / 1000.0,
                            q_us(h, 0.5),
                            q_us(h, 0.75),
                            q_us(h, 0.95),
                            q_us(h, 0.99),
                        ]
                        .iter()
                        .map(|x| format!("{}", x.round() as u64))
                        .collect()
                    };
                    l.interval.reset();
                    drop(l);
                    line += &format!(
                        ", min/median/75th/95th/99th consumer latency: {} µs",
                        v.join("/")
                    );
                }
            }
            log(line);
            (last_t, last_sent, last_recv, last_conf, last_nack) = (now, s, r, cf, nk);
        }
        if args.duration > 0 && t >= Duration::from_secs(args.duration) {
            break ("duration", now);
        }
        // Drain and count stops end the measurement at the last delivery
        // (or the last producer's finish), not when the idle wait expires.
        let last_recv = stats.at(stats.last_recv_ns.load(Relaxed)).max(start);
        let idle = |since: Instant| {
            now.saturating_duration_since(since.max(last_recv)) >= Duration::from_secs(1)
        };
        if args.consume_only && idle(start) {
            break ("queue drained", last_recv);
        }
        if args.count > 0 && producers > 0 && stats.producers_done.load(Relaxed) >= producers as u64
        {
            let done = stats.at(stats.producers_done_ns.load(Relaxed)).max(start);
            if consumers == 0 {
                break ("count published", done);
            }
            if stats.received.load(Relaxed) >= target {
                break ("count consumed", last_recv.max(done));
            }
            if idle(done) {
                break ("count published; consumers idle 1 s", last_recv.max(done));
            }
        }
    };
    let elapsed = end.saturating_duration_since(start);
    stats.request_stop();
    let cpu1 = stats::process_cpu();

    // Let every connection close cleanly.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    for t in tasks {
        let abort = t.abort_handle();
        if tokio::time::timeout_at(deadline, t).await.is_err() {
            abort.abort();
        }
    }
    // Queue depth at the end (and deletion of a server-named queue), then
    // close the setup connection whatever happened on its channel.
    let depth = if server_named {
        setup.queue_delete(sch, &queue).await
    } else {
        setup
            .queue_declare(sch, &queue, true, false, false, FieldTable::default())
            .await
            .map(|d| d.1)
    };
    let depth = match depth {
        // Only the first of --queues was asked: its depth is not the run's.
        Ok(_) if names.len() > 1 => None,
        Ok(d) => Some(d),
        Err(e) => {
            if !(server_named && is_not_found(&e)) && stats.error().is_none() {
                eprintln!("warning: setup connection: {e:#}");
            }
            None
        }
    };
    if let Err(e) = setup.close(None).await {
        if stats.error().is_none() {
            eprintln!("warning: setup connection: {e:#}");
        }
    }

    // Summary.
    let secs = elapsed.as_secs_f64().max(1e-9);
    let sent = stats.sent.load(Relaxed);
    let received = stats.received.load(Relaxed);
    let confirmed = stats.confirmed.load(Relaxed);
    let nacked = stats.nacked.load(Relaxed);
    let returned = stats.returned.load(Relaxed);
    let unconfirmed = if args.confirm > 0 {
        sent.saturating_sub(confirmed + nacked)
    } else {
        0
    };
    let lat = stats.latency.lock().unwrap().total.clone();
    let clat = stats.confirm_latency.lock().unwrap().clone();
    let cpu = match (cpu0, cpu1) {
        (Some((u0, s0)), Some((u1, s1))) => Some((u1 - u0, s1 - s0)),
        _ => None,
    };
    let error = stats.error();
    let show_lat = consumers > 0 && ccfg.measure_latency && !lat.is_empty();

    if args.json {
        let hist_json = |h: &Histogram<u64>, full: bool| {
            let mut j = Json::new();
            j.int("count", h.len());
            if full {
                j.num("min", h.min() as f64 / 1000.0);
            }
            j.num("p50", q_us(h, 0.5));
            if full {
                j.num("p75", q_us(h, 0.75)).num("p95", q_us(h, 0.95));
            }
            j.num("p99", q_us(h, 0.99));
            if full {
                j.num("p99.9", q_us(h, 0.999));
            }
            j.num("max", h.max() as f64 / 1000.0);
            j.finish()
        };
        let mut j = Json::new();
        j.str("stopped", Some(stopped))
            .num_prec("duration_s", secs, 3)
            .int("producers", producers as u64)
            .int("consumers", consumers as u64)
            .int("size", size as u64)
            .int("requested_size", args.size as u64)
            .str("queue", Some(&queue_label))
            .int("confirm", args.confirm as u64)
            .boolean("autoack", args.autoack)
            .int("prefetch", args.prefetch as u64)
            .int("multi_ack_every", args.multi_ack_every)
            .boolean("persistent", args.persistent)
            .int("rate_limit", args.rate)
            .int("threads", args.threads.max(1) as u64)
            .int("sent", sent)
            .int("received", received)
            .int("confirmed", confirmed)
            .int("nacked", nacked)
            .int("returned", returned)
            .int("unconfirmed", unconfirmed)
            .num("sent_rate", sent as f64 / secs)
            .num("received_rate", received as f64 / secs)
            .num("confirmed_rate", confirmed as f64 / secs);
        if show_lat {
            j.raw("latency_us", &hist_json(&lat, true));
        } else {
            j.raw("latency_us", "null");
        }
        if args.confirm > 0 && !clat.is_empty() {
            j.raw("confirm_latency_us", &hist_json(&clat, false));
        } else {
            j.raw("confirm_latency_us", "null");
        }
        match depth {
            Some(d) => j.int("queue_depth_end", d as u64),
            None => j.raw("queue_depth_end", "null"),
        };
        match cpu {
            Some((u, s)) => j
                .num_prec("client_cpu_s", u + s, 2)
                .num("client_cpu_pct", (u + s) / secs * 100.0),
            None => j.raw("client_cpu_s", "null").raw("client_cpu_pct", "null"),
        };
        j.str("error", error.as_deref());
        println!("{}", j.finish());
    } else {
        println!(
            "summary: {:.3}s (stopped: {stopped}), {}, {}, {size}-byte messages, queue '{queue}'",
            secs,
            plural(producers, "producer"),
            plural(consumers, "consumer"),
        );
        if producers > 0 {
            println!("sent:      {sent} msgs, {:.0} msg/s", sent as f64 / secs);
        }
        if consumers > 0 {
            println!(
                "received:  {received} msgs, {:.0} msg/s",
                received as f64 / secs
            );
        }
        if args.confirm > 0 {
            println!(
                "confirmed: {confirmed} msgs, {:.0} msg/s; nacked: {nacked}; unconfirmed at stop: {unconfirmed}",
                confirmed as f64 / secs
            );
        }
        if returned > 0 {
            println!("returned:  {returned}");
        }
        if show_lat {
            println!(
                "consumer latency (µs): p50 {:.0}, p75 {:.0}, p95 {:.0}, p99 {:.0}, p99.9 {:.0}, max {:.0} ({} samples)",
                q_us(&lat, 0.5),
                q_us(&lat, 0.75),
                q_us(&lat, 0.95),
                q_us(&lat, 0.99),
                q_us(&lat, 0.999),
                lat.max() as f64 / 1000.0,
                lat.len()
            );
        } else if args.consume_only {
            println!("consumer latency: n/a (messages were published by another process)");
        }
        if args.confirm > 0 && !clat.is_empty() {
            println!(
                "confirm latency (µs): p50 {:.0}, p99 {:.0}, max {:.0}",
                q_us(&clat, 0.5),
                q_us(&clat, 0.99),
                clat.max() as f64 / 1000.0
            );
        }
        if let Some(d) = depth {
            println!("queue depth at end: {d}");
        }
        if let Some((u, s)) = cpu {
            println!(
                "client CPU: {u:.2}s user + {s:.2}s sys = {:.0}% of one core",
                (u + s) / secs * 100.0
            );
        }
    }
    if let Some(e) = &error {
        eprintln!("warren-perf: error: {e}");
    }
    Ok(error.is_none())
}
