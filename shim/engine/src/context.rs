//! The context library of the paper (§4.4, Table 3): the evidence a statepoint carries and what a
//! harness or an agent is told from it.
//!
//! * **StateRecord**: a description and structured state, recorded at snapshot time
//!   ([`crate::statepoint::snapshot::SnapshotRequest`]);
//! * **AppendOutcome**: what happened after a statepoint ([`append_outcome`]); a rollback
//!   appends an `abandoned` outcome to its target by itself;
//! * **ConstructLedger**: the committed statepoints as a tree, as JSON and as compact text for an
//!   LLM's context ([`Ledger`]);
//! * **RestoreContext**: after a rollback or a fork, what the harness appends to the
//!   conversation ([`RestoreContext`]), kept in the store so it can be fetched again.

pub use crate::store::How;
use crate::store::{self, Actor, ContainerStore, Manifest, Outcome, OutcomeStatus};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashSet};
use std::time::{SystemTime, UNIX_EPOCH};

/// Appends an outcome to committed statepoint `key` (id or name). Call with the container's
/// exclusive lock held; the captured state is never touched.
pub fn append_outcome(store: &ContainerStore, key: &str, outcome: Outcome) -> store::Result<Manifest> {
    let mut m = store.find(key)?;
    m.state_evidence.prior_outcomes.push(outcome);
    store.write_manifest(&m)?;
    Ok(m)
}

/// One statepoint in the ledger.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "kebab-case")]
pub struct Node {
    pub id: String,
    pub name: Option<String>,
    pub description: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state: Option<serde_json::Value>,
    pub parent: Option<String>,
    pub children: Vec<String>,
    /// The sandbox now continues from this statepoint.
    pub head: bool,
    pub created: String,
    pub age_seconds: Option<u64>,
    /// Memory images and files, as stored.
    pub bytes: u64,
    /// MCP calls that changed remote state between the parent and this statepoint, when both
    /// recorded a position.
    pub remote_calls_since_parent: Option<u64>,
    /// What those calls changed (tables), when the remote-state hook said.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub remote_tables_since_parent: Vec<String>,
    /// Processes outside the container's tree when it was taken: not in it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub processes_uncovered: Vec<String>,
    /// What its remote state does not cover: tools let through unrecorded.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub remote_uncovered: Vec<String>,
    /// Why it can no longer be restored (a rollback undid the remote calls it holds).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unreachable: Option<String>,
    pub outcomes: Vec<Outcome>,
}

/// The committed statepoints of a sandbox, as a tree (ConstructLedger).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "kebab-case")]
pub struct Ledger {
    pub container: String,
    pub head: Option<String>,
    /// Oldest first; `parent` and `children` link them (a statepoint whose parent was removed
    /// is a root).
    pub statepoints: Vec<Node>,
}

impl Ledger {
    /// The ledger of `store`'s container, called `name` for people.
    pub fn of(store: &ContainerStore, name: &str) -> Ledger {
        Ledger::from_manifests(name, store.committed(), store.head(), now())
    }

    fn from_manifests(name: &str, list: Vec<Manifest>, head: Option<String>, now: u64) -> Ledger {
        let ids: HashSet<String> = list.iter().map(|m| m.statepoint_id.clone()).collect();
        let by_id: BTreeMap<String, &Manifest> = list.iter().map(|m| (m.statepoint_id.clone(), m)).collect();
        let mut nodes: Vec<Node> = list
            .iter()
            .map(|m| {
                let parent = m.parent_statepoint_id.clone().filter(|p| ids.contains(p));
                let remote = parent.as_ref().and_then(|p| calls_between(by_id[p], m));
                Node {
                    id: m.statepoint_id.clone(),
                    name: m.name.clone(),
                    description: m.state_evidence.state_description.clone(),
                    state: m.state_evidence.state.clone(),
                    parent,
                    children: vec![],
                    head: head.as_deref() == Some(m.statepoint_id.as_str()),
                    created: m.timestamp.clone(),
                    age_seconds: parse_rfc3339(&m.timestamp).map(|t| now.saturating_sub(t)),
                    bytes: m.measurements.criu_bytes + m.measurements.rootfs_bytes,
                    remote_calls_since_parent: remote,
                    remote_tables_since_parent: m
                        .remote_state
                        .iter()
                        .flat_map(|r| r.tables_since_parent.iter().flatten().cloned())
                        .collect(),
                    processes_uncovered: m.local_state.outside_tree.clone(),
                    remote_uncovered: m
                        .remote_state
                        .iter()
                        .flat_map(|r| r.uncovered.iter().flat_map(|u| u.tools.iter().cloned()))
                        .collect(),
                    unreachable: m.unreachable.clone(),
                    outcomes: m.state_evidence.prior_outcomes.clone(),
                }
            })
            .collect();
        for i in 0..nodes.len() {
            if let Some(p) = nodes[i].parent.clone() {
                let child = nodes[i].id.clone();
                if let Some(pn) = nodes.iter_mut().find(|n| n.id == p) {
                    pn.children.push(child);
                }
            }
        }
        Ledger { container: name.to_string(), head: head.filter(|h| ids.contains(h)), statepoints: nodes }
    }

    /// The ledger as text for an LLM's context (and a person's terminal): a tree, newest
    /// branches first, each statepoint with its name, age, size, description and outcomes;
    /// within `max_chars`, keeping the head, the statepoints with evidence and the newest, and
    /// saying what was left out.
    pub fn text(&self, max_chars: Option<usize>) -> String {
        let title = format!("Statepoints of {} (* = where the sandbox is now; newest first):\n", self.container);
        if self.statepoints.is_empty() {
            return format!("{}  (none yet)\n", title.trim_end_matches(":\n").to_string() + ":");
        }
        let limit = max_chars.unwrap_or(usize::MAX);
        // Which statepoints to show, most informative first, until the text would not fit.
        let mut order: Vec<&Node> = self.statepoints.iter().collect();
        order.sort_by_key(|n| {
            let evidence = n.name.is_some() as u8 + !n.description.is_empty() as u8 + !n.outcomes.is_empty() as u8;
            (std::cmp::Reverse(n.head), std::cmp::Reverse(evidence), std::cmp::Reverse(seq(&n.id)))
        });
        let mut keep: HashSet<&str> = HashSet::new();
        let mut text = self.render(&keep);
        for n in order {
            keep.insert(&n.id);
            let t = self.render(&keep);
            if t.len() + title.len() > limit && keep.len() > 1 {
                keep.remove(n.id.as_str());
                break;
            }
            text = t;
        }
        let left = self.statepoints.len() - keep.len();
        let mut out = title + &text;
        if left > 0 {
            out += &format!(
                "  ({left} older or less informative statepoint{} left out: planarian ledger --json shows all)\n",
                if left == 1 { "" } else { "s" }
            );
        }
        out
    }

    /// The tree of the statepoints in `keep`: a kept statepoint hangs under its nearest kept
    /// ancestor.
    fn render(&self, keep: &HashSet<&str>) -> String {
        let node = |id: &str| self.statepoints.iter().find(|n| n.id == id);
        let kept_parent = |n: &Node| {
            let mut p = n.parent.as_deref();
            while let Some(id) = p {
                if keep.contains(id) {
                    return Some(id.to_string());
                }
                p = node(id).and_then(|x| x.parent.as_deref());
            }
            None
        };
        let mut children: BTreeMap<Option<String>, Vec<&Node>> = BTreeMap::new();
        for n in self.statepoints.iter().filter(|n| keep.contains(n.id.as_str())) {
            children.entry(kept_parent(n)).or_default().push(n);
        }
        for v in children.values_mut() {
            v.sort_by_key(|n| std::cmp::Reverse(seq(&n.id)));
        }
        let mut out = String::new();
        fn walk(out: &mut String, at: Option<String>, prefix: &str, children: &BTreeMap<Option<String>, Vec<&Node>>) {
            let Some(list) = children.get(&at) else { return };
            for (i, n) in list.iter().enumerate() {
                let last = i + 1 == list.len();
                let (branch, cont) = if at.is_none() {
                    ("", "")
                } else if last {
                    ("└─ ", "   ")
                } else {
                    ("├─ ", "│  ")
                };
                out.push_str(&format!("{prefix}{branch}{}\n", headline(n)));
                let inner = format!("{prefix}{cont}");
                let bar = if children.contains_key(&Some(n.id.clone())) { "│ " } else { "  " };
                if !n.description.is_empty() {
                    out.push_str(&format!("{inner}{bar} {}\n", n.description));
                }
                for o in &n.outcomes {
                    out.push_str(&format!("{inner}{bar} {}\n", outcome_line(o)));
                }
                walk(out, Some(n.id.clone()), &inner, children);
            }
        }
        walk(&mut out, None, "  ", &children);
        out
    }
}

fn headline(n: &Node) -> String {
    let mut h = format!("{}{}", n.id, if n.head { "*" } else { "" });
    if let Some(name) = &n.name {
        h += &format!(" \"{name}\"");
    }
    let mut facts = Vec::new();
    if let Some(a) = n.age_seconds {
        facts.push(format!("{} ago", human_age(a)));
    }
    facts.push(human_bytes(n.bytes));
    if let Some(c) = n.remote_calls_since_parent.filter(|c| *c > 0) {
        let tables = if n.remote_tables_since_parent.is_empty() {
            String::new()
        } else {
            format!(": {}", n.remote_tables_since_parent.join(", "))
        };
        facts.push(format!("{c} remote call{} since its parent{tables}", if c == 1 { "" } else { "s" }));
    }
    if !n.processes_uncovered.is_empty() {
        facts.push(format!("processes NOT covered: {}", n.processes_uncovered.join(", ")));
    }
    if !n.remote_uncovered.is_empty() {
        facts.push(format!("remote state NOT covered: {} let through unrecorded", n.remote_uncovered.join(", ")));
    }
    if n.unreachable.is_some() {
        facts.push("no longer restorable: its remote calls were undone".into());
    }
    format!("{h} ({})", facts.join(", "))
}

fn outcome_line(o: &Outcome) -> String {
    let status = match o.status {
        OutcomeStatus::Success => "success",
        OutcomeStatus::Failure => "failure",
        OutcomeStatus::Abandoned => "abandoned",
        OutcomeStatus::Info => "note",
    };
    let by = match o.by {
        Actor::User => "user",
        Actor::Harness => "harness",
        Actor::Agent => "agent",
    };
    // Three decimals at most, as a person writes them (-0.636, not -0.6363636363636364).
    let reward = o.reward.map(|r| format!(", reward {}", (r * 1000.0).round() / 1000.0)).unwrap_or_default();
    format!("→ {status} ({by}{reward}): {}", o.text)
}

/// MCP calls that changed remote state between two statepoints: what the hook counted on this
/// branch, else the difference of the positions it recorded (which counts calls a rollback
/// undid in between too).
fn calls_between(parent: &Manifest, m: &Manifest) -> Option<u64> {
    let mut total = None;
    for r in &m.remote_state {
        let n = match r.calls_since_parent {
            Some(n) => n,
            None => {
                let before = parent.remote_state.iter().find(|p| p.hook_path == r.hook_path)?;
                r.mcp_call_position?.saturating_sub(before.mcp_call_position?)
            }
        };
        total = Some(total.unwrap_or(0) + n);
    }
    total
}

/// What a harness appends to the conversation after a rollback or a fork (RestoreContext).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "kebab-case")]
pub struct RestoreContext {
    /// "rollback" or "fork".
    pub operation: String,
    /// The sandbox that now runs from the statepoint (for a fork, the new one).
    pub container: String,
    pub statepoint: Restored,
    /// What was put back: "processes and memory (CRIU restore)", "files (zfs)", …
    pub restored: Vec<String>,
    /// Remote calls undone, per remote state (hook): the positions from and to.
    pub compensated: Vec<Compensated>,
    /// Statepoints after the target on the branch that was left (still restorable).
    pub discarded_statepoints: Vec<String>,
    /// Statepoints left behind that can no longer be restored: the remote calls they hold
    /// were undone by this rollback.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub unreachable_statepoints: Vec<String>,
    /// What the statepoint's remote state does not cover (tools let through unrecorded).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub uncovered: Vec<String>,
    /// Processes the statepoint does not hold: they ran outside the container's process tree.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub not_held: Vec<String>,
    pub reason: Option<String>,
    /// What happened after this statepoint before (its outcomes, this rollback's excluded).
    pub prior_outcomes: Vec<Outcome>,
    pub time: String,
    /// How a rollback ran: in place, or by stopping and restoring (and why not in place).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub how: Option<How>,
}

/// The statepoint a sandbox was returned to.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "kebab-case")]
pub struct Restored {
    pub id: String,
    pub name: Option<String>,
    pub description: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state: Option<serde_json::Value>,
    /// For a fork: the container it came from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "kebab-case")]
pub struct Compensated {
    pub endpoint: Option<String>,
    pub from_position: Option<u64>,
    pub to_position: u64,
}

const CONTEXT_FILE: &str = "restore-context.json";

impl RestoreContext {
    /// The text for the conversation: what is now true, exactly which statepoint, what was
    /// undone and what was tried from there before.
    pub fn text(&self) -> String {
        let sp = &self.statepoint;
        let named = sp.name.as_ref().map(|n| format!(" \"{n}\"")).unwrap_or_default();
        let mut t = match self.operation.as_str() {
            "fork" => format!(
                "[planarian] This sandbox ({}) is a fork of {} at statepoint {}{named}: its processes, memory and files are exactly as they were at that statepoint; the source sandbox is unchanged.\n",
                self.container,
                sp.source.as_deref().unwrap_or("another sandbox"),
                sp.id
            ),
            _ => format!(
                "[planarian] The sandbox {} was rolled back to statepoint {}{named}. Its processes, memory and files are now exactly as they were at that statepoint; anything done after it is undone.\n",
                self.container, sp.id
            ),
        };
        if !sp.description.is_empty() {
            t += &format!("State at {}: {}\n", sp.id, sp.description);
        }
        if let Some(s) = &sp.state {
            t += &format!("Recorded state: {s}\n");
        }
        if !self.restored.is_empty() {
            t += &format!("Restored: {}.\n", self.restored.join("; "));
        }
        for c in &self.compensated {
            let n = c.from_position.map(|f| f.saturating_sub(c.to_position));
            match n {
                Some(0) => t += "Remote state: no calls to undo.\n",
                Some(n) => {
                    t += &format!(
                        "Remote state: {n} MCP call{} undone (back to position {}).\n",
                        if n == 1 { "" } else { "s" },
                        c.to_position
                    )
                }
                None => t += &format!("Remote state: back to position {}.\n", c.to_position),
            }
        }
        for u in &self.uncovered {
            t += &format!("Remote state NOT restored: {u}.\n");
        }
        for p in &self.not_held {
            t += &format!("Process NOT restored: {p}.\n");
        }
        if !self.discarded_statepoints.is_empty() {
            t += &format!("Left behind (still restorable): {}.\n", self.discarded_statepoints.join(", "));
        }
        if !self.unreachable_statepoints.is_empty() {
            t += &format!(
                "Left behind, no longer restorable (the MCP calls they hold were undone): {}.\n",
                self.unreachable_statepoints.join(", ")
            );
        }
        if let Some(r) = &self.reason {
            t += &format!("Reason: {r}\n");
        }
        if self.prior_outcomes.is_empty() {
            t += "Nothing was tried from this statepoint before.\n";
        } else {
            t += "Tried from this statepoint before:\n";
            for o in &self.prior_outcomes {
                t += &format!("  {}\n", outcome_line(o));
            }
        }
        t
    }

    /// Keeps it in the container's store (the last one is what `planarian statepoint context`
    /// shows).
    pub fn save(&self, store: &ContainerStore) -> Result<(), sys::IoError> {
        let text = serde_json::to_string_pretty(self).expect("a restore context serialises");
        sys::write_atomic(&store.dir.join(CONTEXT_FILE), text.as_bytes(), 0o644)
    }

    /// The last one kept for this container.
    pub fn last(store: &ContainerStore) -> Option<RestoreContext> {
        serde_json::from_slice(&std::fs::read(store.dir.join(CONTEXT_FILE)).ok()?).ok()
    }
}

/// The statepoints a rollback from `head` to `target` leaves: `head` and its ancestors back to
/// (not including) the nearest one that is `target` or an ancestor of it.
pub fn left_behind(list: &[store::Summary], head: Option<&str>, target: &str) -> Vec<String> {
    let parent = |id: &str| list.iter().find(|m| m.statepoint_id == id).and_then(|m| m.parent_statepoint_id.clone());
    let mut target_line: HashSet<String> = HashSet::new();
    let mut at = Some(target.to_string());
    while let Some(id) = at {
        if !target_line.insert(id.clone()) {
            break;
        }
        at = parent(&id);
    }
    let mut out = Vec::new();
    let mut at = head.map(String::from);
    while let Some(id) = at {
        if target_line.contains(&id) || out.contains(&id) {
            break;
        }
        out.push(id.clone());
        at = parent(&id);
    }
    out.retain(|id| list.iter().any(|m| &m.statepoint_id == id && m.status == store::Status::Committed && !m.internal));
    out
}

/// After a rollback to `target` compensated its remote state: marks every committed statepoint
/// that holds a later position of the same remote state as no longer restorable (compensation
/// undid those calls, and cannot redo them), and returns their ids (all so marked, now or
/// before).
pub fn mark_unreachable(store: &ContainerStore, target: &Manifest) -> Vec<String> {
    let mut out = vec![];
    for mut m in store.committed() {
        if m.statepoint_id == target.statepoint_id {
            continue;
        }
        let later = target.remote_state.iter().find_map(|t| {
            let (Some(hook), Some(to)) = (&t.hook_path, t.mcp_call_position) else { return None };
            let at = m.remote_state.iter().find(|r| r.hook_path.as_ref() == Some(hook))?.mcp_call_position?;
            (at > to).then(|| {
                format!(
                    "the remote calls after position {to} it holds were undone by the rollback to {}",
                    target.statepoint_id
                )
            })
        });
        if m.unreachable.is_some() {
            out.push(m.statepoint_id.clone());
        } else if let Some(why) = later {
            m.unreachable = Some(why);
            if store.write_manifest(&m).is_ok() {
                out.push(m.statepoint_id.clone());
            }
        }
    }
    out
}

/// What a rollback to `target` did not undo: tools let through unrecorded after it (the remote
/// states just before the rollback say, `before`), one line per remote state.
pub fn not_undone(target: &Manifest, before: &[store::RemoteState]) -> Vec<String> {
    before
        .iter()
        .filter_map(|b| {
            let u = b.uncovered.as_ref()?;
            let at = target.remote_state.iter().find(|t| t.hook_path == b.hook_path)?.mcp_call_position?;
            (u.last >= at).then(|| {
                format!(
                    "{} let through unrecorded (by the service's configuration) after position {at}: what they changed since {} is as it is now",
                    u.tools.join(", "),
                    target.statepoint_id
                )
            })
        })
        .collect()
}

/// The processes statepoint `m` does not hold (outside the container's tree), one line each.
pub fn not_held(m: &Manifest) -> impl Iterator<Item = String> + '_ {
    m.local_state.outside_tree.iter().map(|p| format!("{p}: {}", crate::statepoint::snapshot::OUTSIDE_TREE))
}

/// What a statepoint's remote state does not cover, one line per remote state.
pub fn uncovered(m: &Manifest) -> Vec<String> {
    m.remote_state
        .iter()
        .filter_map(|r| {
            let u = r.uncovered.as_ref()?;
            Some(format!(
                "{} let through unrecorded (by the service's configuration) since position {}: what they changed is as it is now, not as it was at this statepoint",
                u.tools.join(", "),
                u.since
            ))
        })
        .collect()
}

fn seq(id: &str) -> u64 {
    id.trim_start_matches("sp").parse().unwrap_or(0)
}

fn now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

/// Seconds since the epoch of `2006-01-02T15:04:05…Z` (what [`crate::log::rfc3339`] writes).
pub fn parse_rfc3339(t: &str) -> Option<u64> {
    let num = |a: usize, b: usize| t.get(a..b)?.parse::<i64>().ok();
    let (y, mo, d, h, mi, s) = (num(0, 4)?, num(5, 7)?, num(8, 10)?, num(11, 13)?, num(14, 16)?, num(17, 19)?);
    // Days from civil (Howard Hinnant's algorithm), the inverse of log::civil_from_days.
    let y = if mo <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (mo + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    u64::try_from(days * 86_400 + h * 3600 + mi * 60 + s).ok()
}

fn human_age(s: u64) -> String {
    match s {
        s if s < 60 => format!("{s} s"),
        s if s < 3600 => format!("{} min", s / 60),
        s if s < 86_400 => format!("{} h", s / 3600),
        s => format!("{} d", s / 86_400),
    }
}

/// `3.0 MiB`, `2 KiB`.
pub fn human_bytes(b: u64) -> String {
    match b {
        b if b >= 1 << 30 => format!("{:.1} GiB", b as f64 / (1u64 << 30) as f64),
        b if b >= 1 << 20 => format!("{:.1} MiB", b as f64 / (1u64 << 20) as f64),
        b => format!("{:.0} KiB", b as f64 / 1024.0),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::{RemoteState, Status};

    fn m(id: &str, parent: Option<&str>, name: Option<&str>, desc: &str, pos: u64, t: &str) -> Manifest {
        let mut m = crate::store::tests::manifest(id, Status::Committed);
        m.parent_statepoint_id = parent.map(String::from);
        m.name = name.map(String::from);
        m.state_evidence.state_description = desc.into();
        m.timestamp = t.into();
        m.remote_state = vec![RemoteState {
            external_endpoint: None,
            mcp_call_position: Some(pos),
            hook_path: Some("/h".into()),
            ..Default::default()
        }];
        m.measurements.criu_bytes = 3 << 20;
        m
    }

    /// sp1 ─ sp2 ─ sp3 (abandoned by a rollback to sp2) and sp2 ─ sp4 (head).
    fn tree() -> Vec<Manifest> {
        let mut sp3 = m("sp3", Some("sp2"), None, "config rewritten", 5, "2026-11-24T10:30:00.000000000Z");
        sp3.remote_state[0].tables_since_parent = Some(vec!["reports".into()]);
        let mut sp2 =
            m("sp2", Some("sp1"), Some("deps"), "dependencies installed", 3, "2026-11-24T10:00:00.000000000Z");
        sp2.state_evidence.prior_outcomes.push(Outcome::now(
            "rolled back here from sp3: tests failed",
            OutcomeStatus::Abandoned,
            Actor::Harness,
            None,
        ));
        vec![
            m("sp1", None, None, "clean checkout", 0, "2026-11-24T09:00:00.000000000Z"),
            sp2,
            sp3,
            m("sp4", Some("sp2"), Some("fixed"), "", 4, "2026-11-24T10:59:00.000000000Z"),
        ]
    }

    #[test]
    fn the_ledger_is_a_tree_with_evidence_ages_and_remote_calls() {
        let now = parse_rfc3339("2026-11-24T11:00:00Z").unwrap();
        let l = Ledger::from_manifests("agent", tree(), Some("sp4".into()), now);
        let sp2 = &l.statepoints[1];
        assert_eq!(
            (sp2.children.clone(), sp2.remote_calls_since_parent, sp2.age_seconds),
            (vec!["sp3".into(), "sp4".into()], Some(3), Some(3600))
        );
        assert!(l.statepoints[3].head);
        let text = l.text(None);
        assert_eq!(
            text,
            "Statepoints of agent (* = where the sandbox is now; newest first):\n  sp1 (2 h ago, 3.0 MiB)\n  │  clean checkout\n  └─ sp2 \"deps\" (1 h ago, 3.0 MiB, 3 remote calls since its parent)\n     │  dependencies installed\n     │  → abandoned (harness): rolled back here from sp3: tests failed\n     ├─ sp4* \"fixed\" (1 min ago, 3.0 MiB, 1 remote call since its parent)\n     └─ sp3 (30 min ago, 3.0 MiB, 2 remote calls since its parent: reports)\n           config rewritten\n"
        );
        // Bounded: the head and the statepoints with evidence stay, and the text says what went.
        let short = l.text(Some(260));
        assert!(short.len() <= 260 + 120, "{short}");
        assert!(short.contains("sp4*") && short.contains("left out"), "{short}");
    }

    /// After a rollback to sp2 (position 3) compensated: sp3 (5) and sp4 (4) hold undone calls,
    /// sp1 (0) does not; the ledger and a second marking agree, and what a remote state does not
    /// cover is said.
    #[test]
    fn statepoints_whose_calls_a_rollback_undid_are_marked_and_shown() {
        let scratch = tempfile::tempdir().unwrap();
        let dir = scratch.path().join("unreachable");
        let store = ContainerStore::new(&dir, "c");
        let mut list = tree();
        list[3].remote_state[0].uncovered =
            Some(crate::store::Uncovered { since: 4, last: 4, tools: vec!["raw_write".into()] });
        list[1].local_state.outside_tree = vec!["process 9 (sleep 700)".into()];
        for m in &list {
            std::fs::create_dir_all(store.statepoint_dir(&m.statepoint_id)).unwrap();
            store.write_manifest(m).unwrap();
        }
        let mut gone = mark_unreachable(&store, &list[1]);
        gone.sort();
        assert_eq!(gone, vec!["sp3".to_string(), "sp4".to_string()]);
        assert!(store
            .find("sp3")
            .unwrap()
            .unreachable
            .unwrap()
            .contains("after position 3 it holds were undone by the rollback to sp2"));
        assert!(store.find("sp1").unwrap().unreachable.is_none());
        let mut again = mark_unreachable(&store, &list[0]);
        again.sort();
        assert_eq!(again, vec!["sp2".to_string(), "sp3".to_string(), "sp4".to_string()], "marks stay, more are added");
        let l = Ledger::from_manifests(
            "agent",
            store.committed(),
            Some("sp4".into()),
            parse_rfc3339("2026-11-24T11:00:00Z").unwrap(),
        );
        let t = l.text(None);
        assert!(t.lines().any(|x| x.contains("sp3") && x.contains("no longer restorable")), "{t}");
        assert!(
            t.lines()
                .any(|x| x.contains("sp4") && x.contains("remote state NOT covered: raw_write let through unrecorded")),
            "{t}"
        );
        assert!(!t.lines().any(|x| x.contains("sp1 ") && x.contains("no longer")), "{t}");
        assert_eq!(uncovered(&list[3]).len(), 1);
        assert!(uncovered(&list[2]).is_empty());
        // A process outside the container's tree when sp2 was taken: said in the ledger and
        // in what sp2 does not cover.
        assert!(
            t.lines().any(|x| x.contains("sp2 ") && x.contains("processes NOT covered: process 9 (sleep 700)")),
            "{t}"
        );
        let held: Vec<String> = not_held(&list[1]).collect();
        assert_eq!(held, vec![format!("process 9 (sleep 700): {}", crate::statepoint::snapshot::OUTSIDE_TREE)]);
        assert!(uncovered(&list[1]).is_empty(), "remote state only");
        // A rollback to sp2 (position 3) from a state whose last pass was at 4: not undone.
        let before = list[3].remote_state.clone();
        assert!(not_undone(&list[1], &before)[0]
            .contains("raw_write let through unrecorded (by the service's configuration) after position 3"));
        assert!(not_undone(&list[3], &list[0].remote_state).is_empty(), "no pass before the rollback");
    }

    #[test]
    fn rewards_read_as_a_person_writes_them() {
        let o = |r| outcome_line(&Outcome::now("tried", OutcomeStatus::Info, Actor::Harness, Some(r)));
        assert_eq!(o(-7.0 / 11.0), "→ note (harness, reward -0.636): tried");
        assert_eq!(o(1.0), "→ note (harness, reward 1): tried");
        assert_eq!(o(-1.5), "→ note (harness, reward -1.5): tried");
    }

    #[test]
    fn a_rollback_leaves_the_head_back_to_the_targets_line() {
        let t: Vec<store::Summary> =
            (tree().into_iter()).map(|m| serde_json::from_value(serde_json::to_value(m).unwrap()).unwrap()).collect();
        assert_eq!(left_behind(&t, Some("sp3"), "sp2"), ["sp3"]);
        assert_eq!(left_behind(&t, Some("sp3"), "sp4"), ["sp3"], "across branches: back to the common ancestor");
        assert_eq!(left_behind(&t, Some("sp4"), "sp1"), ["sp4", "sp2"]);
        assert!(left_behind(&t, Some("sp2"), "sp2").is_empty());
        assert!(left_behind(&t, None, "sp2").is_empty());
    }

    #[test]
    fn restore_context_says_what_is_now_true() {
        let c = RestoreContext {
            operation: "rollback".into(),
            container: "agent".into(),
            statepoint: Restored {
                id: "sp2".into(),
                name: Some("deps".into()),
                description: "dependencies installed".into(),
                state: None,
                source: None,
            },
            restored: vec!["processes and memory".into(), "files (zfs)".into()],
            compensated: vec![Compensated { endpoint: None, from_position: Some(5), to_position: 3 }],
            discarded_statepoints: vec!["sp3".into()],
            unreachable_statepoints: vec!["sp4".into()],
            uncovered: vec!["raw_write let through unrecorded".into()],
            not_held: vec!["process 9 (sleep 700): it runs outside".into()],
            reason: Some("tests failed".into()),
            prior_outcomes: vec![],
            time: "t".into(),
            how: None,
        };
        let t = c.text();
        assert!(t.starts_with("[planarian] The sandbox agent was rolled back to statepoint sp2 \"deps\"."), "{t}");
        for want in [
            "2 MCP calls undone (back to position 3)",
            "Left behind (still restorable): sp3.",
            "Left behind, no longer restorable (the MCP calls they hold were undone): sp4.",
            "Remote state NOT restored: raw_write let through unrecorded.",
            "Process NOT restored: process 9 (sleep 700): it runs outside.",
            "Reason: tests failed",
            "Nothing was tried",
        ] {
            assert!(t.contains(want), "{want}: {t}");
        }
        assert_eq!(
            parse_rfc3339(&crate::log::rfc3339(UNIX_EPOCH + std::time::Duration::from_secs(1_795_000_000))),
            Some(1_795_000_000)
        );
    }
}
