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

//!
//! This module routes messages and remaps ids; [`upstream`] is the way to the real server (a
//! child over stdio, or Streamable HTTP with messages sent in order), [`sql_calls`] the
//! interception of the SQL tool.

mod sql_calls;
mod upstream;

use crate::db::{CompensateError, Db};
use crate::http;
use crate::state::Positions;
use serde_json::{json, Value};
use std::collections::HashMap;
use std::io::{BufRead, Write};
use upstream::Upstream;
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
    /// The database to use instead of the one `dsn` names (a fork's branch); it also replaces
    /// `{dbname}` in the upstream command, its environment and its URL.
    pub dbname: Option<String>,
    pub state_file: std::path::PathBuf,
    /// The container's lock file: a mutating call holds it shared, as every tool call does, so
    /// that it waits while a snapshot or a rollback of the sandbox holds it exclusively.
    pub sandbox_lock: Option<std::path::PathBuf>,
}

impl Options {
    /// The proxy's own connection: `dsn`, with `dbname` when set.
    pub fn pg_config(&self) -> Result<postgres::Config, String> {
        let mut c: postgres::Config = self.dsn.parse().map_err(|e| format!("--database {}: {e}", self.dsn))?;
        if let Some(d) = &self.dbname {
            c.dbname(d);
        }
        Ok(c)
    }

    /// The database's name as the upstream server must be told it (`{dbname}`): libpq's
    /// default is the user's name.
    pub fn effective_dbname(&self) -> Result<String, String> {
        let c = self.pg_config()?;
        Ok(c.get_dbname().or(c.get_user()).unwrap_or("postgres").to_string())
    }
}

/// The name of the branch of database `current` for the fork `container`.
fn branch_name(current: &str, container: &str) -> String {
    let suffix: String = container.chars().filter(|c| c.is_ascii_alphanumeric()).take(12).collect();
    let prefix: String = current.chars().take(63 - 1 - suffix.len()).collect();
    format!("{prefix}_{suffix}")
}

/// The largest database a fork gets a copy of.
pub const BRANCH_MAX_BYTES: i64 = 1 << 30;

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

impl Proxy {
    /// The sandbox's lock, shared, for the length of a mutating call (taken before the proxy
    /// lock: a snapshot holds the sandbox's lock while it asks for the position under the proxy
    /// lock). `Err` with one line when the lock file cannot be used.
    fn sandbox_lock(&self) -> Result<Option<std::fs::File>, String> {
        let Some(path) = &self.opts.sandbox_lock else { return Ok(None) };
        let f = std::fs::File::options().read(true).write(true).create(true).truncate(false).open(path)
            .map_err(|e| format!("cannot open the sandbox's lock {}: {e}", path.display()))?;
        f.lock_shared().map_err(|e| format!("cannot lock {}: {e}", path.display()))?;
        Ok(Some(f))
    }

    pub fn new(opts: Options) -> Result<Arc<Proxy>, String> {
        let mut db = Db::connect(&opts.pg_config()?)?;
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
            Self::end_session(h);
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
                // A read that calls no function needs nothing of the database: straight on.
                if self.plain_read(&msg) {
                    return self.forward_request(msg, conn);
                }
                let (me, conn) = (self.clone(), conn.clone());
                // Reads must not wait behind writes: every other SQL call gets its own thread.
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

    // --- the control interface -------------------------------------------------------------

    /// The current position, taken under the proxy lock (no write is in flight).
    pub fn capture(&self) -> Result<u64, String> {
        let _guard = self.lock.lock().unwrap();
        self.positions.lock().unwrap().captured()
    }

    /// The calls after position `from` up to `to` that changed something, and the tables.
    pub fn changes(&self, from: u64, to: u64) -> Result<(u64, Vec<String>), String> {
        self.db.lock().unwrap().changes_between(from, to)
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

    /// Branches the database for the fork `container` at `position`: a copy of it as it is now,
    /// compensated on the copy back to `position` (the source is never changed). Returns the
    /// copy's name. Refused when the position can no longer be reached here, when the database
    /// is larger than BRANCH_MAX_BYTES (a logical copy takes time in proportion), or when this
    /// proxy's role cannot create databases.
    pub fn branch(&self, position: u64, container: &str) -> Result<String, String> {
        self.positions.lock().unwrap().check_reachable(position)?;
        let (current, size, major) = self.db.lock().unwrap().describe()?;
        if size > BRANCH_MAX_BYTES {
            return Err(format!(
                "the database {current} holds {} MiB; a fork gets its own copy only up to {} MiB (a logical copy)",
                size >> 20,
                BRANCH_MAX_BYTES >> 20
            ));
        }
        let name = branch_name(&current, container);
        self.db.lock().unwrap().create_database(&name)?;
        let from = self.opts.pg_config()?;
        let mut to = from.clone();
        to.dbname(&name);
        let made = (|| {
            crate::db::copy_database(&from, &to, major)?;
            let mut copy = Db::connect(&to)?;
            copy.compensate_to(position).map_err(|e| match e {
                CompensateError::Conflict(s) => format!("conflict: {s}"),
                CompensateError::Other(s) => s,
            })?;
            copy.mark_branch(position)
        })();
        if let Err(e) = made {
            let _ = self.db.lock().unwrap().drop_database(&name);
            return Err(format!("cannot branch the database {current}: {e}"));
        }
        Ok(name)
    }

    /// Drops the branch made for the fork `container` (a fork that failed after it was made);
    /// returns its name. Nothing when there is none.
    pub fn unbranch(&self, container: &str) -> Result<String, String> {
        let mut db = self.db.lock().unwrap();
        let (current, _, _) = db.describe()?;
        let name = branch_name(&current, container);
        db.drop_database(&name)?;
        Ok(name)
    }

    pub fn disable(&self, why: String) {
        *self.disabled.lock().unwrap() = Some(why);
    }

    pub fn status(&self) -> Value {
        let pos = self.positions.lock().unwrap();
        let (pid, url) = match self.upstream.lock().unwrap().as_ref() {
            Some(Upstream::Stdio(c, _)) => (Some(c.id()), None),
            Some(Upstream::Http(h)) => (None, Some(h.url.clone())),
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
