//! Remote-state hooks: the `capture`/`compensate` interface of the paper.
//!
//! A hook is an executable named in planarian.conf (`[hooks] remote = ["/path/hook", …]`), run
//! as root with no PATH assumptions:
//!
//! * `HOOK capture CONTAINER-ID` — during a snapshot, with the sandbox frozen: print one JSON
//!   object `{"external-endpoint": "…", "mcp-call-position": N}` and exit 0. Any failure means
//!   the statepoint is not committed. `PLANARIAN_SINCE_POSITION` holds the position this hook
//!   gave the parent statepoint, when there is one: a hook may add `"calls-since-parent": N`
//!   and `"tables-since-parent": [NAME, …]`, what the calls since changed on this branch (the
//!   ledger shows it), and `"uncovered": {"since": N, "tools": [NAME, …]}` when calls it could
//!   not undo were let through (the ledger and the restore context say so).
//! * `HOOK compensate CONTAINER-ID POSITION` — during a rollback, after the files and processes
//!   were restored (the last step: it cannot be taken back, every step that can fail comes
//!   first): undo every remote change after POSITION and exit 0, or exit non-zero with one line
//!   on stderr (the sandbox is then brought back as it was). A hook that undid part before it
//!   failed starts that line with `partly undone:` and says how far it got.
//!
//! * `HOOK branch CONTAINER-ID POSITION NEW-CONTAINER-ID` — during a fork of a statepoint whose
//!   remote state this hook captured at POSITION: give the fork NEW-CONTAINER-ID remote state of
//!   its own, as it was at POSITION, without changing CONTAINER-ID's; print one JSON object
//!   `{"external-endpoint": "…", "database": "…"}` and exit 0, or exit non-zero with one line on
//!   stderr (the fork then runs without it, its calls refused with that line).
//! * `HOOK unbranch CONTAINER-ID NEW-CONTAINER-ID` — the fork failed after `branch`: remove what
//!   it made (nothing when there is none).
//!
//! Hooks are captured in the configured order and compensated in reverse order. None is
//! configured by default; the MCP state-proxy sidecar implements this contract.

use super::{Error, Result};
use crate::store::RemoteState;
use planarian_contracts::hook;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// How a compensate hook's error starts when it undid part of the calls before it failed.
pub use planarian_contracts::hook::PARTLY_UNDONE;

/// Asks each hook for its position; `parent` is the parent statepoint's remote state (what
/// each hook recorded then).
pub fn capture(hooks: &[PathBuf], container_id: &str, parent: &[RemoteState]) -> Result<Vec<RemoteState>> {
    hooks
        .iter()
        .map(|hook| {
            let since = parent
                .iter()
                .find(|r| r.hook_path.as_deref() == Some(&*hook.to_string_lossy()))
                .and_then(|r| r.mcp_call_position);
            let out = run(hook, &["capture", container_id], since)?;
            let v: serde_json::Value = answer(hook, "capture", &out)?;
            if v.get("mcp-call-position").is_none() {
                return Err(Error::NoPosition(hook.clone()));
            }
            let c: hook::Capture = read(hook, "capture", v)?;
            Ok(RemoteState {
                external_endpoint: c.external_endpoint,
                mcp_call_position: Some(c.mcp_call_position),
                hook_path: Some(hook.display().to_string()),
                calls_since_parent: c.calls_since_parent,
                tables_since_parent: c.tables_since_parent,
                uncovered: c.uncovered,
            })
        })
        .collect()
}

const INTENT: &str = "compensating.json";

/// A compensation under way, written down before it starts (`intent`) and removed once the
/// rollback is over: a planarian killed in between leaves it, and the next statepoint operation
/// on the container finishes it ([`finish_interrupted`]): the sandbox was restored to the
/// target before compensation began, so finishing brings both to the target.
pub struct Intent(std::path::PathBuf);

/// What an [`Intent`] file holds: the rollback's process, its target, the positions it
/// compensates to. Read by the next planarian process that finds it.
#[derive(Debug, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case", default)]
struct IntentNote {
    /// (written for a reader's eyes; the recovery does not need it)
    #[serde(skip_deserializing)]
    pid: u32,
    target: Option<String>,
    remote_state: Vec<RemoteState>,
}

impl Intent {
    pub fn write(store_dir: &Path, target: &str, states: &[RemoteState]) -> Result<Intent> {
        let p = store_dir.join(INTENT);
        let note = IntentNote { pid: std::process::id(), target: Some(target.into()), remote_state: states.to_vec() };
        let text = serde_json::to_string(&note).map_err(|e| Error::Intent(e.to_string()))?;
        sys::write_atomic(&p, text.as_bytes(), 0o600).map_err(|e| Error::Intent(e.to_string()))?;
        Ok(Intent(p))
    }
}

impl Intent {
    /// Left for the next operation, which finishes the compensation.
    pub fn keep(self) {
        std::mem::forget(self);
    }
}

impl Drop for Intent {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// Finishes the compensation of a rollback whose planarian was killed during it (its intent
/// left, its process gone): `Ok(Some(target))` when it did, `Err` when it still fails (the
/// intent stays, and says so again next time).
pub fn finish_interrupted(store_dir: &Path, container_id: &str) -> Result<Option<String>> {
    let p = store_dir.join(INTENT);
    let Ok(text) = std::fs::read_to_string(&p) else { return Ok(None) };
    // (called under the container's exclusive lock: the rollback that wrote it is over)
    let note: IntentNote = serde_json::from_str(&text).unwrap_or_default();
    let target = note.target.unwrap_or_else(|| "its target".into());
    compensate(&note.remote_state, container_id)?;
    let _ = std::fs::remove_file(&p);
    Ok(Some(target))
}

/// Compensates each recorded remote state back to its position, in reverse order.
pub fn compensate(states: &[RemoteState], container_id: &str) -> Result<()> {
    let mut done: Vec<&str> = vec![];
    for st in states.iter().rev() {
        let (Some(hook), Some(pos)) = (&st.hook_path, st.mcp_call_position) else { continue };
        match run(Path::new(hook), &["compensate", container_id, &pos.to_string()], None) {
            Ok(_) => done.push(hook),
            // The hooks before it compensated: the remote state is partly undone.
            Err(Error::Failed { hook: h, verb, message }) if !done.is_empty() && !message.contains(PARTLY_UNDONE) => {
                return Err(Error::Failed {
                    hook: h,
                    verb,
                    message: format!("{PARTLY_UNDONE} {} compensated, then: {message}", done.join(", ")),
                })
            }
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Branches `state` (one hook's, of the statepoint a fork starts from) for the fork `new_id`:
/// the new remote state, and the database it names.
pub fn branch(state: &RemoteState, container_id: &str, new_id: &str) -> Result<(RemoteState, String)> {
    let (Some(hook), Some(pos)) = (&state.hook_path, state.mcp_call_position) else {
        return Err(Error::Failed {
            hook: PathBuf::new(),
            verb: "branch".into(),
            message: "the statepoint holds no remote position".into(),
        });
    };
    let hook = PathBuf::from(hook);
    let out = run(&hook, &["branch", container_id, &pos.to_string(), new_id], None)?;
    let b: hook::Branch = read(&hook, "branch", answer(&hook, "branch", &out)?)?;
    let database = b.database;
    Ok((
        RemoteState {
            external_endpoint: b.external_endpoint,
            mcp_call_position: Some(pos),
            hook_path: Some(hook.display().to_string()),
            calls_since_parent: None,
            tables_since_parent: None,
            uncovered: None,
        },
        database,
    ))
}

/// A hook's answer line, as JSON.
fn answer(hook: &Path, verb: &'static str, out: &str) -> Result<serde_json::Value> {
    serde_json::from_str(out.trim()).map_err(|source| Error::NotJson { hook: hook.to_path_buf(), verb, source })
}

/// The answer as the contract's type.
fn read<T: serde::de::DeserializeOwned>(hook: &Path, verb: &'static str, v: serde_json::Value) -> Result<T> {
    serde_json::from_value(v).map_err(|source| Error::BadAnswer { hook: hook.to_path_buf(), verb, source })
}

/// Removes what `branch` made for the fork `new_id`, which failed.
pub fn unbranch(hook: &Path, container_id: &str, new_id: &str) -> Result<()> {
    run(hook, &["unbranch", container_id, new_id], None).map(drop)
}

fn run(hook: &Path, args: &[&str], since: Option<u64>) -> Result<String> {
    let mut cmd = Command::new(hook);
    if let Some(p) = since {
        cmd.env(hook::SINCE_POSITION_ENV, p.to_string());
    }
    let out = cmd
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(|source| Error::Run { hook: hook.to_path_buf(), source })?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        return Err(Error::Failed {
            hook: hook.to_path_buf(),
            verb: args[0].to_string(),
            message: err.lines().last().unwrap_or("no message").trim().to_string(),
        });
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_intent_keeps_its_wire_form_and_a_torn_one_reads_as_nothing_to_do() {
        let note = IntentNote { pid: 7, target: Some("sp1".into()), remote_state: vec![] };
        assert_eq!(serde_json::to_string(&note).unwrap(), r#"{"pid":7,"target":"sp1","remote-state":[]}"#);
        let torn: IntentNote = serde_json::from_str(r#"{"pid":7,"tar"#).unwrap_or_default();
        assert!(torn.target.is_none() && torn.remote_state.is_empty());
    }

    /// An executable script, written by another process: a file this (multi-threaded) test
    /// process held open for writing could be inherited by a child another test forks, and
    /// executing it then fails with ETXTBSY ("Text file busy").
    fn script(dir: &Path, tag: &str, body: &str) -> PathBuf {
        use std::io::Write;
        let p = dir.join(format!("hook-{tag}"));
        let mut sh = Command::new("/bin/sh")
            .args(["-c", "cat > \"$0\" && chmod 755 \"$0\""])
            .arg(&p)
            .stdin(Stdio::piped())
            .spawn()
            .unwrap();
        sh.stdin.take().unwrap().write_all(format!("#!/bin/sh\n{body}\n").as_bytes()).unwrap();
        assert!(sh.wait().unwrap().success());
        p
    }

    #[test]
    fn capture_and_compensate_in_reverse_order() {
        let scratch = tempfile::tempdir().unwrap();
        let log = scratch.path().join("hook-log");
        let body = |n: u32| {
            format!(
                "case $1 in capture) echo '{{\"external-endpoint\": \"db{n}\", \"mcp-call-position\": {n}}}';; compensate) echo \"{n} $2 $3\" >> {};; esac",
                log.display()
            )
        };
        let hooks = vec![script(scratch.path(), "a", &body(1)), script(scratch.path(), "b", &body(2))];
        let st = capture(&hooks, "ctr", &[]).unwrap();
        assert_eq!(st[0].mcp_call_position, Some(1));
        assert_eq!(st[1].external_endpoint.as_deref(), Some("db2"));
        compensate(&st, "ctr").unwrap();
        assert_eq!(std::fs::read_to_string(&log).unwrap(), "2 ctr 2\n1 ctr 1\n");
    }

    #[test]
    fn branch_gives_the_fork_its_own_endpoint_at_the_same_position() {
        let scratch = tempfile::tempdir().unwrap();
        let h = script(scratch.path(), "branch", "[ \"$1 $2 $3 $4\" = 'branch src 7 new' ] && echo '{\"external-endpoint\": \"db-new\", \"database\": \"app_new\"}'");
        let st =
            RemoteState { hook_path: Some(h.display().to_string()), mcp_call_position: Some(7), ..Default::default() };
        let (b, db) = branch(&st, "src", "new").unwrap();
        assert_eq!(
            (b.external_endpoint.as_deref(), b.mcp_call_position, db.as_str()),
            (Some("db-new"), Some(7), "app_new")
        );
        let bad = script(scratch.path(), "nobranch", "echo 'the database holds 2048 MiB' >&2; exit 1");
        let st = RemoteState {
            hook_path: Some(bad.display().to_string()),
            mcp_call_position: Some(7),
            ..Default::default()
        };
        let e = branch(&st, "src", "new").unwrap_err().to_string();
        assert!(e.ends_with("branch failed: the database holds 2048 MiB"), "{e}");
    }

    #[test]
    fn failures_are_one_clear_line() {
        let scratch = tempfile::tempdir().unwrap();
        let h = script(scratch.path(), "bad", "echo 'connection refused' >&2; exit 3");
        let e = capture(std::slice::from_ref(&h), "c", &[]).unwrap_err().to_string();
        assert!(e.ends_with("capture failed: connection refused"), "{e}");
        let garbage = script(scratch.path(), "garbage", "echo not-json");
        assert!(capture(std::slice::from_ref(&garbage), "c", &[]).unwrap_err().to_string().contains("no JSON"));
    }
}
