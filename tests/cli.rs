//! The `warren` binary: config handling and signal shutdown, on a real process.

use std::io::Write;
use std::net::TcpStream;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// A test's folder: removed when the test passes, kept for a look when it fails.
struct TempDir(std::path::PathBuf);

impl std::ops::Deref for TempDir {
    type Target = std::path::Path;
    fn deref(&self) -> &std::path::Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

fn temp_dir(name: &str) -> TempDir {
    let d = std::env::temp_dir().join(format!("warren-cli-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).expect("temp dir");
    TempDir(d)
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

#[test]
fn unknown_config_key_is_refused_with_its_name() {
    let dir = temp_dir("badkey");
    let cfg = dir.join("bad.toml");
    std::fs::write(&cfg, "[amqp]\nlisten = \"127.0.0.1:0\"\nbogus_key = 1\n").unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_warren"))
        .arg("--config")
        .arg(&cfg)
        .output()
        .expect("run warren");
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("bogus_key"), "stderr: {stderr}");
}

/// Reads frames until a connection.close arrives; returns its reply code.
fn read_close_code(s: &mut TcpStream) -> Option<u16> {
    use std::io::Read;
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        match s.read(&mut chunk) {
            Ok(0) => return None,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
            Err(_) => return None,
        }
        let mut rest = &buf[..];
        while let Ok(Some((f, used))) = warren::amqp::frame::split(rest, 0) {
            if let Some((10, 50)) = warren::amqp::frame::method_ids(f.payload) {
                return Some(u16::from_be_bytes([f.payload[4], f.payload[5]]));
            }
            rest = &rest[used..];
        }
    }
    None
}

#[test]
fn sigterm_closes_clients_with_320_and_exits_0() {
    use amq_protocol::protocol::{connection, AMQPClass};
    let dir = temp_dir("sigterm");
    let port = free_port();
    let cfg = dir.join("w.toml");
    std::fs::write(
        &cfg,
        format!(
            "[node]\ndata_dir = \"{}\"\n[amqp]\nlisten = \"127.0.0.1:{port}\"\n[admin]\nlisten = \"127.0.0.1:0\"\n[management]\nlisten = \"127.0.0.1:0\"\n[prometheus]\nlisten = \"127.0.0.1:0\"\n",
            dir.join("data").display()
        ),
    )
    .unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_warren"))
        .arg("--config")
        .arg(&cfg)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn warren");
    let start = Instant::now();
    let mut s = loop {
        match TcpStream::connect(("127.0.0.1", port)) {
            Ok(s) => break s,
            Err(_) if start.elapsed() < Duration::from_secs(10) => {
                std::thread::sleep(Duration::from_millis(50))
            }
            Err(e) => {
                let _ = child.kill();
                panic!("node did not listen: {e}");
            }
        }
    };
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    // A full handshake by hand, so this test needs no client library.
    let mut out = warren::amqp::frame::PROTOCOL_HEADER.to_vec();
    let methods = [
        AMQPClass::Connection(connection::AMQPMethod::StartOk(connection::StartOk {
            client_properties: Default::default(),
            mechanism: "PLAIN".into(),
            response: "\0guest\0guest".into(),
            locale: "en_US".into(),
        })),
        AMQPClass::Connection(connection::AMQPMethod::TuneOk(connection::TuneOk {
            channel_max: 10,
            frame_max: 131072,
            heartbeat: 0,
        })),
        AMQPClass::Connection(connection::AMQPMethod::Open(connection::Open {
            virtual_host: "/".into(),
        })),
    ];
    for m in &methods {
        warren::amqp::frame::encode_method(&mut out, 0, m);
    }
    s.write_all(&out).unwrap();
    std::thread::sleep(Duration::from_millis(300));
    let pid = child.id().to_string();
    let killed = Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .expect("kill");
    assert!(killed.success());
    let code = read_close_code(&mut s);
    // Answer close-ok so the node can finish quickly.
    let mut ok = Vec::new();
    warren::amqp::frame::encode_method(
        &mut ok,
        0,
        &AMQPClass::Connection(connection::AMQPMethod::CloseOk(connection::CloseOk {})),
    );
    let _ = s.write_all(&ok);
    let status = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break st;
        }
        if start.elapsed() > Duration::from_secs(20) {
            let _ = child.kill();
            panic!("node did not exit after SIGTERM");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(code, Some(320));
    assert!(status.success(), "exit status {status}");
}
