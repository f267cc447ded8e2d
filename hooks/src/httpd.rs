//! The proxy as a Streamable HTTP MCP server (on loopback): `POST /mcp` carries the harness's
//! messages — a single response comes back as JSON, anything more (the server's progress
//! notifications and requests during a call, a batch) as an event stream that ends with the
//! last response; `GET /mcp` opens a standing event stream for the server's messages outside
//! any call; `DELETE /mcp` ends the session. Sessions are created by `initialize`.

use crate::error::{Error, Result};
use crate::http::{self, Request};
use crate::proxy::{Conn, Proxy};
use planarian_contracts::jsonrpc;
use serde_json::Value;
use std::collections::HashSet;
use std::io::{BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::mpsc::RecvTimeoutError;
use std::sync::{Arc, Mutex};
use std::time::Duration;

type Sessions = Arc<Mutex<HashSet<String>>>;

/// Binds the listener; only loopback addresses (the proxy has no authentication).
pub fn bind(addr: &str) -> Result<TcpListener> {
    let a: SocketAddr = addr.parse().map_err(|_| {
        Error::Invalid(format!("--http {addr}: not an address:port (e.g. 127.0.0.1:8808, or port 0 for any)"))
    })?;
    if !a.ip().is_loopback() {
        return Err(Error::Invalid(format!("--http {addr}: the proxy listens on loopback only (127.0.0.1 or [::1])")));
    }
    TcpListener::bind(a).map_err(|e| Error::Invalid(format!("cannot listen on {addr}: {e}")))
}

pub fn serve(proxy: Arc<Proxy>, listener: TcpListener) {
    let sessions: Sessions = Arc::default();
    for stream in listener.incoming().flatten() {
        let (proxy, sessions) = (proxy.clone(), sessions.clone());
        std::thread::spawn(move || connection(&proxy, &sessions, stream));
    }
}

fn connection(proxy: &Arc<Proxy>, sessions: &Sessions, stream: TcpStream) {
    let _ = stream.set_nodelay(true);
    let Ok(read) = stream.try_clone() else { return };
    let mut r = BufReader::new(read);
    let mut w = stream;
    loop {
        let req = match http::read_request(&mut r) {
            Ok(Some(req)) => req,
            Ok(None) => return,
            Err(e) => {
                let _ = http::respond(&mut w, 400, &[("Connection", "close")], e.to_string().as_bytes());
                return;
            }
        };
        let close = req.header("connection").is_some_and(|c| c.eq_ignore_ascii_case("close"));
        if handle(proxy, sessions, req, &mut w).is_err() || close {
            return;
        }
    }
}

/// A JSON-RPC error in an HTTP error response, as MCP servers send them.
fn refuse(w: &mut impl Write, status: u16, message: &str) -> std::io::Result<()> {
    let body = jsonrpc::error(Value::Null, jsonrpc::SERVER_ERROR, message).to_string();
    http::respond(w, status, &[("Content-Type", "application/json")], body.as_bytes())
}

/// Browsers' pages must not reach a loopback server (DNS rebinding): only local origins.
fn local_origin(origin: &str) -> bool {
    let host = origin.split("://").nth(1).unwrap_or(origin);
    let host = host.rsplit_once(':').filter(|(_, p)| p.chars().all(|c| c.is_ascii_digit())).map_or(host, |(h, _)| h);
    matches!(host, "localhost" | "127.0.0.1" | "[::1]")
}

fn session_id() -> String {
    let mut b = [0u8; 16];
    if std::fs::File::open("/dev/urandom").and_then(|mut f| f.read_exact(&mut b)).is_err() {
        let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
        b[..16].copy_from_slice(&(t.as_nanos() ^ u128::from(std::process::id())).to_le_bytes());
    }
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// The request's session, which must exist.
fn session(req: &Request, sessions: &Sessions) -> Result<String, (u16, &'static str)> {
    match req.header("mcp-session-id") {
        None => Err((400, "Bad Request: the Mcp-Session-Id header is required (initialize first)")),
        Some(s) if sessions.lock().unwrap().contains(s) => Ok(s.to_string()),
        Some(_) => Err((404, "Session not found")),
    }
}

fn handle(proxy: &Arc<Proxy>, sessions: &Sessions, req: Request, w: &mut TcpStream) -> std::io::Result<()> {
    if req.header("origin").is_some_and(|o| !local_origin(o)) {
        return refuse(w, 403, "Forbidden: origin not allowed");
    }
    if req.path != "/mcp" {
        return refuse(w, 404, "Not Found: the MCP endpoint is /mcp");
    }
    match req.method.as_str() {
        "POST" => post(proxy, sessions, &req, w),
        "GET" => {
            let sid = match session(&req, sessions) {
                Ok(s) => s,
                Err((status, why)) => return refuse(w, status, why),
            };
            if !req.header("accept").is_some_and(|a| a.contains("text/event-stream")) {
                return refuse(w, 406, "Not Acceptable: a GET must accept text/event-stream");
            }
            let (conn, rx) = Conn::channel(format!("http-{sid}"));
            proxy.set_standing(conn);
            http::start_events(w, &[("Mcp-Session-Id", &sid)])?;
            loop {
                match rx.recv_timeout(Duration::from_secs(15)) {
                    Ok(m) => http::event(w, &m.to_string())?,
                    // Finds out when the client has gone.
                    Err(RecvTimeoutError::Timeout) => http::event(w, ": keep-alive")?,
                    Err(RecvTimeoutError::Disconnected) => return http::end_events(w),
                }
            }
        }
        "DELETE" => match session(&req, sessions) {
            Ok(sid) => {
                sessions.lock().unwrap().remove(&sid);
                http::respond(w, 200, &[], b"")
            }
            Err((status, why)) => refuse(w, status, why),
        },
        _ => http::respond(w, 405, &[("Allow", "GET, POST, DELETE")], b""),
    }
}

fn post(proxy: &Arc<Proxy>, sessions: &Sessions, req: &Request, w: &mut TcpStream) -> std::io::Result<()> {
    let msgs = match serde_json::from_slice::<Value>(&req.body) {
        Ok(Value::Array(a)) if !a.is_empty() => a,
        Ok(m @ Value::Object(_)) => vec![m],
        Ok(_) => return refuse(w, 400, "Bad Request: not a JSON-RPC message"),
        Err(e) => {
            let body = jsonrpc::error(Value::Null, jsonrpc::PARSE_ERROR, format!("Parse error: {e}"));
            return http::respond(w, 400, &[("Content-Type", "application/json")], body.to_string().as_bytes());
        }
    };
    let sid = if msgs.iter().any(|m| m["method"] == "initialize") {
        if msgs.len() > 1 {
            return refuse(w, 400, "Bad Request: initialize must be sent on its own");
        }
        let sid = session_id();
        sessions.lock().unwrap().insert(sid.clone());
        sid
    } else {
        match session(req, sessions) {
            Ok(s) => s,
            Err((status, why)) => return refuse(w, status, why),
        }
    };
    let mut waiting: Vec<Value> = msgs
        .iter()
        .filter(|m| m.get("method").is_some() && m.get("id").is_some_and(|i| !i.is_null()))
        .map(|m| m["id"].clone())
        .collect();
    let (conn, rx) = Conn::channel(format!("http-{sid}"));
    for m in msgs {
        proxy.handle(m, &conn);
    }
    if waiting.is_empty() {
        // Notifications and the harness's answers to the server's requests.
        return http::respond(w, 202, &[("Mcp-Session-Id", &sid)], b"");
    }
    let is_answer = |m: &Value, ids: &[Value]| m.get("method").is_none() && ids.contains(&m["id"]);
    // The sender lives in `conn` (and in the proxy's pending calls): recv waits for the answers.
    let Ok(first) = rx.recv() else { return refuse(w, 500, "the proxy dropped the call") };
    if waiting.len() == 1 && is_answer(&first, &waiting) {
        return http::respond(
            w,
            200,
            &[("Content-Type", "application/json"), ("Mcp-Session-Id", &sid)],
            first.to_string().as_bytes(),
        );
    }
    http::start_events(w, &[("Mcp-Session-Id", &sid)])?;
    let mut next = Some(first);
    while !waiting.is_empty() {
        let m = match next.take() {
            Some(m) => m,
            None => match rx.recv() {
                Ok(m) => m,
                Err(_) => break,
            },
        };
        if is_answer(&m, &waiting) {
            waiting.retain(|id| *id != m["id"]);
        }
        http::event(w, &m.to_string())?;
    }
    drop(conn);
    http::end_events(w)
}

#[cfg(test)]
mod tests {
    #[test]
    fn only_local_origins() {
        for o in ["http://localhost:3000", "http://127.0.0.1", "https://[::1]:8443", "localhost"] {
            assert!(super::local_origin(o), "{o}");
        }
        for o in ["http://evil.example", "http://localhost.evil.example:80", "null", "http://127.0.0.2"] {
            assert!(!super::local_origin(o), "{o}");
        }
    }
}
