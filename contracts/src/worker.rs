//! What planarian hands the background workers it starts (`planarian __snapshot-worker FD SPEC`,
//! `planarian __rollback-cleanup FD SPEC`): the container's lock as the inherited descriptor FD,
//! and SPEC, one of these as JSON.

use serde::{Deserialize, Serialize};

/// An asynchronous snapshot (`planarian snapshot --async`, the MCP `statepoint_create`): the
/// statepoint the caller reserved and printed, taken by the worker.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub struct Snapshot {
    /// The container's full ID.
    pub container: String,
    /// The statepoint ID reserved for it.
    pub statepoint: String,
    /// The runtime's `--root`, when the caller was given one.
    #[serde(default)]
    pub root: Option<String>,
    #[serde(default)]
    pub systemd_cgroup: bool,
    #[serde(default)]
    pub name: Option<String>,
    #[serde(default)]
    pub description: Option<String>,
    /// The structured state the caller attached (`--state`).
    #[serde(default)]
    pub state: Option<serde_json::Value>,
    #[serde(default)]
    pub tcp_established: bool,
    #[serde(default)]
    pub file_locks: bool,
}

/// What a rollback in place leaves for later: its safety statepoint (discarded) and the ZFS
/// datasets it set aside, removed by the worker while it holds the container's lock shared.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct Cleanup {
    pub container: String,
    pub safety: String,
    #[serde(default)]
    pub zfs: Vec<String>,
}

/// A worker's SPEC argument, read: one line that says what is wrong with it otherwise.
pub fn parse<T: for<'de> Deserialize<'de>>(spec: &str) -> Result<T, String> {
    serde_json::from_str(spec).map_err(|e| format!("bad worker spec: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_wire_forms_are_pinned() {
        let s = Snapshot {
            container: "c".into(),
            statepoint: "sp2".into(),
            root: Some("/run/r".into()),
            systemd_cgroup: true,
            name: Some("n".into()),
            description: None,
            state: Some(serde_json::json!({"k": 1})),
            tcp_established: true,
            file_locks: false,
        };
        let v = serde_json::to_value(&s).unwrap();
        assert_eq!(
            v,
            serde_json::json!({"container": "c", "statepoint": "sp2", "root": "/run/r", "systemd-cgroup": true,
                "name": "n", "description": null, "state": {"k": 1}, "tcp-established": true, "file-locks": false})
        );
        assert_eq!(parse::<Snapshot>(&v.to_string()).unwrap(), s);
        let c = Cleanup { container: "c".into(), safety: "sp9".into(), zfs: vec!["pool/x".into()] };
        let v = serde_json::to_value(&c).unwrap();
        assert_eq!(v, serde_json::json!({"container": "c", "safety": "sp9", "zfs": ["pool/x"]}));
        assert_eq!(parse::<Cleanup>(&v.to_string()).unwrap(), c);
    }

    #[test]
    fn a_bad_spec_is_one_line() {
        let e = parse::<Cleanup>("{\"container\": 1}").unwrap_err();
        assert!(e.starts_with("bad worker spec: ") && !e.contains('\n'), "{e}");
        assert!(parse::<Snapshot>("{\"container\": \"c\", \"statepoint\": \"s\", \"other\": 1}").is_err());
    }
}
