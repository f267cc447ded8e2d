//! `mcp`: the cost of the MCP state proxy. The same calls to the same real MCP server (MCP
//! Toolbox and DBHub) against the same throwaway PostgreSQL, directly and through
//! planarian-mcp-proxy, interleaved; reads (a primary-key SELECT) and writes (a primary-key
//! UPDATE, which the proxy rewrites to record its undo row in the same transaction).

use serde_json::{json, Value};
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

const PG_BIN: &str = "/usr/lib/postgresql/15/bin";

struct Pg {
    dir: PathBuf,
    port: u16,
}

fn as_postgres(program: &str, args: &[&str]) -> Result<(), String> {
    let out = Command::new("runuser").args(["-u", "postgres", "--", program]).args(args).output().map_err(|e| format!("runuser: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!("{program}: {}", String::from_utf8_lossy(&out.stderr).trim()))
    }
}

impl Pg {
    fn start() -> Result<Pg, String> {
        let dir = std::env::temp_dir().join(format!("planarian-bench-pg-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
        Command::new("chown").args(["postgres:postgres"]).arg(&dir).status().map_err(|e| e.to_string())?;
        let port = std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).map_err(|e| e.to_string())?.port();
        let d = dir.display().to_string();
        as_postgres(&format!("{PG_BIN}/initdb"), &["-D", &format!("{d}/data"), "-A", "trust", "-U", "postgres", "--no-sync"])?;
        let opts = format!("-k {d} -c listen_addresses=127.0.0.1 -p {port}");
        as_postgres(&format!("{PG_BIN}/pg_ctl"), &["-D", &format!("{d}/data"), "-w", "-l", &format!("{d}/log"), "-o", &opts, "start"])?;
        Ok(Pg { dir, port })
    }
}

impl Drop for Pg {
    fn drop(&mut self) {
        let d = self.dir.display().to_string();
        let _ = as_postgres(&format!("{PG_BIN}/pg_ctl"), &["-D", &format!("{d}/data"), "-m", "immediate", "stop"]);
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

struct Client {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
    next: u64,
}

impl Client {
    fn spawn(mut cmd: Command) -> Result<Client, String> {
        let mut child = cmd.stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::null()).spawn().map_err(|e| e.to_string())?;
        let stdin = child.stdin.take().unwrap();
        let stdout = BufReader::new(child.stdout.take().unwrap());
        let mut c = Client { child, stdin, stdout, next: 0 };
        c.request("initialize", json!({"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "bench", "version": "1"}}))?;
        writeln!(c.stdin, "{}", json!({"jsonrpc": "2.0", "method": "notifications/initialized"})).map_err(|e| e.to_string())?;
        Ok(c)
    }

    fn request(&mut self, method: &str, params: Value) -> Result<Value, String> {
        self.next += 1;
        writeln!(self.stdin, "{}", json!({"jsonrpc": "2.0", "id": self.next, "method": method, "params": params})).map_err(|e| e.to_string())?;
        self.stdin.flush().map_err(|e| e.to_string())?;
        loop {
            let mut line = String::new();
            if self.stdout.read_line(&mut line).map_err(|e| e.to_string())? == 0 {
                return Err("the MCP server closed its output".into());
            }
            let m: Value = serde_json::from_str(&line).map_err(|e| e.to_string())?;
            if m["id"] == json!(self.next) {
                return Ok(m);
            }
        }
    }

    fn sql(&mut self, sql: &str) -> Result<Duration, String> {
        let t = Instant::now();
        let r = self.request("tools/call", json!({"name": "execute_sql", "arguments": {"sql": sql}}))?;
        let d = t.elapsed();
        if r["result"]["isError"] == json!(true) || r.get("error").is_some() {
            return Err(format!("{sql}: {r}"));
        }
        Ok(d)
    }
}

impl Drop for Client {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn server_cmd(kind: &str, bin: &Path, pg: &Pg) -> Command {
    let mut c = Command::new(bin);
    if kind == "toolbox" {
        c.args(["--prebuilt", "postgres", "--stdio", "--disable-version-check"])
            .env("POSTGRES_HOST", "127.0.0.1")
            .env("POSTGRES_PORT", pg.port.to_string())
            .env("POSTGRES_DATABASE", "postgres")
            .env("POSTGRES_USER", "postgres")
            .env("POSTGRES_PASSWORD", "unused");
    } else {
        c.args(["--transport", "stdio", "--dsn", &format!("postgres://postgres@127.0.0.1:{}/postgres?sslmode=disable", pg.port)]);
    }
    c
}

fn median_p95(mut v: Vec<Duration>) -> (f64, f64) {
    v.sort();
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    (ms(v[v.len() / 2]), ms(v[(v.len() * 95 / 100).min(v.len() - 1)]))
}

pub fn main(args: &[String]) -> i32 {
    match run(args) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("planarian-bench mcp: {e}");
            1
        }
    }
}

fn run(args: &[String]) -> Result<(), String> {
    let iterations: usize = crate::flag(args, "--iterations").and_then(|s| s.parse().ok()).unwrap_or(200);
    let root = std::env::current_dir().map_err(|e| e.to_string())?;
    let npm = root.join("target/npm/node_modules/.bin");
    let proxy = crate::flag(args, "--proxy").map(PathBuf::from).unwrap_or_else(|| root.join("target/release/planarian-mcp-proxy"));
    let pg = Pg::start()?;
    let dsn = format!("host=127.0.0.1 port={} user=postgres dbname=postgres", pg.port);
    let psql = Command::new("psql")
        .args(["-X", "-q", "-h", "127.0.0.1", "-p", &pg.port.to_string(), "-U", "postgres", "-c"])
        .arg("CREATE TABLE bench (id int PRIMARY KEY, v int NOT NULL); INSERT INTO bench SELECT g, 0 FROM generate_series(1, 1000) g")
        .status()
        .map_err(|e| e.to_string())?;
    if !psql.success() {
        return Err("cannot create the benchmark table".into());
    }
    println!("MCP round trip, direct vs through planarian-mcp-proxy: {iterations} reads and {iterations} writes per server, interleaved (ms)");
    println!("| server | call | direct median | proxied median | ratio | direct p95 | proxied p95 |");
    println!("|---|---|---:|---:|---:|---:|---:|");
    for kind in ["toolbox", "dbhub"] {
        let bin = npm.join(kind);
        let mut direct = Client::spawn(server_cmd(kind, &bin, &pg))?;
        let upstream = server_cmd(kind, &bin, &pg);
        let state = std::env::temp_dir().join(format!("planarian-bench-mcp-{kind}-{}.json", std::process::id()));
        let mut pc = Command::new(&proxy);
        pc.args(["serve", "--server", kind, "--database", &dsn, "--state"]).arg(&state).arg("--").arg(upstream.get_program()).args(upstream.get_args());
        for (k, v) in upstream.get_envs() {
            if let Some(v) = v {
                pc.env(k, v);
            }
        }
        let mut proxied = Client::spawn(pc)?;
        let mut t: [[Vec<Duration>; 2]; 2] = Default::default();
        for i in 0..iterations + 10 {
            let id = i % 1000 + 1;
            let calls = [format!("SELECT v FROM bench WHERE id = {id}"), format!("UPDATE bench SET v = v + 1 WHERE id = {id}")];
            for (c, sql) in calls.iter().enumerate() {
                // Alternate which goes first, so that neither always finds the other's warm cache.
                let (a, b) = if i % 2 == 0 { (direct.sql(sql)?, proxied.sql(sql)?) } else {
                    let b = proxied.sql(sql)?;
                    (direct.sql(sql)?, b)
                };
                if i >= 10 {
                    t[c][0].push(a);
                    t[c][1].push(b);
                }
            }
        }
        for (c, name) in ["read", "write"].iter().enumerate() {
            let (dm, dp) = median_p95(t[c][0].clone());
            let (pm, pp) = median_p95(t[c][1].clone());
            println!("| {kind} | {name} | {dm:.2} | {pm:.2} | {:.2}x | {dp:.2} | {pp:.2} |", pm / dm);
        }
        let _ = std::fs::remove_file(&state);
    }
    Ok(())
}
