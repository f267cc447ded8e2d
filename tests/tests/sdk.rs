//! The Python SDK (`python/planarian`) on the real stack: a harness's few lines — run a sandbox,
//! exec, an asynchronous snapshot the next exec waits for, a rollback whose restore context
//! says what is now true, an outcome, the ledger, a typed error, a fork with one result per
//! fork — checked on the sandbox's real files.

use planarian_system_tests::*;
use std::path::{Path, PathBuf};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

const HARNESS: &str = r#"
import json, sys
from planarian import Sandbox, UnknownStatepoint
name, image = sys.argv[1], sys.argv[2]
sb = Sandbox.run(image, name=name, network="none", command=("sleep", "100000"))
try:
    r = sb.exec("echo v1 > /tmp/app.conf && cat /tmp/app.conf")
    assert r.ok and r.output.strip() == "v1", r
    h = sb.snapshot(name="v1", description="app.conf is v1", state={"step": 1})
    # Issued at once: it waits for the snapshot, so it is not in it.
    assert sb.exec("echo broken > /tmp/app.conf").ok
    m = h.result()
    assert m["status"] == "committed" and m["state-evidence"]["state"] == {"step": 1}, m
    ctx = sb.rollback("v1", reason="the config broke the tests")
    assert ctx.statepoint["id"] == h.id and ctx.reason == "the config broke the tests", ctx
    assert "was rolled back to statepoint %s \"v1\"" % h.id in ctx.text, ctx.text
    assert sb.exec("cat /tmp/app.conf").output.strip() == "v1"
    sb.append_outcome(h.id, "a rewritten config broke the tests", "failure", reward=-1)
    assert sb.ledger()["head"] == h.id
    assert "failure (harness, reward -1): a rewritten config broke the tests" in sb.ledger(text=True)
    try:
        sb.rollback("sp99")
        raise SystemExit("rollback to sp99 did not fail")
    except UnknownStatepoint as e:
        assert str(e).startswith("unknown statepoint sp99"), str(e)
    (fork,) = sb.fork(h.id, names=[name + "-f"])
    assert isinstance(fork, Sandbox), fork
    try:
        assert fork.exec("cat /tmp/app.conf").output.strip() == "v1"
        assert fork.context.operation == "fork" and fork.context.statepoint["id"] == h.id
    finally:
        fork.rm()
    print(json.dumps({"ok": True, "restore-context": ctx.text}))
finally:
    sb.rm()
"#;

#[test]
fn a_harness_gets_statepoints_in_a_few_lines_of_python() {
    require_stack!();
    let n = name("sdk");
    let (_c, _f) = (Cleanup(n.clone()), Cleanup(format!("{n}-f")));
    let r = std::process::Command::new("/usr/bin/python3")
        .args(["-c", HARNESS, &n, BUSYBOX])
        .env("PYTHONPATH", installed_sdk())
        .current_dir(std::env::temp_dir())
        .env("PLANARIAN", planarian_bin())
        .output()
        .unwrap();
    let (out, err) = (String::from_utf8_lossy(&r.stdout), String::from_utf8_lossy(&r.stderr));
    assert!(r.status.success(), "the harness failed ({}):\n{out}\n{err}", r.status);
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap_or_else(|e| panic!("{e}: {out}"));
    assert_eq!(v["ok"], true);
    eprintln!("--- the restore context the harness appends:\n{}---", v["restore-context"].as_str().unwrap_or_default());
}

/// The tree-search example (`examples/mcts.py`) on a task with one best path: it forks each
/// expanded node's statepoint in the background while its simulated model thinks, scores the
/// children in their own sandboxes, backs rewards up into the ancestors' outcomes and prunes
/// the sandboxes off the best path. Checked: the path, the value in the best sandbox's file and
/// its worker process (it runs `--keep`), the rewards in the root's ledger, and that every pruned
/// fork is gone.
#[test]
fn the_tree_search_example_finds_the_known_best_path() {
    require_stack!();
    let n = name("mcts");
    let _all = Cleanups(std::iter::once(n.clone()).chain((1..=12).map(|i| format!("{n}-{i}"))).collect());
    let r = std::process::Command::new("/usr/bin/python3")
        .args([
            repo().join("examples/mcts.py").to_str().unwrap(),
            BUSYBOX,
            "--name",
            &n,
            "--think",
            "1",
            "--json",
            "--keep",
        ])
        .env("PLANARIAN", planarian_bin())
        .output()
        .unwrap();
    let (out, err) = (String::from_utf8_lossy(&r.stdout), String::from_utf8_lossy(&r.stderr));
    assert!(r.status.success(), "the example failed ({}):\n{out}\n{err}", r.status);
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap_or_else(|e| panic!("{e}: {out}\n{err}"));
    assert_eq!(v["path"], serde_json::json!(["+3", "x2", "+3"]), "{v}");
    let best = v["sandbox"].as_str().unwrap();
    assert_eq!(podman("planarian", &["exec", best, "cat", "/work/value"]).ok().out(), "11");
    podman("planarian", &["exec", best, "sh", "-c", "kill -0 $(cat /tmp/worker.pid)"]).ok();
    // Pruned: only the root and the path's sandboxes are left.
    let left =
        podman("planarian", &["ps", "-a", "--filter", &format!("name=^{n}"), "--format", "{{.Names}}"]).ok().out();
    let mut left: Vec<&str> = left.lines().collect();
    left.sort();
    let mut path: Vec<&str> = v["path-sandboxes"].as_array().unwrap().iter().map(|s| s.as_str().unwrap()).collect();
    path.sort();
    assert_eq!(left, path, "{v}");
    // Every sandbox is the root or a fork: the path's are kept, the others removed.
    assert_eq!(v["removed"].as_array().unwrap().len() + path.len(), v["forks"].as_u64().unwrap() as usize + 1, "{v}");
    // Backed up: the root's statepoint carries every child's reward, the goal's among them.
    let ledger: serde_json::Value = serde_json::from_str(&planarian(&["ledger", &n, "--json"]).ok().out()).unwrap();
    let root = v["root-statepoint"].as_str().unwrap();
    let text = ledger.to_string();
    assert!(text.contains("+3 x2 +3 scored 1.00"), "{root}: {text}");
    // Six children were scored (two per expansion), each reward backed up to the root.
    let root_outcomes = ledger["statepoints"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["id"] == root)
        .map(|s| s["outcomes"].to_string())
        .unwrap_or_default();
    assert_eq!(root_outcomes.matches("\"reward\"").count(), 6, "{root}: {text}");
    eprintln!(
        "--- the search: {} forks, {} s thinking, {} s more waiting for the forks, {} s in all; the root's ledger:\n{}---",
        v["forks"], v["think-s"], v["waited-for-forks-s"], v["total-s"], v["root-ledger"].as_str().unwrap_or_default()
    );
}
