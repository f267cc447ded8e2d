//! The little HTTP/1.1 server side that MCP's Streamable HTTP transport needs, on loopback, over
//! the standard library (requests and responses with a length or chunked body, server-sent
//! events), and the event-stream parser the client side shares. The client side itself is ureq
//! (proxy/upstream.rs).

use crate::error::{Error, Result};
use std::io::{self, BufRead, Read, Write};

/// A request body or a non-streamed response body may not be larger than this.
const MAX_BODY: usize = 16 << 20;

pub type Headers = Vec<(String, String)>;

pub fn header<'a>(headers: &'a Headers, name: &str) -> Option<&'a str> {
    headers.iter().find(|(k, _)| k.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
}

fn bad(msg: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg.into())
}

fn read_line(r: &mut impl BufRead) -> io::Result<Option<String>> {
    let mut line = String::new();
    if r.by_ref().take(64 << 10).read_line(&mut line)? == 0 {
        return Ok(None);
    }
    if !line.ends_with('\n') {
        return Err(bad("HTTP line too long or cut short"));
    }
    Ok(Some(line.trim_end_matches(['\r', '\n']).to_string()))
}

fn read_headers(r: &mut impl BufRead) -> io::Result<Headers> {
    let mut headers = Vec::new();
    loop {
        let line = read_line(r)?.ok_or_else(|| bad("connection closed inside the headers"))?;
        if line.is_empty() {
            return Ok(headers);
        }
        let (k, v) = line.split_once(':').ok_or_else(|| bad(format!("not a header: {line}")))?;
        headers.push((k.trim().to_string(), v.trim().to_string()));
        if headers.len() > 200 {
            return Err(bad("too many headers"));
        }
    }
}

/// How a message's body is delimited.
enum Framing {
    Length(u64),
    Chunked { left: u64, done: bool },
    UntilClose,
}

/// A message body, de-chunked.
pub struct Body<R> {
    inner: R,
    framing: Framing,
}

impl<R: BufRead> Body<R> {
    fn new(inner: R, headers: &Headers, request: bool) -> io::Result<Body<R>> {
        let framing =
            if header(headers, "transfer-encoding").is_some_and(|t| t.to_ascii_lowercase().contains("chunked")) {
                Framing::Chunked { left: 0, done: false }
            } else if let Some(n) = header(headers, "content-length") {
                Framing::Length(n.parse().map_err(|_| bad(format!("bad Content-Length: {n}")))?)
            } else if request {
                Framing::Length(0)
            } else {
                Framing::UntilClose
            };
        Ok(Body { inner, framing })
    }

    fn read_all(mut self) -> io::Result<Vec<u8>> {
        let mut out = Vec::new();
        (&mut self).take(MAX_BODY as u64 + 1).read_to_end(&mut out)?;
        if out.len() > MAX_BODY {
            return Err(bad("body too large"));
        }
        Ok(out)
    }
}

impl<R: BufRead> Read for Body<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match &mut self.framing {
            Framing::Length(0) => Ok(0),
            Framing::Length(left) => {
                let max = buf.len().min(usize::try_from(*left).unwrap_or(usize::MAX));
                let n = self.inner.read(&mut buf[..max])?;
                if n == 0 {
                    return Err(io::ErrorKind::UnexpectedEof.into());
                }
                *left -= n as u64;
                Ok(n)
            }
            Framing::Chunked { done: true, .. } => Ok(0),
            Framing::Chunked { left, done } => {
                if *left == 0 {
                    let line = read_line(&mut self.inner)?.ok_or(io::ErrorKind::UnexpectedEof)?;
                    let size = line.split(';').next().unwrap_or("").trim();
                    *left = u64::from_str_radix(size, 16).map_err(|_| bad(format!("bad chunk size: {line}")))?;
                    if *left == 0 {
                        // Trailers, then the end.
                        while read_line(&mut self.inner)?.is_some_and(|l| !l.is_empty()) {}
                        *done = true;
                        return Ok(0);
                    }
                }
                let max = buf.len().min(usize::try_from(*left).unwrap_or(usize::MAX));
                let n = self.inner.read(&mut buf[..max])?;
                if n == 0 {
                    return Err(io::ErrorKind::UnexpectedEof.into());
                }
                *left -= n as u64;
                if *left == 0 {
                    read_line(&mut self.inner)?;
                }
                Ok(n)
            }
            Framing::UntilClose => self.inner.read(buf),
        }
    }
}

pub struct Request {
    pub method: String,
    pub path: String,
    pub headers: Headers,
    pub body: Vec<u8>,
}

impl Request {
    pub fn header(&self, name: &str) -> Option<&str> {
        header(&self.headers, name)
    }
}

/// The next request on a connection; None when the client closed it between requests.
pub fn read_request(r: &mut impl BufRead) -> io::Result<Option<Request>> {
    let line = loop {
        match read_line(r)? {
            None => return Ok(None),
            Some(l) if l.is_empty() => continue,
            Some(l) => break l,
        }
    };
    let mut parts = line.split(' ');
    let (Some(method), Some(target), Some(_version)) = (parts.next(), parts.next(), parts.next()) else {
        return Err(bad(format!("not an HTTP request: {line}")));
    };
    let headers = read_headers(r)?;
    let body = Body::new(&mut *r, &headers, true)?.read_all()?;
    let path = target.split('?').next().unwrap_or(target).to_string();
    Ok(Some(Request { method: method.to_string(), path, headers, body }))
}

fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        202 => "Accepted",
        204 => "No Content",
        400 => "Bad Request",
        403 => "Forbidden",
        404 => "Not Found",
        405 => "Method Not Allowed",
        406 => "Not Acceptable",
        413 => "Payload Too Large",
        415 => "Unsupported Media Type",
        _ => "Error",
    }
}

/// A whole response in one write.
pub fn respond(w: &mut impl Write, status: u16, headers: &[(&str, &str)], body: &[u8]) -> io::Result<()> {
    let mut out = format!("HTTP/1.1 {status} {}\r\nContent-Length: {}\r\n", reason(status), body.len());
    for (k, v) in headers {
        out += &format!("{k}: {v}\r\n");
    }
    out += "\r\n";
    let mut bytes = out.into_bytes();
    bytes.extend_from_slice(body);
    w.write_all(&bytes)?;
    w.flush()
}

/// Starts a server-sent event stream (chunked, so the connection can be reused after it).
pub fn start_events(w: &mut impl Write, headers: &[(&str, &str)]) -> io::Result<()> {
    let mut out = "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\nTransfer-Encoding: chunked\r\n".to_string();
    for (k, v) in headers {
        out += &format!("{k}: {v}\r\n");
    }
    out += "\r\n";
    w.write_all(out.as_bytes())?;
    w.flush()
}

/// One event (a JSON-RPC message, or a comment line when `data` starts with ':'), one chunk.
pub fn event(w: &mut impl Write, data: &str) -> io::Result<()> {
    let ev = if data.starts_with(':') { format!("{data}\n\n") } else { format!("event: message\ndata: {data}\n\n") };
    let mut out = format!("{:x}\r\n", ev.len()).into_bytes();
    out.extend_from_slice(ev.as_bytes());
    out.extend_from_slice(b"\r\n");
    w.write_all(&out)?;
    w.flush()
}

pub fn end_events(w: &mut impl Write) -> io::Result<()> {
    w.write_all(b"0\r\n\r\n")?;
    w.flush()
}

/// Reads server-sent events: each call returns the data of the next event (None at the end).
pub struct Events<R> {
    inner: R,
}

impl<R: BufRead> Events<R> {
    pub fn new(inner: R) -> Events<R> {
        Events { inner }
    }

    pub fn next_data(&mut self) -> io::Result<Option<String>> {
        let mut data: Option<String> = None;
        loop {
            let mut line = String::new();
            if self.inner.read_line(&mut line)? == 0 {
                return Ok(data);
            }
            let line = line.trim_end_matches(['\r', '\n']);
            if line.is_empty() {
                if data.is_some() {
                    return Ok(data);
                }
                continue;
            }
            if line.starts_with(':') {
                continue;
            }
            let (field, value) =
                line.split_once(':').map_or((line, ""), |(f, v)| (f, v.strip_prefix(' ').unwrap_or(v)));
            if field == "data" {
                let d = data.get_or_insert_with(String::new);
                if !d.is_empty() {
                    d.push('\n');
                }
                d.push_str(value);
            }
        }
    }
}

/// An `http://host:port/path` URL (the upstream runs on this machine; no TLS).
#[derive(Debug, Clone)]
pub struct Url {
    pub authority: String,
    pub path: String,
}

impl Url {
    pub fn parse(s: &str) -> Result<Url> {
        let rest = s.strip_prefix("http://").ok_or_else(|| {
            Error::Invalid(format!("{s}: only http:// URLs are supported (the MCP server runs beside the proxy)"))
        })?;
        let (authority, path) = rest.find('/').map_or((rest, "/"), |i| (&rest[..i], &rest[i..]));
        if authority.is_empty() {
            return Err(Error::Invalid(format!("{s}: no host")));
        }
        let authority =
            if authority.rsplit_once(':').is_some_and(|(_, p)| p.parse::<u16>().is_ok()) && !authority.ends_with(']') {
                authority.to_string()
            } else {
                format!("{authority}:80")
            };
        Ok(Url { authority, path: path.to_string() })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::BufReader;

    #[test]
    fn chunked_bodies_and_events_are_read_across_chunk_boundaries() {
        let raw = b"POST /mcp HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n5\r\n{\"a\":\r\n3;ext=1\r\n 1}\r\n0\r\n\r\nGET /mcp?x=1 HTTP/1.1\r\n\r\n";
        let mut r = BufReader::new(&raw[..]);
        let req = read_request(&mut r).unwrap().unwrap();
        assert_eq!((req.method.as_str(), req.path.as_str(), &req.body[..]), ("POST", "/mcp", &b"{\"a\": 1}"[..]));
        let next = read_request(&mut r).unwrap().unwrap();
        assert_eq!((next.method.as_str(), next.path.as_str(), next.body.len()), ("GET", "/mcp", 0));
        assert!(read_request(&mut r).unwrap().is_none());

        let mut stream = Vec::new();
        start_events(&mut stream, &[]).unwrap();
        event(&mut stream, "{\"x\":1}").unwrap();
        event(&mut stream, ": keep-alive").unwrap();
        event(&mut stream, "{\"y\":2}").unwrap();
        end_events(&mut stream).unwrap();
        let mut r = BufReader::new(&stream[..]);
        read_line(&mut r).unwrap();
        let headers = read_headers(&mut r).unwrap();
        let body = BufReader::new(Body::new(r, &headers, false).unwrap());
        let mut ev = Events::new(body);
        assert_eq!(ev.next_data().unwrap().as_deref(), Some("{\"x\":1}"));
        assert_eq!(ev.next_data().unwrap().as_deref(), Some("{\"y\":2}"));
        assert_eq!(ev.next_data().unwrap(), None);

        let mut multi = Events::new(&b"id: 7\ndata: {\"a\":\ndata: 1}\n\n: c\n\ndata:x"[..]);
        assert_eq!(multi.next_data().unwrap().as_deref(), Some("{\"a\":\n1}"));
        assert_eq!(multi.next_data().unwrap().as_deref(), Some("x"));
    }

    #[test]
    fn urls() {
        let u = Url::parse("http://127.0.0.1:5000/mcp").unwrap();
        assert_eq!((u.authority.as_str(), u.path.as_str()), ("127.0.0.1:5000", "/mcp"));
        let u = Url::parse("http://localhost").unwrap();
        assert_eq!((u.authority.as_str(), u.path.as_str()), ("localhost:80", "/"));
        assert!(Url::parse("https://x/mcp").unwrap_err().to_string().contains("only http://"));
    }
}
