//! A remote-state hook: an executable run as `HOOK VERB CONTAINER-ID …`, which prints one JSON
//! line on success and says why on its last line of stderr on failure.
//!
//! * `HOOK capture ID` → [`Capture`] (with [`SINCE_POSITION_ENV`] set to the parent statepoint's
//!   position, a hook may also say what changed since);
//! * `HOOK compensate ID POSITION` → nothing: every remote change after POSITION undone, or a
//!   failure (a line starting with [`PARTLY_UNDONE`] when part of it was undone);
//! * `HOOK branch ID POSITION NEW-ID` → [`Branch`]: remote state of its own for a fork;
//! * `HOOK unbranch ID NEW-ID` → nothing: that branch removed.

use crate::Uncovered;
use serde::{Deserialize, Serialize};

/// The environment variable carrying the parent statepoint's position to `capture`.
pub const SINCE_POSITION_ENV: &str = "PLANARIAN_SINCE_POSITION";

/// How a failed `compensate` starts its line when it undid part of what it was asked to.
pub const PARTLY_UNDONE: &str = "partly undone:";

/// What `capture` prints: the position of the last remote call, and where the service is.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "kebab-case")]
pub struct Capture {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub external_endpoint: Option<String>,
    pub mcp_call_position: u64,
    /// The calls since the parent's position that changed something, and what they changed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub calls_since_parent: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tables_since_parent: Option<Vec<String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uncovered: Option<Uncovered>,
}

/// What `branch` prints: the fork's endpoint and its own database.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "kebab-case")]
pub struct Branch {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub external_endpoint: Option<String>,
    #[serde(default)]
    pub database: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mcp_call_position: Option<u64>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn capture_lines_keep_their_wire_form() {
        let c = Capture {
            external_endpoint: Some("mcp-proxy:/run/planarian/mcp/c.sock".into()),
            mcp_call_position: 7,
            calls_since_parent: Some(2),
            tables_since_parent: Some(vec!["public.t".into()]),
            uncovered: Some(Uncovered { since: 3, last: 5, tools: vec!["x".into()] }),
        };
        assert_eq!(
            serde_json::to_value(&c).unwrap(),
            json!({"external-endpoint": "mcp-proxy:/run/planarian/mcp/c.sock", "mcp-call-position": 7,
                   "calls-since-parent": 2, "tables-since-parent": ["public.t"],
                   "uncovered": {"since": 3, "last": 5, "tools": ["x"]}})
        );
        // A hook of the paper's minimal form, and an older proxy's `uncovered` without `last`.
        let min: Capture = serde_json::from_str(r#"{"mcp-call-position": 4}"#).unwrap();
        assert_eq!(min, Capture { mcp_call_position: 4, ..Default::default() });
        let old: Capture =
            serde_json::from_str(r#"{"mcp-call-position": 4, "uncovered": {"since": 1, "tools": []}}"#).unwrap();
        assert_eq!(old.uncovered, Some(Uncovered { since: 1, last: 0, tools: vec![] }));
        assert!(serde_json::from_str::<Capture>(r#"{"external-endpoint": "x"}"#).is_err(), "a position is required");
    }

    #[test]
    fn branch_lines_keep_their_wire_form() {
        let b = Branch { external_endpoint: None, database: "db_0123".into(), mcp_call_position: Some(3) };
        assert_eq!(serde_json::to_value(&b).unwrap(), json!({"database": "db_0123", "mcp-call-position": 3}));
    }
}
