//! The undo journal of declared tools: one JSON line per event, beside the positions file.
//!
//! A call's entry (its position, tool, arguments and pre-image) is written and synced **before**
//! the call is sent, so a proxy killed during the call still knows of it: an undo made from the
//! pre-image is right whether or not the call took effect; one that needs the call's answer
//! refuses to guess, and the compensation stops there and says so. The answer, and the check
//! read after it, follow in an `answered` line; a failed call gets a `failed` line (nothing to
//! undo) and an undone one an `undone` line. The file is rewritten without what no longer
//! matters after each compensation.

use crate::error::{Error, Result};
use crate::spec::{Call, Scope};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::io::Write;
use std::path::{Path, PathBuf};

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Entry {
    pub position: u64,
    pub tool: String,
    pub scope: Scope,
    pub undo: Vec<Call>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub check: Option<Call>,
    /// The check's answer right after the call.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub post: Option<Value>,
}

#[derive(Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "kebab-case")]
enum Event {
    Sent(Box<Entry>),
    Answered { position: u64, result: Value, post: Option<Value> },
    Failed { position: u64 },
    Undone { position: u64 },
}

pub struct Journal {
    path: PathBuf,
    /// In effect or in flight, by position (ascending).
    entries: Vec<Entry>,
}

impl Journal {
    pub fn path_for(state_file: &Path) -> PathBuf {
        state_file.with_extension("journal")
    }

    pub fn load(path: &Path) -> Result<Journal> {
        let mut j = Journal { path: path.to_path_buf(), entries: vec![] };
        let text = match std::fs::read_to_string(path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(j),
            Err(e) => return Err(Error::file("read", path)(e)),
        };
        for line in text.lines().filter(|l| !l.trim().is_empty()) {
            // A line cut short by a crash while it was written is the last one: the call it
            // would have announced was never sent.
            let Ok(ev) = serde_json::from_str::<Event>(line) else { continue };
            j.apply(ev);
        }
        Ok(j)
    }

    fn apply(&mut self, ev: Event) {
        match ev {
            Event::Sent(e) => {
                self.entries.retain(|x| x.position != e.position);
                self.entries.push(*e);
                self.entries.sort_by_key(|e| e.position);
            }
            Event::Answered { position, result, post } => {
                if let Some(e) = self.entries.iter_mut().find(|e| e.position == position) {
                    e.scope.result = result;
                    e.post = post;
                }
            }
            Event::Failed { position } | Event::Undone { position } => self.entries.retain(|e| e.position != position),
        }
    }

    fn append(&mut self, ev: Event) -> Result<()> {
        let mut line = serde_json::to_vec(&ev).map_err(|e| Error::Invalid(e.to_string()))?;
        line.push(b'\n');
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.path)
            .map_err(Error::file("open", &self.path))?;
        f.write_all(&line).and_then(|_| f.sync_data()).map_err(Error::file("write", &self.path))?;
        self.apply(ev);
        Ok(())
    }

    pub fn sent(&mut self, e: Entry) -> Result<()> {
        self.append(Event::Sent(Box::new(e)))
    }

    pub fn answered(&mut self, position: u64, result: Value, post: Option<Value>) -> Result<()> {
        self.append(Event::Answered { position, result, post })
    }

    pub fn failed(&mut self, position: u64) -> Result<()> {
        self.append(Event::Failed { position })
    }

    pub fn undone(&mut self, position: u64) -> Result<()> {
        self.append(Event::Undone { position })
    }

    /// The entries after `position`, newest first.
    pub fn after(&self, position: u64) -> Vec<Entry> {
        self.entries.iter().rev().take_while(|e| e.position > position).cloned().collect()
    }

    pub fn max_position(&self) -> u64 {
        self.entries.last().map_or(0, |e| e.position)
    }

    /// How many calls in (from, to] are in effect, and their tools.
    pub fn between(&self, from: u64, to: u64) -> (u64, Vec<String>) {
        let mut tools: Vec<String> = vec![];
        let mut n = 0;
        for e in self.entries.iter().filter(|e| e.position > from && e.position <= to) {
            n += 1;
            if !tools.contains(&e.tool) {
                tools.push(e.tool.clone());
            }
        }
        (n, tools)
    }

    /// Rewritten with only the entries in effect.
    pub fn compact(&mut self) -> Result<()> {
        let mut out = Vec::new();
        for e in &self.entries {
            out.extend(
                serde_json::to_vec(&Event::Sent(Box::new(e.clone()))).map_err(|e| Error::Invalid(e.to_string()))?,
            );
            out.push(b'\n');
            if e.post.is_some() || !e.scope.result.is_null() {
                let ev = Event::Answered { position: e.position, result: e.scope.result.clone(), post: e.post.clone() };
                out.extend(serde_json::to_vec(&ev).map_err(|e| Error::Invalid(e.to_string()))?);
                out.push(b'\n');
            }
        }
        sys::write_atomic(&self.path, &out, 0o600).map_err(Error::from)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn entries_survive_a_restart_and_a_torn_last_line() {
        let scratch = tempfile::tempdir().unwrap();
        let path = scratch.path().join("journal");
        let mut j = Journal::load(&path).unwrap();
        let entry = |p: u64| Entry {
            position: p,
            tool: format!("t{p}"),
            scope: Scope { args: json!({"p": p}), ..Default::default() },
            undo: vec![],
            check: None,
            post: None,
        };
        for p in 1..=4 {
            j.sent(entry(p)).unwrap();
        }
        j.answered(1, json!({"ok": 1}), Some(json!("post"))).unwrap();
        j.failed(2).unwrap();
        j.undone(4).unwrap();
        // (a crash in the middle of a line)
        std::fs::OpenOptions::new().append(true).open(&path).unwrap().write_all(b"{\"event\":\"sent\",\"posi").unwrap();
        let j = Journal::load(&path).unwrap();
        assert_eq!(j.after(0).iter().map(|e| e.position).collect::<Vec<_>>(), vec![3, 1]);
        assert_eq!(j.after(0)[1].post, Some(json!("post")));
        assert_eq!(j.after(0)[1].scope.result, json!({"ok": 1}));
        assert_eq!(j.between(0, 3), (2, vec!["t1".to_string(), "t3".to_string()]));
        let mut j = j;
        j.compact().unwrap();
        let k = Journal::load(&path).unwrap();
        assert_eq!(k.entries, j.entries);
        assert_eq!(k.max_position(), 3);
    }
}
