//! What can go wrong in the MCP state proxy, by kind. Each variant carries the words a user reads
//! (they reach the harness as a JSON-RPC error, planarian as a hook's error line, or stderr); the
//! kind is what code decides on: a conflict changed nothing, a refused call was never sent, a
//! file or PostgreSQL error is the proxy's own.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A file or socket of the proxy's own (journal, positions, spec, tools.yaml, control
    /// socket) could not be read or written.
    #[error(transparent)]
    File(#[from] sys::IoError),
    /// What the proxy was given is not valid: a declared spec, Toolbox's tools.yaml, a URL, a
    /// journal or state file it cannot read back, an argument.
    #[error("{0}")]
    Invalid(String),
    /// SQL the proxy cannot classify or rewrite, or a tool's statement it cannot bind.
    #[error("{0}")]
    Sql(String),
    /// PostgreSQL answered the proxy's own connection with an error.
    #[error("{0}")]
    Postgres(String),
    /// The upstream MCP server could not be started or reached, died, or broke the protocol.
    #[error("{0}")]
    Upstream(String),
    /// A call or an operation the proxy will not carry out (what it cannot undo, a position it
    /// cannot return to, a tool it does not know): nothing was changed.
    #[error("{0}")]
    Refused(String),
    /// The container's sidecar, asked through its control socket, could not be reached or
    /// answered that the request failed.
    #[error(transparent)]
    Sidecar(#[from] planarian_contracts::control::AskError),
    /// A compensation found a row no longer as the agent's call left it: nothing was changed.
    #[error("conflict: {0}")]
    Conflict(String),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// A file error: `what` (a verb: "read", "write", "open", "create", "listen on") at `path`.
    pub fn file(what: &'static str, path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> Error {
        let path = path.into();
        move |source| Error::File(sys::IoError::new(what, path, source))
    }

    /// The same error with `context` (what was being done) before its words, of the same kind.
    pub fn context(self, context: impl std::fmt::Display) -> Error {
        self.reworded(|s| format!("{context}: {s}"))
    }

    /// The same error, of the same kind, with its words made by `words` from its own. (A file's
    /// or the sidecar's error, whose words are made of its parts, becomes a refusal.)
    pub fn reworded(self, words: impl FnOnce(String) -> String) -> Error {
        match self {
            Error::File(_) | Error::Sidecar(_) => Error::Refused(words(self.to_string())),
            Error::Invalid(s) => Error::Invalid(words(s)),
            Error::Sql(s) => Error::Sql(words(s)),
            Error::Postgres(s) => Error::Postgres(words(s)),
            Error::Upstream(s) => Error::Upstream(words(s)),
            Error::Refused(s) => Error::Refused(words(s)),
            Error::Conflict(s) => Error::Conflict(words(s)),
        }
    }
}

/// PostgreSQL's own message when it sent one (not the client library's wrapping of it).
impl From<postgres::Error> for Error {
    fn from(e: postgres::Error) -> Error {
        Error::Postgres(match e.as_db_error() {
            Some(d) => d.message().to_string(),
            None => e.to_string(),
        })
    }
}
