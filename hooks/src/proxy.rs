//! The transparent MCP proxy (stdio to the harness, stdio to the real server).
//!
//! Messages are raw JSON values: whatever the proxy does not need to understand passes through
//! unchanged. Every client request gets a fresh upstream id (the proxy's own requests come from
//! the same counter, so they can never collide); responses are mapped back, and
//! `notifications/cancelled` is remapped. Calls of the SQL tool are classified: reads pass
//! through at once, writes are numbered (the MCP call position), rewritten to record their undo
//! rows, and run one at a time under the proxy lock; what cannot be undone is refused with a
//! tool error before it reaches the server.

use crate::db::{CompensateError, Db};
use crate::sql::{classify, split, Class, Ddl};
use crate::state::Positions;
use serde_json::{json, Value};
use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{channel, Sender};
use std::sync::{Arc, Condvar, Mutex};

/// How the server's SQL tool takes statements and reports results.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Server {
    /// MCP Toolbox: one statement per call (a prepared statement); one text item per row.
    Toolbox,
    /// DBHub: several statements in one transaction; a JSON report echoing each statement.
    Dbhub,
}

pub struct Options {
    pub upstream: Vec<String>,
    pub server: Server,
    pub sql_tool: String,
    pub sql_arg: String,
    /// Refuse every SQL call with this reason (a fork: the database cannot branch).
    pub disabled: Option<String>,
    pub dsn: String,
    pub state_file: std::path::PathBuf,
}

/// One client stream (stdio, or a connection to the listening socket).
pub struct Conn {
    out: Mutex<Box<dyn Write + Send>>,
}

impl Conn {
    pub fn new(out: Box<dyn Write + Send>) -> Arc<Conn> {
        Arc::new(Conn { out: Mutex::new(out) })
    }

    /// One message, one write: the line is built first (serializing straight into a socket
    /// costs a system call per token).
    fn send(&self, msg: &Value) {
        let Ok(mut line) = serde_json::to_vec(msg) else { return };
        line.push(b'\n');
        let mut out = self.out.lock().unwrap();
        let _ = out.write_all(&line);
        let _ = out.flush();
    }
}

enum Pending {
    Client(Value, Arc<Conn>),
    Own(Sender<Value>),
}

pub struct Proxy {
    opts: Options,
    /// Where the server's own requests and notifications go: the client heard from last.
    last_client: Mutex<Option<Arc<Conn>>>,
    upstream: Mutex<Option<(Child, ChildStdin)>>,
    /// Set while the upstream is being (re)started.
    generation: (Mutex<u64>, Condvar),
    pending: Mutex<HashMap<u64, Pending>>,
    next_id: AtomicU64,
    /// The proxy lock: held by a mutating call from before its position is taken until its
    /// response arrives, and by captures and compensations.
    lock: Mutex<()>,
    positions: Mutex<Positions>,
    db: Mutex<Db>,
    disabled: Mutex<Option<String>>,
    initialize: Mutex<Option<Value>>,
    closing: AtomicBool,
}

/// DBHub echoes each statement and its row count: put back the agent's own statements, and the
/// count a statement without RETURNING reports (the rewrite returned one empty row per change).
fn dbhub_as_original(result: &mut Value, texts: &[String], no_returning: &[usize]) {
    let Some(text) = result["content"][0]["text"].as_str() else { return };
    let Ok(mut report) = serde_json::from_str::<Value>(text) else { return };
    let Some(stmts) = report["data"]["statements"].as_array_mut() else { return };
    if stmts.len() != texts.len() {
        return;
    }
    for (i, st) in stmts.iter_mut().enumerate() {
        st["sql"] = json!(texts[i]);
        if no_returning.contains(&i) {
            let n = st["rows"].as_array().map_or(0, Vec::len);
            st["rows"] = json!([]);
            st["count"] = json!(n);
        }
    }
    if let Ok(t) = serde_json::to_string_pretty(&report) {
        result["content"][0]["text"] = json!(t);
    }
}

fn tool_error(text: String) -> Value {
    json!({"content": [{"type": "text", "text": text}], "isError": true})
}

impl Proxy {
    pub fn new(opts: Options) -> Result<Arc<Proxy>, String> {
        let mut db = Db::connect(&opts.dsn)?;
        let positions = Positions::load(&opts.state_file, db.max_position()?)?;
        let p = Arc::new(Proxy {
            last_client: Mutex::new(None),
            upstream: Mutex::new(None),
            generation: (Mutex::new(0), Condvar::new()),
            pending: Mutex::new(HashMap::new()),
            next_id: AtomicU64::new(1),
            lock: Mutex::new(()),
            positions: Mutex::new(positions),
            db: Mutex::new(db),
            disabled: Mutex::new(opts.disabled.clone()),
            initialize: Mutex::new(None),
            closing: AtomicBool::new(false),
            opts,
        });
        p.start_upstream()?;
        Ok(p)
    }

    fn start_upstream(self: &Arc<Self>) -> Result<(), String> {
        let (prog, args) = self.opts.upstream.split_first().ok_or("no upstream MCP server command")?;
        let mut cmd = Command::new(prog);
        // The server dies with the proxy, however the proxy ends.
        // SAFETY: only prctl(2), async-signal-safe, runs between fork and exec.
        unsafe {
            use std::os::unix::process::CommandExt;
            cmd.pre_exec(|| {
                nix::sys::prctl::set_pdeathsig(nix::sys::signal::Signal::SIGTERM).map_err(std::io::Error::from)
            });
        }
        let mut child = cmd
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(|e| format!("cannot start the upstream MCP server {prog}: {e}"))?;
        let stdin = child.stdin.take().expect("piped");
        let stdout = child.stdout.take().expect("piped");
        *self.upstream.lock().unwrap() = Some((child, stdin));
        let gen = {
            let mut g = self.generation.0.lock().unwrap();
            *g += 1;
            *g
        };
        let me = self.clone();
        std::thread::spawn(move || me.read_upstream(BufReader::new(stdout), gen));
        Ok(())
    }

    fn send_upstream(&self, msg: &Value) -> Result<(), String> {
        let mut up = self.upstream.lock().unwrap();
        let Some((_, stdin)) = up.as_mut() else { return Err("the upstream MCP server is not running".into()) };
        let mut line = serde_json::to_vec(msg).map_err(|e| e.to_string())?;
        line.push(b'\n');
        stdin.write_all(&line).and_then(|_| stdin.flush()).map_err(|e| format!("the upstream MCP server is gone: {e}"))
    }

    fn send_client(&self, msg: &Value) {
        let conn = self.last_client.lock().unwrap().clone();
        if let Some(c) = conn {
            c.send(msg);
        }
    }

    fn reply(conn: &Conn, id: &Value, result: Value) {
        conn.send(&json!({"jsonrpc": "2.0", "id": id, "result": result}));
    }

    fn reply_error(conn: &Conn, id: &Value, code: i64, message: &str) {
        conn.send(&json!({"jsonrpc": "2.0", "id": id, "error": {"code": code, "message": message}}));
    }

    /// Forwards a client request under a fresh upstream id.
    fn forward_request(&self, mut msg: Value, conn: &Arc<Conn>) {
        let id = self.next_id.fetch_add(1, Ordering::SeqCst);
        let orig = std::mem::replace(&mut msg["id"], json!(id));
        self.pending.lock().unwrap().insert(id, Pending::Client(orig.clone(), conn.clone()));
        if let Err(e) = self.send_upstream(&msg) {
            self.pending.lock().unwrap().remove(&id);
            Self::reply_error(conn, &orig, -32603, &e);
        }
    }

    /// Sends a request of the proxy's own (or a rewritten client call) and waits for its response.
    fn call_upstream(&self, method: &str, params: Value) -> Result<Value, String> {
        let id = self.next_id.fetch_add(1, Ordering::SeqCst);
        let (tx, rx) = channel();
        self.pending.lock().unwrap().insert(id, Pending::Own(tx));
        if let Err(e) = self.send_upstream(&json!({"jsonrpc": "2.0", "id": id, "method": method, "params": params})) {
            self.pending.lock().unwrap().remove(&id);
            return Err(e);
        }
        rx.recv().map_err(|_| "the upstream MCP server exited before answering".to_string())
    }

    fn read_upstream(self: Arc<Self>, reader: BufReader<std::process::ChildStdout>, gen: u64) {
        for line in reader.lines() {
            let Ok(line) = line else { break };
            if line.trim().is_empty() {
                continue;
            }
            let Ok(mut msg) = serde_json::from_str::<Value>(&line) else {
                eprintln!("planarian-mcp-proxy: upstream sent a line that is not JSON; dropped");
                continue;
            };
            let is_response = msg.get("method").is_none() && msg.get("id").is_some();
            if !is_response {
                // Server-to-client requests and notifications pass through unchanged.
                self.send_client(&msg);
                continue;
            }
            let Some(id) = msg["id"].as_u64() else { continue };
            match self.pending.lock().unwrap().remove(&id) {
                Some(Pending::Client(orig, conn)) => {
                    msg["id"] = orig;
                    conn.send(&msg);
                }
                Some(Pending::Own(tx)) => {
                    let _ = tx.send(msg);
                }
                None => {}
            }
        }
        self.upstream_lost(gen);
    }

    /// The upstream exited: fail what was in flight, start it again and re-initialize it.
    fn upstream_lost(self: &Arc<Self>, gen: u64) {
        if self.closing.load(Ordering::SeqCst) || *self.generation.0.lock().unwrap() != gen {
            return;
        }
        if let Some((mut child, _)) = self.upstream.lock().unwrap().take() {
            let _ = child.wait();
        }
        let lost: Vec<Pending> = self.pending.lock().unwrap().drain().map(|(_, p)| p).collect();
        for p in lost {
            match p {
                Pending::Client(orig, conn) => {
                    Self::reply_error(&conn, &orig, -32603, "the upstream MCP server exited during the call; it has been restarted: retry")
                }
                Pending::Own(tx) => drop(tx),
            }
        }
        eprintln!("planarian-mcp-proxy: the upstream MCP server exited; restarting it");
        if let Err(e) = self.start_upstream() {
            eprintln!("planarian-mcp-proxy: {e}");
            return;
        }
        let init = self.initialize.lock().unwrap().clone();
        if let Some(params) = init {
            match self.call_upstream("initialize", params) {
                Ok(_) => {
                    let _ = self.send_upstream(&json!({"jsonrpc": "2.0", "method": "notifications/initialized"}));
                }
                Err(e) => eprintln!("planarian-mcp-proxy: cannot re-initialize the upstream: {e}"),
            }
        }
    }

    /// Serves one client stream until it ends.
    pub fn serve(self: &Arc<Self>, input: impl BufRead, conn: Arc<Conn>) {
        for line in input.lines() {
            let Ok(line) = line else { break };
            if line.trim().is_empty() {
                continue;
            }
            *self.last_client.lock().unwrap() = Some(conn.clone());
            match serde_json::from_str::<Value>(&line) {
                Ok(Value::Array(batch)) => batch.into_iter().for_each(|m| self.from_client(m, &conn)),
                Ok(m) => self.from_client(m, &conn),
                Err(e) => Self::reply_error(&conn, &Value::Null, -32700, &format!("parse error: {e}")),
            }
        }
    }

    pub fn shutdown(&self) {
        self.closing.store(true, Ordering::SeqCst);
        if let Some((mut child, stdin)) = self.upstream.lock().unwrap().take() {
            drop(stdin);
            let end = std::time::Instant::now() + std::time::Duration::from_secs(3);
            while std::time::Instant::now() < end {
                if let Ok(Some(_)) = child.try_wait() {
                    return;
                }
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    fn from_client(self: &Arc<Self>, mut msg: Value, conn: &Arc<Conn>) {
        let method = msg.get("method").and_then(Value::as_str).map(String::from);
        let has_id = msg.get("id").is_some_and(|v| !v.is_null());
        match (method.as_deref(), has_id) {
            (Some("initialize"), true) => {
                *self.initialize.lock().unwrap() = Some(msg["params"].clone());
                self.forward_request(msg, conn);
            }
            (Some("tools/call"), true) if msg["params"]["name"].as_str() == Some(&self.opts.sql_tool) => {
                let (me, conn) = (self.clone(), conn.clone());
                // Reads must not wait behind writes: every SQL call gets its own thread.
                std::thread::spawn(move || me.sql_call(msg, &conn));
            }
            (Some(_), true) => self.forward_request(msg, conn),
            (Some("notifications/cancelled"), false) => {
                let orig = msg["params"]["requestId"].clone();
                let up = self
                    .pending
                    .lock()
                    .unwrap()
                    .iter()
                    .find_map(|(k, p)| matches!(p, Pending::Client(o, c) if *o == orig && Arc::ptr_eq(c, conn)).then_some(*k));
                if let Some(up) = up {
                    msg["params"]["requestId"] = json!(up);
                    let _ = self.send_upstream(&msg);
                }
            }
            // Other notifications, and responses to the server's own requests: unchanged.
            _ => {
                let _ = self.send_upstream(&msg);
            }
        }
    }

    fn sql_call(self: Arc<Self>, mut msg: Value, conn: &Arc<Conn>) {
        let id = msg["id"].clone();
        let Some(sql) = msg["params"]["arguments"][&self.opts.sql_arg].as_str().map(String::from) else {
            return self.forward_request(msg, conn);
        };
        let refuse = |why: String| Self::reply(conn, &id, tool_error(format!("planarian: not executed: {why}")));
        if let Some(why) = self.disabled.lock().unwrap().clone() {
            return refuse(why);
        }
        let texts = match self.opts.server {
            Server::Toolbox => vec![sql.clone()],
            Server::Dbhub => match split(&sql) {
                Ok(t) if !t.is_empty() => t,
                Ok(_) => vec![sql.clone()],
                Err(e) => return refuse(e),
            },
        };
        let mut functions = Vec::new();
        let mut writes = Vec::new();
        for (i, text) in texts.iter().enumerate() {
            match classify(text) {
                Class::Ddl(d) if texts.len() == 1 => return self.ddl_call(msg, conn, d),
                Class::Ddl(_) => return refuse(format!("statement {} ({text}): send DDL as a call of its own", i + 1)),
                Class::Reject(why) if texts.len() > 1 => return refuse(format!("statement {} ({text}): {why}", i + 1)),
                Class::Reject(why) => return refuse(why),
                Class::ReadOnly { functions: f } => functions.extend(f),
                Class::Write(d) => {
                    functions.extend(d.functions.iter().cloned());
                    writes.push((i, d));
                }
            }
        }
        if writes.is_empty() {
            return match self.db.lock().unwrap().unsafe_functions(&functions) {
                Ok(bad) if bad.is_empty() => self.forward_request(msg, conn),
                Ok(bad) => refuse(format!("the statement calls {}, which may change the database in ways that cannot be undone", bad.join(", "))),
                Err(e) => refuse(format!("cannot check the statement: {e}")),
            };
        }
        let _guard = self.lock.lock().unwrap();
        let mut tables = Vec::new();
        {
            let mut db = self.db.lock().unwrap();
            match db.unsafe_functions(&functions) {
                Ok(bad) if bad.is_empty() => {}
                Ok(bad) => return refuse(format!("the statement calls {}, whose effects cannot be undone", bad.join(", "))),
                Err(e) => return refuse(format!("cannot check the statement: {e}")),
            }
            for (_, d) in &writes {
                match db.table_info(&d.table_name()) {
                    // A statement that cannot be rewritten is refused without taking a position.
                    Ok(t) => match d.rewrite(&t, 0, 0, false) {
                        Ok(_) => tables.push(t),
                        Err(e) => return refuse(e),
                    },
                    // Unknown tables and the like: the server gives its own error, nothing changes.
                    Err(e) if e.ends_with("does not exist") => {
                        drop(db);
                        return self.forward_request(msg, conn);
                    }
                    Err(e) => return refuse(e),
                }
            }
        }
        let position = match self.positions.lock().unwrap().next() {
            Ok(p) => p,
            Err(e) => return refuse(e),
        };
        let count_rows = self.opts.server == Server::Dbhub;
        let mut sent = texts.clone();
        for ((i, d), t) in writes.iter().zip(&tables) {
            match d.rewrite(t, position, *i, count_rows) {
                Ok(r) => sent[*i] = r,
                Err(e) => return refuse(e),
            }
        }
        msg["params"]["arguments"][&self.opts.sql_arg] = json!(sent.join(";\n"));
        match self.call_upstream("tools/call", msg["params"].clone()) {
            Ok(mut resp) => {
                if self.opts.server == Server::Dbhub {
                    let no_returning: Vec<usize> = writes.iter().filter(|(_, d)| !d.has_returning()).map(|(i, _)| *i).collect();
                    dbhub_as_original(&mut resp["result"], &texts, &no_returning);
                }
                resp["id"] = id;
                conn.send(&resp);
            }
            Err(e) => Self::reply_error(conn, &id, -32603, &e),
        }
    }

    /// DDL: its inverse is recorded (its own transaction) before it runs, and forgotten if it
    /// fails.
    fn ddl_call(self: &Arc<Self>, msg: Value, conn: &Arc<Conn>, d: Ddl) {
        let id = msg["id"].clone();
        let refuse = |why: String| Self::reply(conn, &id, tool_error(format!("planarian: not executed: {why}")));
        let _guard = self.lock.lock().unwrap();
        let inverse = match self.db.lock().unwrap().ddl_inverse(&d) {
            Ok(Some(inv)) => inv,
            // Creates nothing: pass through, no position.
            Ok(None) => return self.forward_request(msg, conn),
            Err(e) => return refuse(e),
        };
        let position = match self.positions.lock().unwrap().next() {
            Ok(p) => p,
            Err(e) => return refuse(e),
        };
        if let Err(e) = self.db.lock().unwrap().record_ddl(position, &format!("{:?}", d.object), &inverse) {
            return refuse(format!("cannot record the statement's inverse: {e}"));
        }
        match self.call_upstream("tools/call", msg["params"].clone()) {
            Ok(mut resp) => {
                if resp.get("error").is_some() || resp["result"]["isError"] == json!(true) {
                    let _ = self.db.lock().unwrap().forget(position);
                }
                resp["id"] = id;
                conn.send(&resp);
            }
            Err(e) => Self::reply_error(conn, &id, -32603, &e),
        }
    }

    // --- the control interface -------------------------------------------------------------

    /// The current position, taken under the proxy lock (no write is in flight).
    pub fn capture(&self) -> u64 {
        let _guard = self.lock.lock().unwrap();
        self.positions.lock().unwrap().current
    }

    pub fn compensate(&self, to: u64) -> Result<u64, String> {
        let _guard = self.lock.lock().unwrap();
        let mut pos = self.positions.lock().unwrap();
        pos.check_reachable(to)?;
        let undone = self.db.lock().unwrap().compensate_to(to).map_err(|e| match e {
            CompensateError::Conflict(s) => format!("conflict: {s}"),
            CompensateError::Other(s) => s,
        })?;
        pos.compensated(to)?;
        Ok(undone)
    }

    pub fn disable(&self, why: String) {
        *self.disabled.lock().unwrap() = Some(why);
    }

    pub fn status(&self) -> Value {
        let pos = self.positions.lock().unwrap();
        let pid = self.upstream.lock().unwrap().as_ref().map(|(c, _)| c.id());
        json!({
            "position": pos.current,
            "last": pos.last,
            "compensations": pos.events.len(),
            "disabled": *self.disabled.lock().unwrap(),
            "upstream-pid": pid,
        })
    }
}
