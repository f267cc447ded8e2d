//! crun as planarian calls it itself, typed: a container's state, and a signal to its processes.
//! (The pass-through of the verbs Podman and conmon call is not here: it hands crun the caller's
//! arguments byte for byte, and crun's answers reach the caller as they are.)

use super::{Error, Globals, Result};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// crun at `bin`, with the runtime's global flags (`--root`).
pub struct Crun<'a> {
    pub bin: &'a Path,
    pub globals: &'a Globals,
}

/// What `crun state ID` says of a container.
#[derive(Debug, Clone, PartialEq)]
pub struct State {
    pub status: String,
    /// Its first process, while there is one.
    pub pid: Option<i32>,
    pub bundle: PathBuf,
}

impl Crun<'_> {
    fn command(&self) -> Command {
        let mut c = Command::new(self.bin);
        c.args(self.globals.crun_args());
        c
    }

    /// `crun state ID`.
    pub fn state(&self, id: &str) -> Result<State> {
        let out = self
            .command()
            .args(["state", id])
            .output()
            .map_err(|source| Error::Run { tool: self.bin.to_path_buf(), source })?;
        if !out.status.success() {
            let err = String::from_utf8_lossy(&out.stderr);
            return Err(Error::CrunStateFailed {
                id: id.to_string(),
                why: err.lines().last().unwrap_or("").trim().into(),
            });
        }
        parse_state(id, &out.stdout)
    }

    /// `crun kill ID KILL`: every process of the container killed. Best effort (a container
    /// already gone is no error); whether crun said it did. What crun says goes to this
    /// process's standard error, unless `quiet`.
    pub fn kill(&self, id: &str, quiet: bool) -> bool {
        let mut c = self.command();
        c.args(["kill", id, "KILL"]);
        if quiet {
            c.stderr(Stdio::null());
        }
        c.status().is_ok_and(|s| s.success())
    }
}

fn parse_state(id: &str, json: &[u8]) -> Result<State> {
    let bad = |why: String| Error::CrunState { id: id.into(), why };
    let st: serde_json::Value = serde_json::from_slice(json).map_err(|e| bad(e.to_string()))?;
    Ok(State {
        status: st["status"].as_str().unwrap_or("unknown").to_string(),
        pid: st["pid"].as_i64().filter(|p| *p > 0).map(|p| p as i32),
        bundle: PathBuf::from(st["bundle"].as_str().ok_or_else(|| bad("no bundle".into()))?),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crun_state_is_read_and_a_stopped_container_has_no_process() {
        let s = parse_state("c", br#"{"ociVersion":"1.0.0","id":"c","pid":42,"status":"running","bundle":"/b","rootfs":"/b/r","created":"x","owner":""}"#).unwrap();
        assert_eq!(s, State { status: "running".into(), pid: Some(42), bundle: "/b".into() });
        let s = parse_state("c", br#"{"id":"c","pid":0,"status":"stopped","bundle":"/b"}"#).unwrap();
        assert_eq!(s.pid, None);
        assert!(parse_state("c", br#"{"id":"c","status":"stopped"}"#).unwrap_err().to_string().contains("no bundle"));
    }
}
