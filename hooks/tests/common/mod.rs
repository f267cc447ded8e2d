//! What the proxy's tests share: a throwaway PostgreSQL, an MCP client over stdio (the
//! harness's side), the proxy's control socket.
#![allow(dead_code)]

use postgres::{Client, NoTls};
use serde_json::{json, Value};
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};

/// Polls `done` every 20 ms until it holds; fails with `what` once `secs` seconds have passed.
pub fn wait_until(secs: u64, what: &str, mut done: impl FnMut() -> bool) {
    let end = std::time::Instant::now() + std::time::Duration::from_secs(secs);
    while !done() {
        assert!(std::time::Instant::now() < end, "{what}");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

pub fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

pub fn pg_bin() -> Option<PathBuf> {
    let p = std::env::var_os("PLANARIAN_PG_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/usr/lib/postgresql/15/bin"));
    p.join("initdb").exists().then_some(p)
}

/// A throwaway cluster on a loopback port, stopped on drop.
pub struct Pg {
    pub dir: PathBuf,
    pub bin: PathBuf,
    pub port: u16,
    _scratch: tempfile::TempDir,
}

pub fn as_postgres(cmd: &mut Command) -> &mut Command {
    // initdb refuses to run as root: the tests (and CI) run as root.
    if nix_is_root() {
        use std::os::unix::process::CommandExt;
        let uid = user_id("postgres").expect("a postgres user (Debian's postgresql package makes one)");
        cmd.uid(uid.0).gid(uid.1);
    }
    cmd
}

pub fn nix_is_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .map(|s| s.lines().any(|l| l.starts_with("Uid:") && l.split_whitespace().nth(1) == Some("0")))
        .unwrap_or(false)
}

pub fn user_id(name: &str) -> Option<(u32, u32)> {
    std::fs::read_to_string("/etc/passwd").ok()?.lines().find_map(|l| {
        let f: Vec<&str> = l.split(':').collect();
        (f.first() == Some(&name)).then(|| (f[2].parse().ok(), f[3].parse().ok())).and_then(|(u, g)| Some((u?, g?)))
    })
}

impl Pg {
    pub fn start(bin: &Path, tag: &str) -> Pg {
        // (the server runs as postgres: the scratch directory is open to it, its data is its own)
        let scratch = tempfile::tempdir().unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(scratch.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        let dir = scratch.path().join(tag);
        std::fs::create_dir_all(&dir).unwrap();
        if nix_is_root() {
            let (u, g) = user_id("postgres").unwrap();
            std::os::unix::fs::chown(&dir, Some(u), Some(g)).unwrap();
        }
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let ok = as_postgres(Command::new(bin.join("initdb")).args(["-D"]).arg(dir.join("data")).args([
            "-A",
            "trust",
            "-U",
            "postgres",
            "--no-sync",
        ]))
        .stdout(Stdio::null())
        .status()
        .unwrap();
        assert!(ok.success(), "initdb failed");
        let ok = as_postgres(
            Command::new(bin.join("pg_ctl"))
                .args(["-D"])
                .arg(dir.join("data"))
                .args(["-w", "-l"])
                .arg(dir.join("log"))
                .args([
                    "-o",
                    &format!("-k {} -c listen_addresses=127.0.0.1 -p {port} -c fsync=off", dir.display()),
                    "start",
                ]),
        )
        .stdout(Stdio::null())
        .status()
        .unwrap();
        assert!(ok.success(), "pg_ctl start failed: {}", std::fs::read_to_string(dir.join("log")).unwrap_or_default());
        Pg { dir, bin: bin.to_path_buf(), port, _scratch: scratch }
    }

    pub fn dsn(&self) -> String {
        format!("host=127.0.0.1 port={} user=postgres dbname=postgres", self.port)
    }

    pub fn client(&self) -> Client {
        Client::connect(&self.dsn(), NoTls).unwrap()
    }
}

impl Drop for Pg {
    fn drop(&mut self) {
        let _ = as_postgres(Command::new(self.bin.join("pg_ctl")).arg("-D").arg(self.dir.join("data")).args([
            "-m",
            "immediate",
            "stop",
        ]))
        .stdout(Stdio::null())
        .status();
    }
}

/// An MCP client over stdio: the harness's side.
pub struct Mcp {
    pub child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
    next: u64,
}

impl Mcp {
    /// Started, not yet initialized.
    pub fn start(mut cmd: Command) -> Mcp {
        let mut child = cmd.stdin(Stdio::piped()).stdout(Stdio::piped()).spawn().unwrap();
        let stdin = child.stdin.take().unwrap();
        let stdout = BufReader::new(child.stdout.take().unwrap());
        Mcp { child, stdin, stdout, next: 100 }
    }

    pub fn spawn(cmd: Command) -> Mcp {
        let mut m = Mcp::start(cmd);
        let init = m.request(
            "initialize",
            json!({"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "planarian-test", "version": "1"}}),
        );
        assert!(init["result"]["serverInfo"].is_object(), "{init}");
        m.send(&json!({"jsonrpc": "2.0", "method": "notifications/initialized"}));
        m
    }

    pub fn send(&mut self, v: &Value) {
        writeln!(self.stdin, "{v}").unwrap();
        self.stdin.flush().unwrap();
    }

    pub fn recv(&mut self) -> Value {
        let mut line = String::new();
        assert!(self.stdout.read_line(&mut line).unwrap() > 0, "the MCP server closed its output");
        serde_json::from_str(&line).unwrap()
    }

    pub fn request(&mut self, method: &str, params: Value) -> Value {
        self.next += 1;
        let id = json!(format!("req-{}", self.next));
        self.send(&json!({"jsonrpc": "2.0", "id": id, "method": method, "params": params}));
        loop {
            let m = self.recv();
            if m["id"] == id {
                return m;
            }
        }
    }

    pub fn sql(&mut self, sql: &str) -> Value {
        let r = self.request("tools/call", json!({"name": "execute_sql", "arguments": {"sql": sql}}));
        assert!(r.get("result").is_some(), "{sql}: {r}");
        r["result"].clone()
    }
}

impl Drop for Mcp {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub fn control(p: &Path, args: &[&str]) -> Result<Value, String> {
    let out =
        Command::new(env!("CARGO_BIN_EXE_planarian-mcp-proxy")).arg("control").arg(p).args(args).output().unwrap();
    if out.status.success() {
        Ok(serde_json::from_slice(&out.stdout).unwrap())
    } else {
        Err(String::from_utf8_lossy(&out.stderr).trim().to_string())
    }
}
