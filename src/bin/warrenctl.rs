//! `warrenctl`: a `rabbitmqctl`-style command line for a running warren node.
//!
//! `warrenctl [--node HOST:PORT] [-u USER] [--password P] [--formatter json|tsv]
//! [--cacert FILE [--cert FILE --key FILE] [--server-name NAME]] COMMAND ARGS...`
//!
//! With `--cacert` it speaks TLS to an endpoint with `[admin.tls]`: the node's certificate
//! must chain to the CAs in FILE and name the host of `--node` (or `--server-name`);
//! `--cert`/`--key` present a client certificate, for an endpoint with `verify_peer`.
//!
//! It connects to the node's admin listener (default `127.0.0.1:5679`), authenticates (an
//! `administrator`-tagged user; default `guest`/`guest`), sends one request and prints the
//! answer: a tab-separated table with a header line, or with `--formatter json` a JSON array
//! of objects.
//!
//! Exit codes (as `rabbitmqctl`): 0 success; 1 the node refused the command; 64 usage error;
//! 69 the node is unreachable (a refused TLS handshake included); 2 authentication refused;
//! 70 protocol failure.

use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use warren::admin::{self, cli, json, Auth, Request, Response};

const EX_REFUSED: u8 = 1;
const EX_AUTH: u8 = 2;
const EX_USAGE: u8 = 64;
const EX_UNAVAILABLE: u8 = 69;
const EX_SOFTWARE: u8 = 70;

const TIMEOUT: Duration = Duration::from_secs(30);

#[derive(Debug, thiserror::Error)]
enum CtlError {
    #[error("{0}")]
    Usage(String),
    #[error("unable to connect to node {node}: {reason}")]
    Unavailable { node: String, reason: String },
    #[error("{0}")]
    Auth(String),
    #[error("protocol error talking to {node}: {reason}")]
    Protocol { node: String, reason: String },
}

impl CtlError {
    fn code(&self) -> u8 {
        match self {
            CtlError::Usage(_) => EX_USAGE,
            CtlError::Unavailable { .. } => EX_UNAVAILABLE,
            CtlError::Auth(_) => EX_AUTH,
            CtlError::Protocol { .. } => EX_SOFTWARE,
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Formatter {
    Tsv,
    Json,
}

/// `--cacert`, `--cert`, `--key`, `--server-name`.
#[derive(Default)]
struct TlsOptions {
    cacert: Option<PathBuf>,
    cert: Option<PathBuf>,
    key: Option<PathBuf>,
    server_name: Option<String>,
}

struct Options {
    node: String,
    tls: TlsOptions,
    user: String,
    password: String,
    formatter: Formatter,
    quiet: bool,
    command: String,
    args: Vec<String>,
}

const USAGE: &str = "Usage: warrenctl [--node HOST:PORT] [-u USER] [--password P] \
[--formatter json|tsv] [-q] [--cacert FILE [--cert FILE --key FILE] [--server-name NAME]] \
COMMAND [ARGS...]";

fn parse_options(argv: &[String]) -> Result<Options, CtlError> {
    let mut o = Options {
        node: "127.0.0.1:5679".into(),
        tls: TlsOptions::default(),
        user: "guest".into(),
        password: "guest".into(),
        formatter: Formatter::Tsv,
        quiet: false,
        command: String::new(),
        args: Vec::new(),
    };
    let mut i = 0;
    let value = |i: usize, name: &str| -> Result<String, CtlError> {
        argv.get(i + 1)
            .cloned()
            .ok_or_else(|| CtlError::Usage(format!("option {name} needs a value\n{USAGE}")))
    };
    while i < argv.len() {
        let a = argv[i].as_str();
        match a {
            "-n" | "--node" => o.node = value(i, a)?,
            "-u" | "--username" | "--user" => o.user = value(i, a)?,
            "--password" => o.password = value(i, a)?,
            "--cacert" => o.tls.cacert = Some(value(i, a)?.into()),
            "--cert" => o.tls.cert = Some(value(i, a)?.into()),
            "--key" => o.tls.key = Some(value(i, a)?.into()),
            "--server-name" => o.tls.server_name = Some(value(i, a)?),
            "--formatter" => {
                o.formatter = match value(i, a)?.as_str() {
                    "json" => Formatter::Json,
                    "tsv" | "table" => Formatter::Tsv,
                    other => {
                        return Err(CtlError::Usage(format!(
                            "unknown formatter '{other}' (json or tsv)\n{USAGE}"
                        )))
                    }
                }
            }
            "-q" | "--quiet" => {
                o.quiet = true;
                i += 1;
                continue;
            }
            "-h" | "--help" => {
                let cmds: Vec<String> = cli::COMMANDS
                    .iter()
                    .map(|(_, s)| format!("  {s}"))
                    .collect();
                return Err(CtlError::Usage(format!(
                    "{USAGE}\n\nCommands:\n{}",
                    cmds.join("\n")
                )));
            }
            s if s.starts_with('-') => {
                // Options may also follow the command (`-p` belongs to the command).
                if o.command.is_empty() {
                    return Err(CtlError::Usage(format!("unknown option '{s}'\n{USAGE}")));
                }
                o.args.push(s.to_string());
                i += 1;
                continue;
            }
            s => {
                if o.command.is_empty() {
                    o.command = s.to_string();
                } else {
                    o.args.push(s.to_string());
                }
                i += 1;
                continue;
            }
        }
        i += 2;
    }
    if o.command.is_empty() {
        return Err(CtlError::Usage(format!("no command given\n{USAGE}")));
    }
    let t = &o.tls;
    if t.cert.is_some() != t.key.is_some() {
        return Err(CtlError::Usage(format!(
            "--cert and --key go together\n{USAGE}"
        )));
    }
    if t.cacert.is_none() && (t.cert.is_some() || t.server_name.is_some()) {
        return Err(CtlError::Usage(format!(
            "--cert, --key and --server-name need --cacert (TLS)\n{USAGE}"
        )));
    }
    Ok(o)
}

/// A connection to the admin endpoint, plaintext or TLS.
trait Stream: Read + Write {}
impl<T: Read + Write> Stream for T {}

/// The TLS session over `tcp` described by `--cacert` and friends, handshaken: a refused
/// handshake (a node certificate from another CA, a client certificate the node does not
/// accept) is reported as an unreachable node, before any password is sent.
fn tls_stream(
    node: &str,
    tls: &TlsOptions,
    ca: &std::path::Path,
    mut tcp: TcpStream,
) -> Result<Box<dyn Stream>, CtlError> {
    let unavailable = |reason: String| CtlError::Unavailable {
        node: node.to_string(),
        reason,
    };
    let identity = tls.cert.as_deref().zip(tls.key.as_deref());
    let config = warren::runtime::tls::client_config_with("warrenctl", ca, identity)
        .map_err(|e| CtlError::Usage(e.to_string()))?;
    let name = match &tls.server_name {
        Some(n) => rustls::pki_types::ServerName::try_from(n.clone())
            .map_err(|e| CtlError::Usage(format!("--server-name {n}: {e}")))?,
        None => warren::runtime::tls::server_name(node).map_err(CtlError::Usage)?,
    };
    let mut conn = rustls::ClientConnection::new(Arc::clone(&config), name)
        .map_err(|e| unavailable(format!("TLS: {e}")))?;
    while conn.is_handshaking() {
        conn.complete_io(&mut tcp)
            .map_err(|e| unavailable(format!("TLS handshake failed: {e}")))?;
    }
    Ok(Box::new(rustls::StreamOwned::new(conn, tcp)))
}

fn connect(node: &str) -> Result<TcpStream, CtlError> {
    let unavailable = |reason: String| CtlError::Unavailable {
        node: node.to_string(),
        reason,
    };
    let addrs: Vec<_> = node
        .to_socket_addrs()
        .map_err(|e| unavailable(format!("bad address: {e}")))?
        .collect();
    let mut last = String::from("no address");
    for addr in addrs {
        match TcpStream::connect_timeout(&addr, Duration::from_secs(5)) {
            Ok(s) => {
                s.set_read_timeout(Some(TIMEOUT))
                    .and_then(|()| s.set_write_timeout(Some(TIMEOUT)))
                    .map_err(|e| unavailable(e.to_string()))?;
                let _ = s.set_nodelay(true);
                return Ok(s);
            }
            Err(e) => last = e.to_string(),
        }
    }
    Err(unavailable(last))
}

fn exchange<T: serde::Serialize>(
    stream: &mut dyn Stream,
    node: &str,
    msg: &T,
) -> Result<Response, CtlError> {
    let protocol = |reason: String| CtlError::Protocol {
        node: node.to_string(),
        reason,
    };
    let frame = admin::encode_frame(msg).map_err(|e| protocol(e.to_string()))?;
    stream
        .write_all(&frame)
        .and_then(|()| stream.flush())
        .map_err(|e| protocol(format!("write: {e}")))?;
    let mut prefix = [0u8; 4];
    stream
        .read_exact(&mut prefix)
        .map_err(|e| protocol(format!("read: {e} (connection closed?)")))?;
    let len = admin::frame_len(prefix).map_err(|e| protocol(e.to_string()))?;
    let mut body = vec![0u8; len];
    stream
        .read_exact(&mut body)
        .map_err(|e| protocol(format!("read: {e}")))?;
    admin::decode_body(&body).map_err(|e| protocol(e.to_string()))
}

fn print_table(r: &Response, formatter: Formatter, quiet: bool) {
    match formatter {
        Formatter::Json => println!("{}", json::write_rows(&r.columns, &r.rows)),
        Formatter::Tsv => {
            let mut out = String::new();
            if !quiet {
                out.push_str(&r.columns.join("\t"));
                out.push('\n');
            }
            for row in &r.rows {
                out.push_str(&row.join("\t"));
                out.push('\n');
            }
            print!("{out}");
        }
    }
}

/// The definitions file's text (`-`: standard input).
fn read_definitions(path: &str) -> Result<String, CtlError> {
    let mut text = String::new();
    let read = if path == "-" {
        std::io::stdin().read_to_string(&mut text).map(|_| ())
    } else {
        std::fs::read_to_string(path).map(|t| text = t)
    };
    read.map_err(|e| CtlError::Usage(format!("cannot read {path}: {e}")))?;
    Ok(text)
}

/// Writes the exported definitions (`-`: standard output).
fn write_definitions(path: &str, json: &str) -> Result<(), CtlError> {
    let written = if path == "-" {
        writeln!(std::io::stdout(), "{json}")
    } else {
        std::fs::write(path, format!("{json}\n"))
    };
    written.map_err(|e| CtlError::Usage(format!("cannot write {path}: {e}")))
}

fn run(argv: &[String]) -> Result<u8, CtlError> {
    let o = parse_options(argv)?;
    let mut request: Request =
        cli::parse(&o.command, &o.args).map_err(|e| CtlError::Usage(e.to_string()))?;
    let file = cli::definitions_path(&o.command, &o.args);
    if let (Request::ImportDefinitions { json }, Some(path)) = (&mut request, &file) {
        *json = read_definitions(path)?;
    }
    let tcp = connect(&o.node)?;
    let mut stream: Box<dyn Stream> = match &o.tls.cacert {
        None => Box::new(tcp),
        Some(ca) => tls_stream(&o.node, &o.tls, ca, tcp)?,
    };
    let auth = exchange(
        &mut *stream,
        &o.node,
        &Auth {
            user: o.user.clone(),
            password: o.password.clone(),
        },
    )?;
    if !auth.ok {
        return Err(CtlError::Auth(auth.message));
    }
    let r = exchange(&mut *stream, &o.node, &request)?;
    if !r.ok {
        eprintln!("Error: {}", r.message);
        return Ok(EX_REFUSED);
    }
    if let (Request::ExportDefinitions, Some(path)) = (&request, &file) {
        write_definitions(path, &r.message)?;
    } else if !r.columns.is_empty() {
        print_table(&r, o.formatter, o.quiet);
    } else if !o.quiet && !r.message.is_empty() {
        match o.formatter {
            Formatter::Json => println!(
                "{{\"result\":\"ok\",\"message\":{}}}",
                json::quote(&r.message)
            ),
            Formatter::Tsv => println!("{}", r.message),
        }
    }
    Ok(0)
}

fn main() -> ExitCode {
    let argv: Vec<String> = std::env::args().skip(1).collect();
    match run(&argv) {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            eprintln!("Error: {e}");
            ExitCode::from(e.code())
        }
    }
}
