//! Where a container's MCP sidecar listens: `/run/planarian/mcp` (or `PLANARIAN_MCP_DIR`), one
//! control socket, one socket for its MCP clients, and the URL file of its HTTP endpoint.

use std::path::PathBuf;

/// The directory of every sidecar's sockets.
pub fn mcp_dir() -> PathBuf {
    std::env::var_os("PLANARIAN_MCP_DIR").map(PathBuf::from).unwrap_or_else(|| PathBuf::from("/run/planarian/mcp"))
}

/// The control socket of container `id`'s sidecar ([`crate::control`]).
pub fn control_socket(id: &str) -> PathBuf {
    mcp_dir().join(format!("{id}.sock"))
}

/// Where `planarian-mcp-proxy connect ID` reaches the sidecar's MCP clients' side.
pub fn clients_socket(id: &str) -> PathBuf {
    control_socket(id).with_extension("mcp")
}

/// The file holding the sidecar's Streamable HTTP endpoint, when it serves one.
pub fn url_file(id: &str) -> PathBuf {
    control_socket(id).with_extension("url")
}
