//! The control socket's server side: one request per connection, answered by the proxy. The
//! requests and answers are `planarian_contracts::control`'s.

use crate::error::{Error, Result};
use crate::proxy::Proxy;
use planarian_contracts::control::{self, Request};
use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::sync::Arc;

/// Listens on `path`, taking it over from a proxy that is gone (never from a live one).
pub fn bind(path: &Path) -> Result<UnixListener> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(Error::file("create", dir))?;
    }
    if UnixStream::connect(path).is_ok() {
        return Err(Error::Refused(format!("another proxy already listens on {}", path.display())));
    }
    let _ = std::fs::remove_file(path);
    UnixListener::bind(path).map_err(Error::file("listen on", path))
}

pub fn listen(path: &Path, proxy: Arc<Proxy>) -> Result<()> {
    let listener = bind(path)?;
    std::thread::spawn(move || {
        for conn in listener.incoming().flatten() {
            let proxy = proxy.clone();
            std::thread::spawn(move || handle(conn, &proxy));
        }
    });
    Ok(())
}

fn handle(conn: UnixStream, proxy: &Arc<Proxy>) {
    let mut line = String::new();
    if BufReader::new(&conn).read_line(&mut line).is_err() {
        return;
    }
    let answer = match serde_json::from_str::<Request>(&line) {
        Ok(req) => answer(&req, proxy),
        Err(e) => control::answer_line::<(), _>(Err(format!(
            "unknown request ({e}): expected op position, compensate, branch, unbranch, disable or status"
        ))),
    };
    let mut conn = conn;
    let _ = conn.write_all(format!("{answer}\n").as_bytes());
}

/// The answer line to one request.
fn answer(req: &Request, proxy: &Arc<Proxy>) -> String {
    match req {
        Request::Position { since } => control::answer_line(proxy.capture().and_then(|position| {
            let uncovered = proxy.uncovered();
            match since {
                None => Ok(control::Position { position, uncovered, ..Default::default() }),
                Some(since) => proxy.changes(*since, position).map(|(calls, tables)| control::Position {
                    position,
                    calls: Some(calls),
                    tables: Some(tables),
                    uncovered,
                }),
            }
        })),
        Request::Compensate { to } => {
            control::answer_line(proxy.compensate(*to).map(|rows| control::Compensated { position: *to, rows }))
        }
        Request::Disable { reason } => {
            let why = if reason.is_empty() { "database calls are disabled for this sandbox" } else { reason };
            proxy.disable(why.to_string());
            control::answer_line::<_, Error>(Ok(control::Disabled { disabled: true }))
        }
        Request::Status => control::answer_line::<_, Error>(Ok(proxy.status())),
        Request::Branch { at, container } => {
            control::answer_line(proxy.branch(*at, container).map(|database| control::Branched { database }))
        }
        Request::Unbranch { container } => {
            control::answer_line(proxy.unbranch(container).map(|dropped| control::Unbranched { dropped }))
        }
    }
}
