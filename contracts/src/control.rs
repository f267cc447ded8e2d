//! The MCP sidecar's control socket ([`crate::paths::control_socket`]): one [`Request`] line per
//! connection, one answer line back — the answer the request names, or [`Failure`].

use crate::Uncovered;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;

/// What the shim's hook verbs (and `planarian-mcp-proxy control`) ask a sidecar.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(tag = "op", rename_all = "lowercase")]
pub enum Request {
    /// The current position (taken under the proxy's lock) → [`Position`]; with `since`, also
    /// what changed after that position.
    Position {
        #[serde(default, skip_serializing_if = "Option::is_none")]
        since: Option<u64>,
    },
    /// Undo every call after position `to` → [`Compensated`].
    Compensate { to: u64 },
    /// A copy of the database at position `at` for the fork `container` → [`Branched`].
    Branch { at: u64, container: String },
    /// Drop the fork's copy (a fork that failed) → [`Unbranched`].
    Unbranch { container: String },
    /// Refuse every call from now on, saying `reason` → [`Disabled`].
    Disable {
        #[serde(default)]
        reason: String,
    },
    /// The proxy's state → [`Status`].
    Status,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct Position {
    pub position: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub calls: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tables: Option<Vec<String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uncovered: Option<Uncovered>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct Compensated {
    /// The position reached, and how many calls were undone.
    pub position: u64,
    pub rows: u64,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct Branched {
    pub database: String,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct Unbranched {
    pub dropped: String,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct Disabled {
    pub disabled: bool,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "kebab-case")]
pub struct Status {
    /// The position of the last call, and of the last call that changed something.
    pub position: u64,
    pub last: u64,
    /// How many compensations the proxy made.
    pub compensations: usize,
    /// Why every call is refused, when it is.
    pub disabled: Option<String>,
    pub uncovered: Option<Uncovered>,
    /// The servers whose specs it applies.
    pub specs: Vec<String>,
    /// The upstream: a child's PID (stdio), or a URL.
    pub upstream_pid: Option<u32>,
    pub upstream_url: Option<String>,
}

/// The answer when a request failed: one line, for a person.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Failure {
    pub error: String,
}

/// A request's answer as the sidecar writes it: `answer` or a [`Failure`].
pub fn answer_line<T: Serialize, E: std::fmt::Display>(answer: Result<T, E>) -> String {
    let v = match answer {
        Ok(a) => serde_json::to_string(&a),
        Err(error) => serde_json::to_string(&Failure { error: error.to_string() }),
    };
    v.unwrap_or_else(|e| format!("{{\"error\":\"cannot encode the answer: {e}\"}}"))
}

/// Why a request to the sidecar did not get its answer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AskError {
    /// No sidecar listens on the socket, or the connection broke.
    #[error("{0}")]
    Unreachable(String),
    /// The sidecar answered that the request failed (its [`Failure`]'s words).
    #[error("{0}")]
    Failed(String),
    /// The answer is none of the contract's.
    #[error("{0}")]
    Garbled(String),
}

/// Reads an answer line: the failure's text, or the answer `T`.
pub fn parse_answer<T: DeserializeOwned>(line: &str) -> Result<T, AskError> {
    if let Ok(f) = serde_json::from_str::<Failure>(line) {
        return Err(AskError::Failed(f.error));
    }
    serde_json::from_str(line).map_err(|e| AskError::Garbled(format!("bad answer ({e}): {}", line.trim())))
}

/// Asks the sidecar listening on `socket` one request.
pub fn ask<T: DeserializeOwned>(socket: &Path, req: &Request) -> Result<T, AskError> {
    let broken = |e: std::io::Error| AskError::Unreachable(format!("{}: {e}", socket.display()));
    let mut conn = UnixStream::connect(socket)
        .map_err(|e| AskError::Unreachable(format!("no MCP proxy at {}: {e}", socket.display())))?;
    let line = serde_json::to_string(req).map_err(|e| AskError::Garbled(e.to_string()))?;
    conn.write_all(format!("{line}\n").as_bytes()).map_err(broken)?;
    let mut answer = String::new();
    BufReader::new(&conn).read_line(&mut answer).map_err(broken)?;
    parse_answer(&answer).map_err(|e| match e {
        AskError::Garbled(e) => AskError::Garbled(format!("{}: {e}", socket.display())),
        e => e,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn requests_keep_their_wire_form() {
        let cases = [
            (Request::Position { since: None }, json!({"op": "position"})),
            (Request::Position { since: Some(3) }, json!({"op": "position", "since": 3})),
            (Request::Compensate { to: 2 }, json!({"op": "compensate", "to": 2})),
            (Request::Branch { at: 2, container: "f".into() }, json!({"op": "branch", "at": 2, "container": "f"})),
            (Request::Unbranch { container: "f".into() }, json!({"op": "unbranch", "container": "f"})),
            (Request::Disable { reason: "r".into() }, json!({"op": "disable", "reason": "r"})),
            (Request::Status, json!({"op": "status"})),
        ];
        for (req, wire) in cases {
            assert_eq!(serde_json::to_value(&req).unwrap(), wire);
            assert_eq!(serde_json::from_value::<Request>(wire).unwrap(), req);
        }
        assert!(serde_json::from_value::<Request>(json!({"op": "compensate"})).is_err(), "compensate needs to");
        assert!(serde_json::from_value::<Request>(json!({"op": "drop-everything"})).is_err());
    }

    #[test]
    fn answers_are_the_named_answer_or_a_failure() {
        let line = answer_line::<_, String>(Ok(Compensated { position: 2, rows: 5 }));
        assert_eq!(serde_json::from_str::<serde_json::Value>(&line).unwrap(), json!({"position": 2, "rows": 5}));
        assert_eq!(parse_answer::<Compensated>(&line), Ok(Compensated { position: 2, rows: 5 }));
        let line = answer_line::<Compensated, String>(Err("conflict: row 3 changed".into()));
        assert_eq!(parse_answer::<Compensated>(&line), Err(AskError::Failed("conflict: row 3 changed".into())));
        // An older proxy wrote `"uncovered": null` when nothing was passed.
        let p: Position = parse_answer(r#"{"position": 4, "uncovered": null}"#).unwrap();
        assert_eq!(p, Position { position: 4, ..Default::default() });
        assert!(matches!(parse_answer::<Position>("{}"), Err(AskError::Garbled(e)) if e.starts_with("bad answer")));
    }
}
