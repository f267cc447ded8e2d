//! The way to the real MCP server: a child process over stdio (restarted, and re-initialized
//! with the harness's own parameters, when it exits), or Streamable HTTP.
//!
//! Over HTTP every message is a POST of its own, and they go out **in the order they came**:
//! one thread sends them, each once the server has answered the previous one's headers (it has
//! taken the message: a notification is accepted, a request has started), so
//! `notifications/initialized` never overtakes the request after it, nor `notifications/cancelled`
//! the request it cancels. What a request's response carries (a JSON body, or an event stream of
//! the server's notifications and requests before the response) is read on a thread of its own,
//! so a long call never holds up the messages after it. (A server that answers a call's headers
//! only when the call is done hears a cancellation of it only then.)

use super::{Pending, Proxy};
use crate::error::{Error, Result};
use crate::http;
use planarian_contracts::jsonrpc;
use serde_json::{json, Value};
use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::atomic::Ordering;
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex};

/// The most of a JSON response body read (an event stream is read event by event).
const MAX_BODY: u64 = 16 << 20;

pub(super) enum Upstream {
    Stdio(Child, ChildStdin),
    Http(Arc<HttpUpstream>),
}

/// The real server over Streamable HTTP: its session and negotiated protocol version, and the
/// queue of messages to it.
pub(super) struct HttpUpstream {
    pub url: String,
    agent: ureq::Agent,
    session: Mutex<Option<String>>,
    version: Mutex<Option<String>>,
    /// Held while a lost session is re-established.
    reinit: Mutex<()>,
    outbox: Mutex<Sender<Value>>,
}

/// A response whose head has arrived; its body is read on demand.
struct Response {
    status: u16,
    session: Option<String>,
    events: bool,
    body: Box<dyn BufRead + Send>,
}

impl Response {
    fn text(self) -> std::io::Result<String> {
        let mut s = String::new();
        self.body.take(MAX_BODY).read_to_string(&mut s)?;
        Ok(s)
    }
}

impl HttpUpstream {
    fn headers<'a>(session: &'a Option<String>, version: &'a Option<String>) -> Vec<(&'static str, &'a str)> {
        let mut headers = vec![("Content-Type", "application/json"), ("Accept", "application/json, text/event-stream")];
        if let Some(s) = session {
            headers.push(("Mcp-Session-Id", s));
        }
        if let Some(v) = version {
            headers.push(("MCP-Protocol-Version", v));
        }
        headers
    }

    /// One request; returns once the response's head has arrived.
    fn request(&self, method: &str, headers: &[(&str, &str)], body: &[u8]) -> Result<Response> {
        let resp = match method {
            "POST" => {
                let mut r = self.agent.post(&self.url);
                for (k, v) in headers {
                    r = r.header(*k, *v);
                }
                r.send(body)
            }
            _ => {
                let mut r = if method == "DELETE" { self.agent.delete(&self.url) } else { self.agent.get(&self.url) };
                for (k, v) in headers {
                    r = r.header(*k, *v);
                }
                r.call()
            }
        }
        .map_err(|e| Error::Upstream(format!("cannot reach the upstream MCP server at {}: {e}", self.url)))?;
        let header = |n: &str| resp.headers().get(n).and_then(|v| v.to_str().ok()).map(String::from);
        let events = header("content-type").is_some_and(|t| t.to_ascii_lowercase().starts_with("text/event-stream"));
        Ok(Response {
            status: resp.status().as_u16(),
            session: header("mcp-session-id"),
            events,
            body: Box::new(BufReader::new(resp.into_body().into_reader())),
        })
    }
}

impl Proxy {
    pub(super) fn start_upstream(self: &Arc<Self>) -> Result<()> {
        if let Some(url) = &self.opts.upstream_url {
            let (tx, rx) = channel();
            let agent: ureq::Agent = ureq::Agent::config_builder().http_status_as_error(false).build().into();
            let h = Arc::new(HttpUpstream {
                url: format!("http://{}{}", url.authority, url.path),
                agent,
                session: Mutex::new(None),
                version: Mutex::new(None),
                reinit: Mutex::new(()),
                outbox: Mutex::new(tx),
            });
            *self.upstream.lock().unwrap() = Some(Upstream::Http(h.clone()));
            let me = self.clone();
            std::thread::spawn(move || me.http_sender(h, rx));
            return Ok(());
        }
        let (prog, args) =
            self.opts.upstream.split_first().ok_or_else(|| Error::Upstream("no upstream MCP server command".into()))?;
        let mut cmd = Command::new(prog);
        // The server dies with the proxy, however the proxy ends.
        // SAFETY: only prctl(2), async-signal-safe, runs between fork and exec.
        unsafe {
            use std::os::unix::process::CommandExt;
            cmd.pre_exec(|| {
                nix::sys::prctl::set_pdeathsig(nix::sys::signal::Signal::SIGTERM).map_err(std::io::Error::from)
            });
        }
        // `{dbname}`: the database this proxy's sandbox uses (its own branch, for a fork).
        let dbname = self.opts.effective_dbname()?;
        for (k, v) in std::env::vars() {
            if v.contains("{dbname}") {
                cmd.env(k, v.replace("{dbname}", &dbname));
            }
        }
        let mut child = cmd
            .args(args.iter().map(|a| a.replace("{dbname}", &dbname)))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(|e| Error::Upstream(format!("cannot start the upstream MCP server {prog}: {e}")))?;
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

    pub(super) fn send_upstream(self: &Arc<Self>, msg: &Value) -> Result<()> {
        let mut up = self.upstream.lock().unwrap();
        match up.as_mut() {
            None => Err(Error::Upstream("the upstream MCP server is not running".into())),
            Some(Upstream::Stdio(_, stdin)) => {
                let mut line = serde_json::to_vec(msg).map_err(|e| Error::Upstream(e.to_string()))?;
                line.push(b'\n');
                stdin
                    .write_all(&line)
                    .and_then(|_| stdin.flush())
                    .map_err(|e| Error::Upstream(format!("the upstream MCP server is gone: {e}")))
            }
            Some(Upstream::Http(h)) => h
                .outbox
                .lock()
                .unwrap()
                .send(msg.clone())
                .map_err(|_| Error::Upstream("the upstream MCP connection is closed".into())),
        }
    }

    /// Sends the queued messages to an HTTP upstream, one after another, until the proxy ends.
    fn http_sender(self: Arc<Self>, h: Arc<HttpUpstream>, queue: Receiver<Value>) {
        for msg in queue {
            if self.closing.load(Ordering::SeqCst) {
                return;
            }
            if let Err(e) = self.http_exchange(&h, &msg) {
                self.http_failed(&msg, e);
            }
        }
    }

    /// A message that could not be delivered: a request gets the error as its response.
    fn http_failed(&self, msg: &Value, e: Error) {
        match (msg.get("method").is_some(), msg.get("id").filter(|i| !i.is_null())) {
            (true, Some(id)) => {
                self.on_upstream_message(jsonrpc::error(id.clone(), jsonrpc::INTERNAL_ERROR, e.to_string()))
            }
            _ => eprintln!("planarian-mcp-proxy: {e}"),
        }
    }

    /// Reads the messages of a response (one JSON body, or an event stream) and hands each to
    /// `f`; an event stream is left once the response to `until` has arrived.
    fn each_message(resp: Response, until: Option<&Value>, mut f: impl FnMut(Value)) -> Result<()> {
        let done = |m: &Value| until.is_some_and(|id| m.get("method").is_none() && m.get("id") == Some(id));
        if resp.events {
            let mut events = http::Events::new(resp.body);
            while let Some(data) = events
                .next_data()
                .map_err(|e| Error::Upstream(format!("the upstream MCP server's event stream broke: {e}")))?
            {
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
        let text =
            resp.text().map_err(|e| Error::Upstream(format!("cannot read the upstream MCP server's response: {e}")))?;
        match serde_json::from_str::<Value>(&text) {
            Ok(Value::Array(a)) => a.into_iter().for_each(f),
            Ok(m) => f(m),
            Err(e) => return Err(Error::Upstream(format!("the upstream MCP server's response is not JSON: {e}"))),
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
            let mut headers = HttpUpstream::headers(&session, &version);
            headers.retain(|(k, _)| *k != "Content-Type");
            headers[0] = ("Accept", "text/event-stream");
            let Ok(resp) = h.request("GET", &headers, b"") else { return };
            if resp.status != 200 || !resp.events {
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

    /// One message to an HTTP upstream: returns once the server took it. What the response
    /// carries is read on a thread of its own (the answer to `initialize`, here: nothing may be
    /// sent in the session before it).
    fn http_exchange(self: &Arc<Self>, h: &Arc<HttpUpstream>, msg: &Value) -> Result<()> {
        let body = serde_json::to_vec(msg).map_err(|e| Error::Upstream(e.to_string()))?;
        let is_init = msg["method"] == "initialize";
        let request_id = msg.get("method").and(msg.get("id")).filter(|i| !i.is_null()).cloned();
        for attempt in 0..2 {
            let (session, version) = if is_init {
                (None, None)
            } else {
                (h.session.lock().unwrap().clone(), h.version.lock().unwrap().clone())
            };
            let resp = h.request("POST", &HttpUpstream::headers(&session, &version), &body)?;
            match resp.status {
                200 if is_init => {
                    *h.session.lock().unwrap() = resp.session.clone();
                    return Self::each_message(resp, request_id.as_ref(), |m| {
                        if Some(&m["id"]) == request_id.as_ref() {
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
                200 => {
                    let me = self.clone();
                    let msg = msg.clone();
                    std::thread::spawn(move || {
                        if let Err(e) = Self::each_message(resp, request_id.as_ref(), |m| me.on_upstream_message(m)) {
                            me.http_failed(&msg, e);
                        }
                    });
                    return Ok(());
                }
                202 | 204 => return Ok(()),
                // The server forgot the session (restarted, expired): a new one, then once more.
                404 if session.is_some() && attempt == 0 => self.reestablish(h, &session)?,
                status => {
                    let text = resp.text().unwrap_or_default();
                    let text: String = text.trim().chars().take(300).collect();
                    return Err(Error::Upstream(format!("the upstream MCP server answered HTTP {status}: {text}")));
                }
            }
        }
        Err(Error::Upstream("the upstream MCP server lost the session again right after it was re-established".into()))
    }

    /// A new upstream session, initialized with the harness's own parameters.
    fn reestablish(self: &Arc<Self>, h: &Arc<HttpUpstream>, lost: &Option<String>) -> Result<()> {
        let _one = h.reinit.lock().unwrap();
        if *h.session.lock().unwrap() != *lost {
            return Ok(()); // another call did it meanwhile
        }
        *h.session.lock().unwrap() = None;
        let Some(params) = self.initialize.lock().unwrap().clone() else { return Ok(()) };
        eprintln!("planarian-mcp-proxy: the upstream MCP server lost the session; starting a new one");
        let id = json!(self.next_id.fetch_add(1, Ordering::SeqCst));
        let init = jsonrpc::request(id.clone(), "initialize", params);
        let fail = |e: Error| e.context("cannot re-establish the upstream MCP session");
        let resp =
            h.request("POST", &HttpUpstream::headers(&None, &None), init.to_string().as_bytes()).map_err(fail)?;
        if resp.status != 200 {
            return Err(fail(Error::Upstream(format!("HTTP {}", resp.status))));
        }
        let session = resp.session.clone();
        let mut version = None;
        Self::each_message(resp, Some(&id), |m| {
            if m["id"] == id {
                version = m["result"]["protocolVersion"].as_str().map(String::from);
            }
        })
        .map_err(fail)?;
        let note = jsonrpc::notification("notifications/initialized", Value::Null).to_string();
        h.request("POST", &HttpUpstream::headers(&session, &version), note.as_bytes()).map_err(fail)?;
        *h.session.lock().unwrap() = session;
        *h.version.lock().unwrap() = version;
        self.listen_upstream(h.clone());
        Ok(())
    }

    /// Ends the HTTP session (servers may refuse: 405).
    pub(super) fn end_session(h: &HttpUpstream) {
        if let Some(s) = h.session.lock().unwrap().clone() {
            let _ = h.request("DELETE", &[("Mcp-Session-Id", &s)], b"");
        }
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
                Pending::Client(orig, conn, _) => Self::reply_error(
                    &conn,
                    &orig,
                    -32603,
                    "the upstream MCP server exited during the call; it has been restarted: retry",
                ),
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
                    let _ = self.send_upstream(&jsonrpc::notification("notifications/initialized", Value::Null));
                }
                Err(e) => eprintln!("planarian-mcp-proxy: cannot re-initialize the upstream: {e}"),
            }
        }
    }
}
