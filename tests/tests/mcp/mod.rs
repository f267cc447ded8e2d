//! What the remote-state suites share: a real PostgreSQL of the test's own, the harness side of
//! a sandbox's MCP sidecar, and the MCP servers tests/run installs.
#![allow(dead_code)]

use planarian_system_tests::*;
use serde_json::{json, Value};
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::Duration;

pub fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

pub fn proxy_bin() -> PathBuf {
    planarian_bin().with_file_name("planarian-mcp-proxy")
}

pub struct Pg {
    pub dir: PathBuf,
    pub port: u16,
}

/// The server binaries of the newest PostgreSQL installed (Debian 12 has 15, Debian 13 17).
pub fn pg_bin() -> String {
    let mut versions: Vec<u32> = std::fs::read_dir("/usr/lib/postgresql")
        .map(|d| d.flatten().filter_map(|e| e.file_name().to_str()?.parse().ok()).collect())
        .unwrap_or_default();
    versions.sort_unstable();
    format!("/usr/lib/postgresql/{}/bin", versions.last().copied().unwrap_or(15))
}

impl Pg {
    pub fn start() -> Pg {
        let dir = PathBuf::from(format!("/tmp/pltest-pg-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        cmd("chown", ["postgres:postgres", dir.to_str().unwrap()]).ok();
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let d = dir.display();
        cmd(
            "runuser",
            [
                "-u",
                "postgres",
                "--",
                &format!("{}/initdb", pg_bin()),
                "-D",
                &format!("{d}/data"),
                "-A",
                "trust",
                "-U",
                "postgres",
                "--no-sync",
            ],
        )
        .ok();
        cmd(
            "runuser",
            [
                "-u",
                "postgres",
                "--",
                &format!("{}/pg_ctl", pg_bin()),
                "-D",
                &format!("{d}/data"),
                "-w",
                "-l",
                &format!("{d}/log"),
                "-o",
                &format!("-k {d} -c listen_addresses=127.0.0.1 -p {port} -c fsync=off"),
                "start",
            ],
        )
        .ok();
        Pg { dir, port }
    }

    pub fn psql(&self, sql: &str) -> String {
        self.psql_in("postgres", sql)
    }

    pub fn psql_in(&self, db: &str, sql: &str) -> String {
        cmd(
            "psql",
            ["-X", "-A", "-t", "-h", "127.0.0.1", "-p", &self.port.to_string(), "-U", "postgres", "-d", db, "-c", sql],
        )
        .out()
    }
}

impl Drop for Pg {
    fn drop(&mut self) {
        let d = self.dir.display();
        let _ = Command::new("runuser")
            .args([
                "-u",
                "postgres",
                "--",
                &format!("{}/pg_ctl", pg_bin()),
                "-D",
                &format!("{d}/data"),
                "-m",
                "immediate",
                "stop",
            ])
            .output();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The harness's side: `planarian-mcp-proxy connect ID` is its stdio MCP server.
pub struct Harness {
    pub child: Child,
    pub stdin: ChildStdin,
    /// Lines from the proxy, read by a thread: a hung proxy fails the test instead of hanging it.
    pub lines: std::sync::mpsc::Receiver<String>,
    pub next: u64,
}

impl Harness {
    pub fn connect(container_id: &str) -> Harness {
        let mut child = Command::new(proxy_bin())
            .args(["connect", container_id])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let stdin = child.stdin.take().unwrap();
        let stdout: BufReader<ChildStdout> = BufReader::new(child.stdout.take().unwrap());
        let (tx, lines) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in stdout.lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let mut h = Harness { child, stdin, lines, next: 0 };
        let t = std::time::Instant::now();
        let init = h.request("initialize", json!({"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "pltest", "version": "1"}}));
        assert!(init["result"]["serverInfo"].is_object(), "{init}");
        eprintln!(
            "MCP session through the sidecar of {container_id} initialized in {:.1} s",
            t.elapsed().as_secs_f64()
        );
        writeln!(h.stdin, "{}", json!({"jsonrpc": "2.0", "method": "notifications/initialized"})).unwrap();
        h
    }

    pub fn request(&mut self, method: &str, params: Value) -> Value {
        self.next += 1;
        writeln!(
            self.stdin,
            "{}",
            json!({"jsonrpc": "2.0", "id": self.next, "method": method, "params": params.clone()})
        )
        .unwrap();
        self.stdin.flush().unwrap();
        loop {
            // Generous: the first call waits for the server to start, and under emulation the
            // Toolbox (a 300 MB binary read over 9p) takes minutes to load.
            let line = match self.lines.recv_timeout(Duration::from_secs(400)) {
                Ok(l) => l,
                Err(e) => panic!(
                    "no answer to {method} {params} from the MCP proxy within 400 s ({e}); processes:\n{}\nsidecar logs:\n{}",
                    cmd("ps", ["-eo", "pid,ppid,stat,args"]).stdout,
                    sidecar_logs()
                ),
            };
            let m: Value = serde_json::from_str(&line).unwrap();
            if m["id"] == json!(self.next) {
                return m;
            }
            eprintln!("(MCP message while waiting for {method}: {})", line.chars().take(300).collect::<String>());
        }
    }

    pub fn sql(&mut self, sql: &str) -> Value {
        self.call("execute_sql", json!({"sql": sql}))
    }

    pub fn call(&mut self, tool: &str, args: Value) -> Value {
        let r = self.request("tools/call", json!({"name": tool, "arguments": args}));
        r["result"].clone()
    }
}

impl Drop for Harness {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Every sidecar's log, for a failure message.
pub fn sidecar_logs() -> String {
    let mut out = String::new();
    for e in std::fs::read_dir("/var/lib/planarian/containers").into_iter().flatten().flatten() {
        out += &format!(
            "{}: {:?}\n",
            e.path().display(),
            std::fs::read_dir(e.path()).into_iter().flatten().flatten().map(|f| f.file_name()).collect::<Vec<_>>()
        );
        let log = e.path().join("mcp-proxy.log");
        if let Ok(text) = std::fs::read_to_string(&log) {
            let tail: Vec<&str> = text.lines().rev().take(40).collect();
            out += &format!("== {}\n{}\n", log.display(), tail.into_iter().rev().collect::<Vec<_>>().join("\n"));
        }
    }
    out
}

pub fn sidecar_running(id: &str) -> bool {
    cmd("pgrep", ["-f", &format!("planarian-mcp-proxy serve --container {id}")]).code == Some(0)
}

pub fn node_and_dbhub() -> Option<(PathBuf, PathBuf)> {
    let dbhub = repo().join("target/npm/node_modules/@bytebase/dbhub/dist/index.js");
    let node = ["/usr/bin/node", "/usr/local/bin/node"].into_iter().map(PathBuf::from).find(|p| p.exists());
    match (node, dbhub.exists()) {
        (Some(node), true) => Some((node, dbhub)),
        _ => {
            assert!(
                std::env::var_os("PLANARIAN_REQUIRE_SYSTEM").is_none(),
                "node or DBHub missing ({}): tests/run installs them",
                dbhub.display()
            );
            eprintln!("SKIPPED: node or DBHub missing ({})", dbhub.display());
            None
        }
    }
}

/// DBHub serving Streamable HTTP against `pg`'s database `postgres`, started here (not by a
/// sidecar) and stopped on drop: one server for a test's sandboxes, where DBHub's start (a
/// minute under emulation) is not the point.
pub struct DbhubHttp {
    child: Child,
    pub port: u16,
}

impl DbhubHttp {
    pub fn start(node: &Path, dbhub: &Path, pg: &Pg) -> DbhubHttp {
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let child = Command::new(node)
            .arg(dbhub)
            .args(["--transport", "http", "--port", &port.to_string()])
            .args(["--dsn", &format!("postgres://postgres@127.0.0.1:{}/postgres?sslmode=disable", pg.port)])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let server = DbhubHttp { child, port };
        let up = wait_for(Duration::from_secs(300), || std::net::TcpStream::connect(("127.0.0.1", port)).is_ok());
        assert!(up, "DBHub did not listen on {port} within 300 s");
        server
    }

    /// Its endpoint, as a service's `url`.
    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}/mcp", self.port)
    }
}

impl Drop for DbhubHttp {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts container `name` (busybox, sleeping) with the MCP service `service` and the other
/// `annotations`, and returns its ID. No network: the sidecar is the host's, reached through its
/// socket, and Podman's bridge costs seconds at every create, restore, fork and removal under
/// emulation.
pub fn start_with_service(name: &str, service: &str, annotations: &[&str]) -> String {
    let service = format!("io.planarian.mcp.service={service}");
    let mut args = vec!["run", "-d", "--name", name, "--network", "none", "--annotation", &service];
    for a in annotations {
        args.extend(["--annotation", a]);
    }
    args.extend([BUSYBOX, "sleep", "600"]);
    podman("planarian", &args).ok().out()
}
