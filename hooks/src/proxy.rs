//! The transparent MCP proxy: to the harness over stdio, a Unix socket or Streamable HTTP
//! (httpd.rs); to the real server over stdio or Streamable HTTP.
//!
//! Messages are raw JSON values: whatever the proxy does not need to understand passes through
//! unchanged. Every client request gets a fresh upstream id (the proxy's own requests come from
//! the same counter, so they can never collide); responses are mapped back, and
//! `notifications/cancelled` is remapped. Calls of the SQL tool are classified: reads pass
//! through at once, writes are numbered (the MCP call position), rewritten to record their undo
//! rows, and run one at a time under the proxy lock; what cannot be undone is refused with a
//! tool error before it reaches the server.

use crate::db::{CompensateError, Db};
use crate::http;
use crate::sql::{classify, split, Class, Ddl};
use crate::state::Positions;
use serde_json::{json, Value};
use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
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
    /// The real server, spawned over stdio …
    pub upstream: Vec<String>,
    /// … or reached over Streamable HTTP.
    pub upstream_url: Option<http::Url>,
    pub server: Server,
    pub sql_tool: String,
    pub sql_arg: String,
    /// Refuse every SQL call with this reason (a fork: the database cannot branch).
    pub disabled: Option<String>,
    pub dsn: String,
    pub state_file: std::path::PathBuf,
}

/// Where messages for a client go: a stream (stdio, a connection to the listening socket), or
/// one HTTP exchange of a Streamable HTTP session.
pub struct Conn {
    out: Out,
    /// Which client this is: the requests a `notifications/cancelled` may name are its own,
    /// and the exchanges of one HTTP session are one client.
    client: String,
}

enum Out {
    Stream(Mutex<Box<dyn Write + Send>>),
    Channel(Mutex<Sender<Value>>),
}

impl Conn {
    pub fn new(out: Box<dyn Write + Send>) -> Arc<Conn> {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        Arc::new(Conn { out: Out::Stream(Mutex::new(out)), client: format!("stream-{}", NEXT.fetch_add(1, Ordering::Relaxed)) })
    }

    /// A connection whose messages are received from the channel (by an HTTP exchange).
    pub fn channel(client: String) -> (Arc<Conn>, Receiver<Value>) {
        let (tx, rx) = channel();
        (Arc::new(Conn { out: Out::Channel(Mutex::new(tx)), client }), rx)
    }

    /// One message, one write: the line is built first (serializing straight into a socket
    /// costs a system call per token). False when the client is gone.
    fn send(&self, msg: &Value) -> bool {
        match &self.out {
            Out::Stream(out) => {
                let Ok(mut line) = serde_json::to_vec(msg) else { return false };
                line.push(b'\n');
                let mut out = out.lock().unwrap();
                out.write_all(&line).and_then(|_| out.flush()).is_ok()
            }
            Out::Channel(tx) => tx.lock().unwrap().send(msg.clone()).is_ok(),
        }
    }
}

enum Upstream {
    Stdio(Child, ChildStdin),
    Http(Arc<HttpUpstream>),
}

/// The real server over Streamable HTTP: its session and negotiated protocol version.
struct HttpUpstream {
    url: http::Url,
    session: Mutex<Option<String>>,
    version: Mutex<Option<String>>,
    /// Held while a lost session is re-established.
    reinit: Mutex<()>,
}

enum Pending {
    Client(Value, Arc<Conn>),
    Own(Sender<Value>),
}

pub struct Proxy {
    opts: Options,
    /// Where the server's own requests and notifications go: the client heard from last …
    last_client: Mutex<Option<Arc<Conn>>>,
    /// … or, when that exchange is over, the latest standing HTTP event stream (GET).
    standing: Mutex<Option<Arc<Conn>>>,
    upstream: Mutex<Option<Upstream>>,
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
            standing: Mutex::new(None),
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
        if let Some(url) = &self.opts.upstream_url {
            let h = HttpUpstream { url: url.clone(), session: Mutex::new(None), version: Mutex::new(None), reinit: Mutex::new(()) };
            *self.upstream.lock().unwrap() = Some(Upstream::Http(Arc::new(h)));
            return Ok(());
        }
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
        *self.upstream.lock().unwrap() = Some(Upstream::Stdio(child, stdin));
        let gen = {
            let mut g = self.generation.0.lock().unwrap();
            *g += 1;
            *g
        };
        let me = self.clone();
        std::thread::spawn(move || me.read_upstream(BufReader::new(stdout), gen));
        Ok(())
    }

    fn send_upstream(self: &Arc<Self>, msg: &Value) -> Result<(), String> {
        let mut up = self.upstream.lock().unwrap();
        match up.as_mut() {
            None => Err("the upstream MCP server is not running".into()),
            Some(Upstream::Stdio(_, stdin)) => {
                let mut line = serde_json::to_vec(msg).map_err(|e| e.to_string())?;
                line.push(b'\n');
                stdin.write_all(&line).and_then(|_| stdin.flush()).map_err(|e| format!("the upstream MCP server is gone: {e}"))
            }
            Some(Upstream::Http(h)) => {
                // Each message is its own POST; what comes back (a response, or an event stream
                // with the server's notifications and requests before it) is read as it comes.
                let (me, h, msg) = (self.clone(), h.clone(), msg.clone());
                std::thread::spawn(move || {
                    if let Err(e) = me.http_exchange(&h, &msg) {
                        match (msg.get("method").is_some(), msg.get("id").filter(|i| !i.is_null())) {
                            (true, Some(id)) => me.on_upstream_message(json!({"jsonrpc": "2.0", "id": id, "error": {"code": -32603, "message": e}})),
                            _ => eprintln!("planarian-mcp-proxy: {e}"),
                        }
                    }
                });
                Ok(())
            }
        }
    }

    fn http_headers<'a>(session: &'a Option<String>, version: &'a Option<String>) -> Vec<(&'a str, &'a str)> {
        let mut headers = vec![("Content-Type", "application/json"), ("Accept", "application/json, text/event-stream")];
        if let Some(s) = session {
            headers.push(("Mcp-Session-Id", s));
        }
        if let Some(v) = version {
            headers.push(("MCP-Protocol-Version", v));
        }
        headers
    }

    /// Reads the messages of a response (one JSON body, or an event stream) and hands each to
    /// `f`; an event stream is left once the response to `until` has arrived.
    fn each_message(resp: http::Response, until: Option<&Value>, mut f: impl FnMut(Value)) -> Result<(), String> {
        let done = |m: &Value| until.is_some_and(|id| m.get("method").is_none() && m.get("id") == Some(id));
        if resp.is_events() {
            let mut events = http::Events::new(resp.body);
            while let Some(data) = events.next_data().map_err(|e| format!("the upstream MCP server's event stream broke: {e}"))? {
                let msgs = match serde_json::from_str::<Value>(&data) {
                    Ok(Value::Array(a)) => a,
                    Ok(m) => vec![m],
                    Err(_) => continue,
                };
                let mut finished = false;
                for m in msgs {
                    finished |= done(&m);
                    f(m);
                }
                if finished {
                    break;
                }
            }
            return Ok(());
        }
        let text = resp.text().map_err(|e| format!("cannot read the upstream MCP server's response: {e}"))?;
        match serde_json::from_str::<Value>(&text) {
            Ok(Value::Array(a)) => a.into_iter().for_each(f),
            Ok(m) => f(m),
            Err(e) => return Err(format!("the upstream MCP server's response is not JSON: {e}")),
        }
        Ok(())
    }

    /// The server's standing event stream (GET) for this session: its messages outside any
    /// call. Servers that offer none answer 405; the stream ends with its session.
    fn listen_upstream(self: &Arc<Self>, h: Arc<HttpUpstream>) {
        let me = self.clone();
        std::thread::spawn(move || {
            let session = h.session.lock().unwrap().clone();
            let version = h.version.lock().unwrap().clone();
            let mut headers = Self::http_headers(&session, &version);
            headers.retain(|(k, _)| *k != "Content-Type");
            headers[0] = ("Accept", "text/event-stream");
            let Ok(resp) = http::send(&h.url, "GET", &headers, b"") else { return };
            if resp.status != 200 || !resp.is_events() {
                return;
            }
            let mut events = http::Events::new(resp.body);
            while let Ok(Some(data)) = events.next_data() {
                if *h.session.lock().unwrap() != session {
                    return;
                }
                if let Ok(m) = serde_json::from_str::<Value>(&data) {
                    me.on_upstream_message(m);
                }
            }
        });
    }

    fn http_exchange(self: &Arc<Self>, h: &Arc<HttpUpstream>, msg: &Value) -> Result<(), String> {
        let body = serde_json::to_vec(msg).map_err(|e| e.to_string())?;
        let is_init = msg["method"] == "initialize";
        let request_id = msg.get("method").and(msg.get("id")).filter(|i| !i.is_null());
        for attempt in 0..2 {
            let (session, version) = if is_init { (None, None) } else { (h.session.lock().unwrap().clone(), h.version.lock().unwrap().clone()) };
            let resp = http::send(&h.url, "POST", &Self::http_headers(&session, &version), &body)
                .map_err(|e| format!("cannot reach the upstream MCP server at http://{}{}: {e}", h.url.authority, h.url.path))?;
            match resp.status {
                200 => {
                    if is_init {
                        *h.session.lock().unwrap() = resp.header("mcp-session-id").map(String::from);
                    }
                    return Self::each_message(resp, request_id, |m| {
                        if is_init && Some(&m["id"]) == request_id {
                            let version = m["result"]["protocolVersion"].as_str().map(String::from);
                            eprintln!(
                                "planarian-mcp-proxy: upstream session {} (protocol {})",
                                h.session.lock().unwrap().as_deref().unwrap_or("none: the server keeps no sessions"),
                                version.as_deref().unwrap_or("?")
                            );
                            *h.version.lock().unwrap() = version;
                            self.listen_upstream(h.clone());
                        }
                        self.on_upstream_message(m)
                    });
                }
                202 | 204 => return Ok(()),
                // The server forgot the session (restarted, expired): a new one, then once more.
                404 if session.is_some() && attempt == 0 => self.reestablish(h, &session)?,
                status => {
                    let text = resp.text().unwrap_or_default();
                    let text: String = text.trim().chars().take(300).collect();
                    return Err(format!("the upstream MCP server answered HTTP {status}: {text}"));
                }
            }
        }
        Err("the upstream MCP server lost the session again right after it was re-established".into())
    }

    /// A new upstream session, initialized with the harness's own parameters.
    fn reestablish(self: &Arc<Self>, h: &Arc<HttpUpstream>, lost: &Option<String>) -> Result<(), String> {
        let _one = h.reinit.lock().unwrap();
        if *h.session.lock().unwrap() != *lost {
            return Ok(()); // another call did it meanwhile
        }
        *h.session.lock().unwrap() = None;
        let Some(params) = self.initialize.lock().unwrap().clone() else { return Ok(()) };
        eprintln!("planarian-mcp-proxy: the upstream MCP server lost the session; starting a new one");
        let id = json!(self.next_id.fetch_add(1, Ordering::SeqCst));
        let init = json!({"jsonrpc": "2.0", "id": id, "method": "initialize", "params": params});
        let fail = |e: String| format!("cannot re-establish the upstream MCP session: {e}");
        let resp = http::send(&h.url, "POST", &Self::http_headers(&None, &None), init.to_string().as_bytes()).map_err(|e| fail(e.to_string()))?;
        if resp.status != 200 {
            return Err(fail(format!("HTTP {}", resp.status)));
        }
        let session = resp.header("mcp-session-id").map(String::from);
        let mut version = None;
        Self::each_message(resp, Some(&id), |m| {
            if m["id"] == id {
                version = m["result"]["protocolVersion"].as_str().map(String::from);
            }
        })
        .map_err(fail)?;
        let note = json!({"jsonrpc": "2.0", "method": "notifications/initialized"}).to_string();
        http::send(&h.url, "POST", &Self::http_headers(&session, &version), note.as_bytes()).map_err(|e| fail(e.to_string()))?;
        *h.session.lock().unwrap() = session;
        *h.version.lock().unwrap() = version;
        self.listen_upstream(h.clone());
        Ok(())
    }

    fn send_client(&self, msg: &Value) {
        let conn = self.last_client.lock().unwrap().clone();
        if conn.is_some_and(|c| c.send(msg)) {
            return;
        }
        let standing = self.standing.lock().unwrap().clone();
        if let Some(c) = standing {
            c.send(msg);
        }
    }

    /// An HTTP client's standing event stream (GET): the server's messages outside any call.
    pub fn set_standing(&self, conn: Arc<Conn>) {
        *self.standing.lock().unwrap() = Some(conn);
    }

    fn reply(conn: &Conn, id: &Value, result: Value) {
        conn.send(&json!({"jsonrpc": "2.0", "id": id, "result": result}));
    }

    fn reply_error(conn: &Conn, id: &Value, code: i64, message: &str) {
        conn.send(&json!({"jsonrpc": "2.0", "id": id, "error": {"code": code, "message": message}}));
    }

    /// Forwards a client request under a fresh upstream id.
    fn forward_request(self: &Arc<Self>, mut msg: Value, conn: &Arc<Conn>) {
        let id = self.next_id.fetch_add(1, Ordering::SeqCst);
        let orig = std::mem::replace(&mut msg["id"], json!(id));
        self.pending.lock().unwrap().insert(id, Pending::Client(orig.clone(), conn.clone()));
        if let Err(e) = self.send_upstream(&msg) {
            self.pending.lock().unwrap().remove(&id);
            Self::reply_error(conn, &orig, -32603, &e);
        }
    }

    /// Sends a request of the proxy's own (or a rewritten client call) and waits for its response.
    fn call_upstream(self: &Arc<Self>, method: &str, params: Value) -> Result<Value, String> {
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
            match serde_json::from_str::<Value>(&line) {
                Ok(Value::Array(batch)) => batch.into_iter().for_each(|m| self.on_upstream_message(m)),
                Ok(msg) => self.on_upstream_message(msg),
                Err(_) => eprintln!("planarian-mcp-proxy: upstream sent a line that is not JSON; dropped"),
            }
        }
        self.upstream_lost(gen);
    }

    fn on_upstream_message(&self, mut msg: Value) {
        let is_response = msg.get("method").is_none() && msg.get("id").is_some();
        if !is_response {
            // Server-to-client requests and notifications pass through unchanged.
            return self.send_client(&msg);
        }
        let Some(id) = msg["id"].as_u64() else { return };
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

    /// The upstream exited: fail what was in flight, start it again and re-initialize it.
    fn upstream_lost(self: &Arc<Self>, gen: u64) {
        if self.closing.load(Ordering::SeqCst) || *self.generation.0.lock().unwrap() != gen {
            return;
        }
        if let Some(Upstream::Stdio(mut child, _)) = self.upstream.lock().unwrap().take() {
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
            match serde_json::from_str::<Value>(&line) {
                Ok(Value::Array(batch)) => batch.into_iter().for_each(|m| self.handle(m, &conn)),
                Ok(m) => self.handle(m, &conn),
                Err(e) => Self::reply_error(&conn, &Value::Null, -32700, &format!("parse error: {e}")),
            }
        }
    }

    /// One message from a client.
    pub fn handle(self: &Arc<Self>, msg: Value, conn: &Arc<Conn>) {
        if msg.get("method").is_some() && msg.get("id").is_some_and(|i| !i.is_null()) {
            *self.last_client.lock().unwrap() = Some(conn.clone());
        }
        self.from_client(msg, conn);
    }

    pub fn shutdown(&self) {
        self.closing.store(true, Ordering::SeqCst);
        let up = self.upstream.lock().unwrap().take();
        if let Some(Upstream::Http(h)) = &up {
            // Ends the session (servers may refuse: 405).
            if let Some(s) = h.session.lock().unwrap().clone() {
                let _ = http::send(&h.url, "DELETE", &[("Mcp-Session-Id", &s)], b"");
            }
        }
        if let Some(Upstream::Stdio(mut child, stdin)) = up {
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
                    .find_map(|(k, p)| matches!(p, Pending::Client(o, c) if *o == orig && c.client == conn.client).then_some(*k));
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
        let position = self.positions.lock().unwrap().next();
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
        let position = self.positions.lock().unwrap().next();
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
    pub fn capture(&self) -> Result<u64, String> {
        let _guard = self.lock.lock().unwrap();
        self.positions.lock().unwrap().captured()
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
        let (pid, url) = match self.upstream.lock().unwrap().as_ref() {
            Some(Upstream::Stdio(c, _)) => (Some(c.id()), None),
            Some(Upstream::Http(h)) => (None, Some(format!("http://{}{}", h.url.authority, h.url.path))),
            None => (None, None),
        };
        json!({
            "upstream-url": url,
            "position": pos.current,
            "last": pos.last,
            "compensations": pos.events.len(),
            "disabled": *self.disabled.lock().unwrap(),
            "upstream-pid": pid,
        })
    }
}
