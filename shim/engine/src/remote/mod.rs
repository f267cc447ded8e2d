//! Remote state: what a sandbox changed outside itself through its tool calls. [`hooks`] is the
//! paper's capture/compensate interface; [`sidecar`] runs the MCP state proxy beside a container
//! (itself such a hook).

pub mod hooks;
pub mod sidecar;

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Io(#[from] sys::IoError),
    #[error(transparent)]
    Tool(#[from] crate::tools::NotFound),
    #[error(transparent)]
    Config(#[from] crate::config::ConfigError),
    #[error("cannot run remote hook {}: {source}", hook.display())]
    Run { hook: PathBuf, source: std::io::Error },
    /// A hook failed: its last line on stderr.
    #[error("remote hook {} {verb} failed: {message}", hook.display())]
    Failed { hook: PathBuf, verb: String, message: String },
    #[error("remote hook {} {verb} printed no JSON object: {source}", hook.display())]
    NotJson { hook: PathBuf, verb: &'static str, source: serde_json::Error },
    #[error("remote hook {} {verb} printed an answer planarian cannot read: {source}", hook.display())]
    BadAnswer { hook: PathBuf, verb: &'static str, source: serde_json::Error },
    #[error("cannot write down the compensation under way: {0}")]
    Intent(String),
    #[error("remote hook {} capture gave no mcp-call-position", .0.display())]
    NoPosition(PathBuf),
    #[error("unknown MCP service {name} (configured in [mcp.services]: {known})")]
    UnknownService { name: String, known: String },
    #[error("MCP service {0}: database and one of upstream (a command) or url must be set")]
    ServiceIncomplete(String),
    #[error("cannot start {}: {source}", proxy.display())]
    Start { proxy: PathBuf, source: std::io::Error },
    #[error("the MCP proxy for service {service} exited ({status}): {last}")]
    Exited { service: String, status: std::process::ExitStatus, last: String },
    #[error("the MCP proxy for service {service} did not answer on its control socket within 120 s (it runs on: stopped); see {}", log.display())]
    NotUp { service: String, log: PathBuf },
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
