//! The contracts between planarian's processes, typed once and used by both ends.
//!
//! * [`hook`]: a remote-state hook's verbs (`capture`, `compensate`, `branch`, `unbranch`) and the
//!   JSON line each prints — run by the engine, implemented by `planarian-mcp-proxy`;
//! * [`control`]: the MCP sidecar's control socket, one JSON request and one answer per
//!   connection — asked by the proxy's hook verbs and its `control` command;
//! * [`jsonrpc`]: the JSON-RPC 2.0 envelopes MCP travels in — built by the proxy, the `planarian
//!   mcp` server and the benchmarks' clients;
//! * [`paths`]: where a container's sidecar sockets live;
//! * [`worker`]: what planarian hands the background workers it starts (an asynchronous
//!   snapshot, a rollback's clean-up).
//!
//! Each type's serde form is the wire form: field names, their case and which are omitted are
//! part of the contract (an older peer's lines must still parse), so the tests below pin them.

pub mod control;
pub mod hook;
pub mod jsonrpc;
pub mod paths;
pub mod worker;

use serde::{Deserialize, Serialize};

/// Tools let through unrecorded (the user's explicit pass): the positions current at the first
/// such call and at the last, and the tools. A statepoint taken after one does not cover what
/// they changed.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct Uncovered {
    pub since: u64,
    #[serde(default)]
    pub last: u64,
    pub tools: Vec<String>,
}
