//! `mcp`: the cost of the MCP state proxy. The same calls to the same real MCP server (MCP
//! Toolbox and DBHub) against the same throwaway PostgreSQL, directly and through
//! planarian-mcp-proxy, interleaved; reads (a primary-key SELECT) and writes (a primary-key
//! UPDATE, which the proxy rewrites to record its undo row in the same transaction); over stdio,
//! and over Streamable HTTP (the servers' own HTTP mode; the proxy serving HTTP and reaching the
//! server by URL). Then the declared tools of the reference memory and filesystem servers
//! (hooks/specs), directly and through the proxy.

use planarian_contracts::jsonrpc;
use serde_json::{json, Value};
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

struct Pg {
    dir: PathBuf,
    port: u16,
}

fn as_postgres(program: &str, args: &[&str]) -> Result<(), String> {
    let out = Command::new("runuser")
        .args(["-u", "postgres", "--", program])
        .args(args)
        .output()
        .map_err(|e| format!("runuser: {e}"))?;
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
        let port =
            std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).map_err(|e| e.to_string())?.port();
        let d = dir.display().to_string();
        as_postgres(
            &format!("{}/initdb", crate::pg_bin()),
            &["-D", &format!("{d}/data"), "-A", "trust", "-U", "postgres", "--no-sync"],
        )?;
        let opts = format!("-k {d} -c listen_addresses=127.0.0.1 -p {port}");
        as_postgres(
            &format!("{}/pg_ctl", crate::pg_bin()),
            &["-D", &format!("{d}/data"), "-w", "-l", &format!("{d}/log"), "-o", &opts, "start"],
        )?;
        Ok(Pg { dir, port })
    }
}

impl Drop for Pg {
    fn drop(&mut self) {
        let d = self.dir.display().to_string();
        let _ = as_postgres(
            &format!("{}/pg_ctl", crate::pg_bin()),
            &["-D", &format!("{d}/data"), "-m", "immediate", "stop"],
        );
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

struct Client {
    child: Child,
    io: Io,
    next: u64,
}

enum Io {
    Stdio(ChildStdin, BufReader<ChildStdout>),
    /// Endpoint (host:port, path) and session.
    Http(String, String, Option<String>),
}

/// One POST on a fresh connection, as an MCP client library does it without keep-alive: the
/// answer with this id, from a JSON body or an event stream.
fn http_call(
    authority: &str,
    path: &str,
    session: &Option<String>,
    body: &str,
    id: &Value,
) -> Result<(Option<String>, Option<Value>), String> {
    use std::io::Read;
    let mut s = std::net::TcpStream::connect(authority).map_err(|e| format!("{authority}: {e}"))?;
    s.set_nodelay(true).map_err(|e| e.to_string())?;
    let sid = session.as_ref().map(|s| format!("Mcp-Session-Id: {s}\r\n")).unwrap_or_default();
    let req = format!(
        "POST {path} HTTP/1.1\r\nHost: {authority}\r\nConnection: close\r\nContent-Type: application/json\r\nAccept: application/json, text/event-stream\r\n{sid}Content-Length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).map_err(|e| e.to_string())?;
    // Read until the answer is complete: servers may hold an event stream open after it.
    let mut raw = Vec::new();
    let mut buf = [0u8; 16384];
    loop {
        let n = s.read(&mut buf).map_err(|e| e.to_string())?;
        raw.extend_from_slice(&buf[..n]);
        if let Some(done) = parse_answer(&String::from_utf8_lossy(&raw), id, n == 0)? {
            return Ok(done);
        }
        if n == 0 {
            return Err("the server closed the connection before answering".into());
        }
    }
}

type Answer = (Option<String>, Option<Value>);

/// The session and the answer with this id, once `text` holds them (or at the end).
fn parse_answer(text: &str, id: &Value, end: bool) -> Result<Option<Answer>, String> {
    let Some((head, rest)) = text.split_once("\r\n\r\n") else { return Ok(None) };
    if !head.starts_with("HTTP/1.1 20") {
        return Err(format!("HTTP: {}", head.lines().next().unwrap_or("")));
    }
    let header = |name: &str| {
        head.lines().find_map(|l| {
            l.split_once(':').filter(|(k, _)| k.eq_ignore_ascii_case(name)).map(|(_, v)| v.trim().to_string())
        })
    };
    let session = header("mcp-session-id");
    let mut body = String::new();
    let mut complete = end;
    if header("transfer-encoding").is_some_and(|t| t.contains("chunked")) {
        let mut r = rest;
        while let Some((size, after)) = r.split_once("\r\n") {
            let n = usize::from_str_radix(size.split(';').next().unwrap_or("").trim(), 16).map_err(|_| "bad chunk")?;
            if n == 0 {
                complete = true;
                break;
            }
            if after.len() < n {
                break;
            }
            body += &after[..n];
            r = after[n..].strip_prefix("\r\n").unwrap_or(&after[n..]);
        }
    } else {
        body = rest.to_string();
        let len = header("content-length").and_then(|l| l.parse::<usize>().ok());
        complete |= len.is_some_and(|l| rest.len() >= l) || len == Some(0);
    }
    if header("content-type").is_some_and(|t| t.starts_with("text/event-stream")) {
        let found = body
            .lines()
            .filter_map(|l| l.strip_prefix("data:"))
            .filter_map(|d| serde_json::from_str::<Value>(d.trim()).ok())
            .find(|m| m["id"] == *id);
        return Ok((found.is_some() || complete).then_some((session, found)));
    }
    if !complete {
        return Ok(None);
    }
    Ok(Some((session, serde_json::from_str::<Value>(&body).ok().filter(|m| m["id"] == *id))))
}

impl Client {
    fn spawn(mut cmd: Command) -> Result<Client, String> {
        let mut child = cmd
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| e.to_string())?;
        let stdin = child.stdin.take().unwrap();
        let stdout = BufReader::new(child.stdout.take().unwrap());
        Client { child, io: Io::Stdio(stdin, stdout), next: 0 }.initialized()
    }

    /// A server (or proxy) serving Streamable HTTP at `url` (http://host:port/path).
    fn http(child: Child, url: &str) -> Result<Client, String> {
        let rest = url.strip_prefix("http://").ok_or("not an http URL")?;
        let (authority, path) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
        Client { child, io: Io::Http(authority.into(), path.into(), None), next: 0 }.initialized()
    }

    fn initialized(mut self) -> Result<Client, String> {
        self.request("initialize", json!({"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "bench", "version": "1"}}))?;
        let note = jsonrpc::notification("notifications/initialized", Value::Null);
        match &mut self.io {
            Io::Stdio(stdin, _) => writeln!(stdin, "{note}").map_err(|e| e.to_string())?,
            Io::Http(a, p, sid) => drop(http_call(a, p, sid, &note.to_string(), &Value::Null)?),
        }
        Ok(self)
    }

    fn request(&mut self, method: &str, params: Value) -> Result<Value, String> {
        self.next += 1;
        let msg = jsonrpc::request(self.next, method, params);
        let (stdin, stdout) = match &mut self.io {
            Io::Stdio(stdin, stdout) => (stdin, stdout),
            Io::Http(a, p, sid) => {
                let (session, answer) = http_call(a, p, sid, &msg.to_string(), &msg["id"])?;
                if method == "initialize" {
                    *sid = session;
                }
                return answer.ok_or_else(|| format!("no answer to {method}"));
            }
        };
        writeln!(stdin, "{msg}").map_err(|e| e.to_string())?;
        stdin.flush().map_err(|e| e.to_string())?;
        loop {
            let mut line = String::new();
            if stdout.read_line(&mut line).map_err(|e| e.to_string())? == 0 {
                return Err("the MCP server closed its output".into());
            }
            let m: Value = serde_json::from_str(&line).map_err(|e| e.to_string())?;
            if m["id"] == json!(self.next) {
                return Ok(m);
            }
        }
    }

    fn sql(&mut self, sql: &str) -> Result<Duration, String> {
        self.call("execute_sql", json!({"sql": sql}))
    }

    /// One tool call, timed; an error answer is an error.
    fn call(&mut self, tool: &str, args: Value) -> Result<Duration, String> {
        let t = Instant::now();
        let r = self.request("tools/call", json!({"name": tool, "arguments": args.clone()}))?;
        let d = t.elapsed();
        if r["result"]["isError"] == json!(true) || r.get("error").is_some() {
            return Err(format!("{tool} {args}: {r}"));
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

/// The server over stdio, or serving Streamable HTTP on `port`.
fn server_cmd(kind: &str, bin: &Path, pg: &Pg, port: Option<u16>) -> Command {
    let mut c = Command::new(bin);
    let port = port.map(|p| p.to_string());
    if kind == "toolbox" {
        match &port {
            None => c.arg("--stdio"),
            Some(p) => c.args(["--address", "127.0.0.1", "--port", p]),
        };
        c.args(["--prebuilt", "postgres", "--disable-version-check"])
            .env("POSTGRES_HOST", "127.0.0.1")
            .env("POSTGRES_PORT", pg.port.to_string())
            .env("POSTGRES_DATABASE", "postgres")
            .env("POSTGRES_USER", "postgres")
            .env("POSTGRES_PASSWORD", "unused");
    } else {
        match &port {
            None => c.args(["--transport", "stdio"]),
            Some(p) => c.args(["--transport", "http", "--port", p]),
        };
        c.args(["--dsn", &format!("postgres://postgres@127.0.0.1:{}/postgres?sslmode=disable", pg.port)]);
    }
    c
}

/// Direct and proxied clients of one server over one transport.
fn clients(
    kind: &str,
    transport: &str,
    bin: &Path,
    pg: &Pg,
    proxy: &Path,
    dsn: &str,
    state: &Path,
) -> Result<(Client, Client), String> {
    let mut pc = Command::new(proxy);
    pc.args(["serve", "--server", kind, "--database", dsn, "--state"]).arg(state);
    if transport == "stdio" {
        let upstream = server_cmd(kind, bin, pg, None);
        pc.arg("--").arg(upstream.get_program()).args(upstream.get_args());
        for (k, v) in upstream.get_envs() {
            if let Some(v) = v {
                pc.env(k, v);
            }
        }
        return Ok((Client::spawn(server_cmd(kind, bin, pg, None))?, Client::spawn(pc)?));
    }
    let port =
        std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).map_err(|e| e.to_string())?.port();
    let server = server_cmd(kind, bin, pg, Some(port))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| e.to_string())?;
    let end = Instant::now() + Duration::from_secs(60);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        if Instant::now() > end {
            return Err(format!("{kind} did not serve HTTP on {port}"));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let url = format!("http://127.0.0.1:{port}/mcp");
    let direct = Client::http(server, &url)?;
    let mut proxy = pc
        .args(["--http", "127.0.0.1:0", "--upstream-url", &url])
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| e.to_string())?;
    let mut err = BufReader::new(proxy.stderr.take().unwrap());
    let purl = loop {
        let mut l = String::new();
        if err.read_line(&mut l).map_err(|e| e.to_string())? == 0 {
            return Err("the proxy exited".into());
        }
        if let Some(u) = l.trim().split(" at ").nth(1).filter(|u| u.starts_with("http://")) {
            break u.to_string();
        }
    };
    std::thread::spawn(move || std::io::copy(&mut err, &mut std::io::sink()));
    Ok((direct, Client::http(proxy, &purl)?))
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
    let proxy = crate::flag(args, "--proxy")
        .map(PathBuf::from)
        .unwrap_or_else(|| root.join("target/release/planarian-mcp-proxy"));
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
    println!("| server | transport | call | direct median | proxied median | ratio | direct p95 | proxied p95 |");
    println!("|---|---|---|---:|---:|---:|---:|---:|");
    for (kind, transport) in [("toolbox", "stdio"), ("toolbox", "http"), ("dbhub", "stdio"), ("dbhub", "http")] {
        let bin = npm.join(kind);
        let state =
            std::env::temp_dir().join(format!("planarian-bench-mcp-{kind}-{transport}-{}.json", std::process::id()));
        let (mut direct, mut proxied) = clients(kind, transport, &bin, &pg, &proxy, &dsn, &state)?;
        let mut t: [[Vec<Duration>; 2]; 2] = Default::default();
        for i in 0..iterations + 10 {
            let id = i % 1000 + 1;
            let calls =
                [format!("SELECT v FROM bench WHERE id = {id}"), format!("UPDATE bench SET v = v + 1 WHERE id = {id}")];
            for (c, sql) in calls.iter().enumerate() {
                // Alternate which goes first, so that neither always finds the other's warm cache.
                let (a, b) = if i % 2 == 0 {
                    (direct.sql(sql)?, proxied.sql(sql)?)
                } else {
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
            println!("| {kind} | {transport} | {name} | {dm:.2} | {pm:.2} | {:.2}x | {dp:.2} | {pp:.2} |", pm / dm);
        }
        let _ = std::fs::remove_file(&state);
    }
    declared(iterations, &npm, &proxy)
}

/// Declared tools (the specs planarian ships): the reference memory and filesystem servers,
/// each client on state of its own, directly and through the proxy (which captures, journals
/// with an fsync, and reads the check after each call).
fn declared(iterations: usize, npm: &Path, proxy: &Path) -> Result<(), String> {
    let dir = std::env::temp_dir().join(format!("planarian-bench-declared-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    type Calls = Vec<(&'static str, &'static str, fn(usize, &Path) -> Value)>;
    let servers: [(&str, &str, Calls); 2] = [
        (
            "memory",
            "mcp-server-memory",
            vec![
                (
                    "add_observations",
                    "write (result undo, check)",
                    |i, _| json!({"observations": [{"entityName": "e", "contents": [format!("o{i}")]}]}),
                ),
                (
                    "delete_observations",
                    "write (graph captured)",
                    |i, _| json!({"deletions": [{"entityName": "e", "observations": [format!("o{i}")]}]}),
                ),
                ("open_nodes", "read", |_, _| json!({"names": ["e"]})),
            ],
        ),
        (
            "filesystem",
            "mcp-server-filesystem",
            vec![
                (
                    "write_file",
                    "write (content captured)",
                    |i, d| json!({"path": d.join("f.txt"), "content": format!("v{i}\n")}),
                ),
                ("read_text_file", "read", |_, d| json!({"path": d.join("f.txt")})),
            ],
        ),
    ];
    println!();
    println!(
        "Declared tools (hooks/specs), direct vs through planarian-mcp-proxy: {iterations} rounds, interleaved (ms)"
    );
    println!("| server | tool | kind | direct median | proxied median | ratio | direct p95 | proxied p95 |");
    println!("|---|---|---|---:|---:|---:|---:|---:|");
    for (spec, bin, calls) in servers {
        let mut clients = vec![];
        for side in ["direct", "proxied"] {
            let data = dir.join(format!("{spec}-{side}"));
            std::fs::create_dir_all(&data).map_err(|e| e.to_string())?;
            std::fs::write(data.join("f.txt"), "v\n").map_err(|e| e.to_string())?;
            let mut server = Command::new(npm.join(bin));
            server.env("MEMORY_FILE_PATH", data.join("memory.jsonl"));
            if spec == "filesystem" {
                server.arg(&data);
            }
            let cmd = if side == "direct" {
                server
            } else {
                let mut c = Command::new(proxy);
                c.args(["serve", "--spec", spec, "--state"])
                    .arg(data.join("positions.json"))
                    .arg("--")
                    .arg(server.get_program())
                    .args(server.get_args());
                c.env("MEMORY_FILE_PATH", data.join("memory.jsonl"));
                c
            };
            let mut c = Client::spawn(cmd)?;
            if spec == "memory" {
                c.call("create_entities", json!({"entities": [{"name": "e", "entityType": "t", "observations": []}]}))?;
            }
            clients.push((c, data));
        }
        let mut t: Vec<[Vec<Duration>; 2]> = calls.iter().map(|_| Default::default()).collect();
        for i in 0..iterations + 10 {
            for (k, (tool, _, args)) in calls.iter().enumerate() {
                let order: [usize; 2] = if i % 2 == 0 { [0, 1] } else { [1, 0] };
                for side in order {
                    let (c, data) = &mut clients[side];
                    let d = c.call(tool, args(i, data))?;
                    if i >= 10 {
                        t[k][side].push(d);
                    }
                }
            }
        }
        for (k, (tool, kind, _)) in calls.iter().enumerate() {
            let (dm, dp) = median_p95(t[k][0].clone());
            let (pm, pp) = median_p95(t[k][1].clone());
            println!("| {spec} | {tool} | {kind} | {dm:.2} | {pm:.2} | {:.2}x | {dp:.2} | {pp:.2} |", pm / dm);
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}
