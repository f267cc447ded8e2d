//! The user and harness CLI over the registry:
//!
//!   planarian snapshot CTR [--name N] [--description D]     (= podman container checkpoint --leave-running)
//!   planarian statepoint list CTR [--json]
//!   planarian statepoint show CTR SP
//!   planarian statepoint set CTR SP [--name N] [--description D] [--outcome TEXT]
//!   planarian statepoint rm CTR SP

use crate::config::Config;
use crate::rollback::planarian_container;
use crate::store::{ContainerStore, Manifest};
use std::ffi::OsString;

fn strs(args: &[OsString]) -> Vec<String> {
    args.iter().map(|a| a.to_string_lossy().into_owned()).collect()
}

type Split = (Vec<String>, Vec<(String, String)>);

/// Splits `--flag value` options from positional arguments.
fn split(args: &[String], flags: &[&str], switches: &[&str]) -> Result<Split, String> {
    let (mut pos, mut opts) = (Vec::new(), Vec::new());
    let mut i = 0;
    while i < args.len() {
        let a = &args[i];
        if let Some((k, v)) = a.split_once('=').filter(|(k, _)| flags.contains(k)) {
            opts.push((k.to_string(), v.to_string()));
        } else if flags.contains(&a.as_str()) {
            let v = args.get(i + 1).ok_or_else(|| format!("{a} needs a value"))?;
            opts.push((a.clone(), v.clone()));
            i += 1;
        } else if switches.contains(&a.as_str()) {
            opts.push((a.clone(), String::new()));
        } else if a.starts_with('-') {
            return Err(format!("unknown option {a}"));
        } else {
            pos.push(a.clone());
        }
        i += 1;
    }
    Ok((pos, opts))
}

fn opt<'a>(opts: &'a [(String, String)], k: &str) -> Option<&'a str> {
    opts.iter().rev().find(|(f, _)| f == k).map(|(_, v)| v.as_str())
}

/// The statepoint store of container `name`. A container with statepoints is one planarian
/// runs, so one found by containers/storage with a store of its own needs no question to Podman.
fn container_store(name: &str) -> Result<ContainerStore, String> {
    let cfg = Config::load().map_err(|e| e.to_string())?;
    if let Some(id) = crate::lookup::storage_id(name) {
        let store = ContainerStore::new(&cfg.store.path, &id);
        if store.dir.is_dir() {
            return Ok(store);
        }
    }
    let pc = planarian_container(name)?;
    Ok(ContainerStore::new(&cfg.store.path, &pc.id))
}

/// The snapshot context of running container `name`: found without Podman when containers/storage,
/// crun and the container's conmon tell (see [`crate::lookup`]), else through `podman inspect`,
/// whose answer also makes the clearer error (not running, not planarian's, no such container).
fn running_container(inv: &crate::cli::Invocation, name: &str) -> Result<crate::snapshot::Ctx, String> {
    if let Some(id) = crate::lookup::storage_id(name) {
        if let Ok(ctx) = crate::snapshot::Ctx::load(inv, &id) {
            if let Ok(pid) = ctx.ctr.running_pid() {
                if crate::lookup::runtime_is_planarian(pid) == Some(true) {
                    return Ok(ctx);
                }
            }
        }
    }
    let pc = planarian_container(name)?;
    if !matches!(pc.status.as_str(), "running" | "paused") {
        return Err(format!("container {name} is not running (it is {})", pc.status));
    }
    crate::snapshot::Ctx::load(inv, &pc.id)
}

pub fn snapshot_main(inv: &crate::cli::Invocation, args: &[OsString]) -> Result<i32, String> {
    let (pos, opts) = split(&strs(args), &["--name", "--description"], &["--tcp-established", "--file-locks"])?;
    let [ctr] = &pos[..] else { return Err("usage: planarian snapshot CONTAINER [--name N] [--description D]".into()) };
    let ctx = running_container(inv, ctr)?;
    let _lock = ctx.store.lock(true)?;
    ctx.recover();
    let m = crate::snapshot::take(
        &ctx,
        &crate::snapshot::SnapshotRequest {
            tcp_established: opt(&opts, "--tcp-established").is_some(),
            file_locks: opt(&opts, "--file-locks").is_some(),
            leave_running: true,
            internal: false,
            name: opt(&opts, "--name").map(String::from),
            description: opt(&opts, "--description").map(String::from),
        },
    )?;
    println!("{}", m.statepoint_id);
    Ok(0)
}

pub fn main(args: &[OsString]) -> Result<i32, String> {
    let args = strs(args);
    let Some((sub, rest)) = args.split_first() else {
        return Err("usage: planarian statepoint list|show|set|rm CONTAINER …".into());
    };
    match sub.as_str() {
        "list" | "ls" => {
            let (pos, opts) = split(rest, &[], &["--json"])?;
            let [ctr] = &pos[..] else { return Err("usage: planarian statepoint list CONTAINER [--json]".into()) };
            let store = container_store(ctr)?;
            let list = store.committed();
            if opt(&opts, "--json").is_some() {
                println!("{}", serde_json::to_string_pretty(&list).map_err(|e| e.to_string())?);
            } else {
                print!("{}", table(&list, store.head().as_deref()));
            }
            Ok(0)
        }
        "show" | "inspect" => {
            let [ctr, sp] = rest else { return Err("usage: planarian statepoint show CONTAINER STATEPOINT".into()) };
            let store = container_store(ctr)?;
            println!("{}", serde_json::to_string_pretty(&store.find(sp)?).map_err(|e| e.to_string())?);
            Ok(0)
        }
        "set" => {
            let (pos, opts) = split(rest, &["--name", "--description", "--outcome"], &[])?;
            let [ctr, sp] = &pos[..] else {
                return Err("usage: planarian statepoint set CONTAINER STATEPOINT [--name N] [--description D] [--outcome TEXT]".into());
            };
            let store = container_store(ctr)?;
            let _lock = store.lock(true)?;
            let mut m = store.find(sp)?;
            if let Some(n) = opt(&opts, "--name") {
                if store.find(n).is_ok_and(|o| o.statepoint_id != m.statepoint_id) {
                    return Err(format!("a statepoint named {n} already exists"));
                }
                m.name = Some(n.to_string()).filter(|n| !n.is_empty());
            }
            if let Some(d) = opt(&opts, "--description") {
                m.state_evidence.state_description = d.to_string();
            }
            for (k, v) in &opts {
                if k == "--outcome" {
                    m.state_evidence.prior_outcomes.push(v.clone());
                }
            }
            store.write_manifest(&m)?;
            Ok(0)
        }
        "rm" => {
            let [ctr, sps @ ..] = rest else { return Err("usage: planarian statepoint rm CONTAINER STATEPOINT…".into()) };
            if sps.is_empty() {
                return Err("usage: planarian statepoint rm CONTAINER STATEPOINT…".into());
            }
            let store = container_store(ctr)?;
            let _lock = store.lock(true)?;
            // Check them all first: a bad name changes nothing.
            let found: Vec<Manifest> = sps.iter().map(|s| store.find(s)).collect::<Result<_, _>>()?;
            for m in found {
                store.remove(&m.statepoint_id)?;
                println!("{}", m.statepoint_id);
            }
            Ok(0)
        }
        other => Err(format!("unknown statepoint command {other} (list, show, set, rm)")),
    }
}

fn table(list: &[Manifest], head: Option<&str>) -> String {
    let mut out = format!("{:<6} {:<18} {:<7} {:<24} {:<6} {:>9} {:>9} {:>9}  {}\n", "ID", "NAME", "PARENT", "CREATED", "DUMP", "MEMORY", "FILES", "TOOK", "DESCRIPTION");
    for m in list {
        let mark = if head == Some(m.statepoint_id.as_str()) { "*" } else { "" };
        out.push_str(&format!(
            "{:<6} {:<18} {:<7} {:<24} {:<6} {:>9} {:>9} {:>9}  {}\n",
            format!("{}{mark}", m.statepoint_id),
            m.name.as_deref().unwrap_or("-"),
            m.parent_statepoint_id.as_deref().unwrap_or("-"),
            &m.timestamp[..m.timestamp.len().min(19)],
            // Full dump, or incremental at depth N of its chain.
            if m.chain.prev_images_dir.is_some() { format!("inc{}", m.chain.depth) } else { "full".into() },
            human(m.measurements.criu_bytes),
            human(m.measurements.rootfs_bytes),
            format!("{:.0}ms", m.measurements.total_ms),
            m.state_evidence.state_description
        ));
    }
    out
}

fn human(b: u64) -> String {
    match b {
        b if b >= 1 << 30 => format!("{:.1}GiB", b as f64 / (1u64 << 30) as f64),
        b if b >= 1 << 20 => format!("{:.1}MiB", b as f64 / (1u64 << 20) as f64),
        b => format!("{:.0}KiB", b as f64 / 1024.0),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_and_positionals() {
        let a: Vec<String> = ["c", "--name=x", "sp1", "--outcome", "failed: tests", "--outcome", "ok"].iter().map(|s| s.to_string()).collect();
        let (pos, opts) = split(&a, &["--name", "--outcome"], &[]).unwrap();
        assert_eq!(pos, vec!["c", "sp1"]);
        assert_eq!(opt(&opts, "--name"), Some("x"));
        assert_eq!(opts.iter().filter(|(k, _)| k == "--outcome").count(), 2);
        assert!(split(&["--bogus".to_string()], &[], &[]).is_err());
    }

    #[test]
    fn human_sizes() {
        assert_eq!(human(3 << 20), "3.0MiB");
        assert_eq!(human(2048), "2KiB");
    }
}
