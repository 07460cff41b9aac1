//! `warren`: starts a node. With no flags it uses the embedded default config
//! (127.0.0.1:5672, data under ./warren-data); `--config FILE` reads FILE instead.
//! `warren inspect-queue` and `warren inspect-message` read a node's storage (read-only).

use std::path::PathBuf;

use anyhow::Context;
use clap::Parser;
use warren::config::Config;
use warren::runtime::{Node, EXIT_STORAGE_FAILED};

#[derive(Parser, Debug)]
#[command(
    name = "warren",
    version,
    about = "A RabbitMQ-compatible AMQP 0-9-1 broker"
)]
struct Args {
    /// Configuration file (TOML); the embedded default when absent.
    #[arg(long, global = true)]
    config: Option<PathBuf>,
    #[command(subcommand)]
    command: Option<Cmd>,
}

#[derive(clap::Subcommand, Debug)]
enum Cmd {
    /// Lists a durable queue's index entries (seq, message id, delivered, size, where stored).
    InspectQueue {
        /// Vhost.
        #[arg(long, default_value = "/")]
        vhost: String,
        /// Queue name.
        #[arg(long)]
        queue: String,
        /// Data folder (default: the config's data_dir).
        #[arg(long)]
        data_dir: Option<PathBuf>,
        /// Adds each message's body, in hex, as a last column.
        #[arg(long)]
        bodies: bool,
    },
    /// Reads a message body by id from the persistent message store.
    InspectMessage {
        /// The message id, 32 hex digits, as inspect-queue prints it.
        #[arg(long)]
        id: String,
        /// Data folder (default: the config's data_dir).
        #[arg(long)]
        data_dir: Option<PathBuf>,
    },
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    let config = match &args.config {
        Some(path) => Config::load(path)?,
        None => Config::embedded(),
    };
    use warren::runtime::inspect;
    match args.command {
        None => {}
        Some(Cmd::InspectQueue {
            vhost,
            queue,
            data_dir,
            bodies,
        }) => {
            let dir = data_dir.unwrap_or(config.node.data_dir);
            let entries = inspect::queue_entries(&dir, &vhost, &queue)?;
            let bodies = match bodies {
                true => Some(inspect::entry_bodies(&dir, &entries)?),
                false => None,
            };
            print!("{}", inspect::format_queue(&entries, bodies.as_deref()));
            return Ok(());
        }
        Some(Cmd::InspectMessage { id, data_dir }) => {
            let dir = data_dir.unwrap_or(config.node.data_dir);
            let bytes = inspect::message_bytes(&dir, &id)?;
            print!("{}", inspect::format_message(&id, &bytes)?);
            return Ok(());
        }
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("cannot start the tokio runtime")?;
    runtime.block_on(async move {
        // One listener for the whole run: a SIGTERM that came between two listeners (the
        // node just ready) would be lost, since a new one hears only later signals.
        let mut signals = Signals::install()?;
        // A clustered node waits for its cluster before it serves clients; a signal still
        // stops it meanwhile.
        let node = tokio::select! {
            node = Node::start(config) => node?,
            r = signals.wait() => {
                r?;
                tracing::info!("stopped before the node was ready");
                return anyhow::Ok(());
            }
        };
        tokio::select! {
            r = signals.wait() => r?,
            why = node.failed() => {
                // No graceful stop: that would run the failed storage again. What was
                // confirmed is in the files; the rest is unconfirmed, as after a crash.
                tracing::error!(reason = %why, code = EXIT_STORAGE_FAILED, "stopping: this node can no longer keep what it confirms; a restart recovers from its files");
                std::process::exit(EXIT_STORAGE_FAILED);
            }
        }
        tracing::info!("shutting down");
        node.shutdown().await;
        anyhow::Ok(())
    })
}

/// SIGTERM and SIGINT (Ctrl-C), listened for from start to stop.
struct Signals {
    term: tokio::signal::unix::Signal,
    int: tokio::signal::unix::Signal,
}

impl Signals {
    fn install() -> anyhow::Result<Signals> {
        use tokio::signal::unix::{signal, SignalKind};
        Ok(Signals {
            term: signal(SignalKind::terminate()).context("cannot install SIGTERM handler")?,
            int: signal(SignalKind::interrupt()).context("cannot install SIGINT handler")?,
        })
    }

    /// The next SIGTERM or SIGINT (also one that came before this call).
    async fn wait(&mut self) -> anyhow::Result<()> {
        tokio::select! {
            _ = self.term.recv() => {}
            _ = self.int.recv() => {}
        }
        Ok(())
    }
}
