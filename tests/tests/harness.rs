//! A real, unmodified harness on Planarian: mini-swe-agent (installed from PyPI by tests/run)
//! with its own deterministic model, its environment selected through its own
//! `environment_class` setting as `planarian.contrib.minisweagent.PlanarianEnvironment`. The
//! scripted model sets up a project with a background process, deletes it by mistake, reads the
//! ledger, rolls back, and finishes another way; the final files and process, and the restore
//! context in the agent's own conversation, are checked.

use planarian_system_tests::*;
use std::path::{Path, PathBuf};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

const RUN: &str = r#"
import json, os, subprocess, sys
from minisweagent.agents.default import DefaultAgent
from minisweagent.environments import get_environment
from minisweagent.models.test_models import DeterministicModel, make_output

image = sys.argv[1]
steps = [
    "mkdir -p /work/proj && cd /work/proj && echo 'print(1)' > main.py && echo debug=false > app.conf"
    " && (sh -c 'echo $$ > /tmp/bg.pid; while :; do sleep 1; done' </dev/null >/dev/null 2>&1 &) && echo set up",
    "rm -rf /work/proj && kill $(cat /tmp/bg.pid) && echo removed",
    "planarian-statepoint ledger",
    "planarian-statepoint rollback sp1 I deleted the project by mistake",
    "sed -i s/false/true/ /work/proj/app.conf && cat /work/proj/app.conf",
    "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT; cat /work/proj/app.conf; kill -0 $(cat /tmp/bg.pid) && echo bg-alive",
]
model = DeterministicModel(outputs=[make_output(f"step {i}", [{"command": c}]) for i, c in enumerate(steps)])
env = get_environment({
    "environment_class": "planarian.contrib.minisweagent.PlanarianEnvironment",
    "image": image, "cwd": "/", "interpreter": ["sh", "-c"], "run_args": ["--network", "none"], "timeout": 600, "container_timeout": "7200",
})
agent = DefaultAgent(model, env, system_template="You are a helpful assistant. {{planarian_help}}", instance_template="{{task}}", step_limit=20, cost_limit=100)
try:
    result = agent.run("Set debug=true in /work/proj/app.conf, keeping the project.")
    main = subprocess.run(["podman", "exec", env.container_id, "cat", "/work/proj/main.py"], capture_output=True, text=True).stdout
    print(json.dumps({
        "result": result,
        "messages": [m.get("content") if isinstance(m.get("content"), str) else json.dumps(m.get("content")) for m in agent.messages],
        "main": main,
        "statepoints": env.statepoints,
    }))
finally:
    env.cleanup()
"#;

#[test]
fn mini_swe_agent_rolls_back_its_own_mistake_through_the_unmodified_loop() {
    require_stack!();
    // (fetched by tests/run for each machine's Python)
    let version = cmd("/usr/bin/python3", ["-c", "import sys; print('%d.%d' % sys.version_info[:2])"]).ok().out();
    let pylib = repo().join("target/pylib").join(version);
    if !pylib.join("minisweagent").exists() {
        assert!(
            std::env::var_os("PLANARIAN_REQUIRE_SYSTEM").is_none(),
            "mini-swe-agent missing ({}): tests/run installs it",
            pylib.display()
        );
        eprintln!("SKIPPED: mini-swe-agent missing ({})", pylib.display());
        return;
    }
    let scratch = tempfile::tempdir().unwrap();
    let home = scratch.path().to_path_buf();
    let r = std::process::Command::new("/usr/bin/python3")
        .args(["-c", RUN, BUSYBOX])
        .env("PYTHONPATH", format!("{}:{}", installed_sdk().display(), pylib.display()))
        .current_dir(&home)
        .env("PLANARIAN", planarian_bin())
        .env("MSWEA_SILENT_STARTUP", "1")
        .env("MSWEA_GLOBAL_CONFIG_DIR", &home)
        .env("HOME", &home)
        .output()
        .unwrap();
    let (out, err) = (String::from_utf8_lossy(&r.stdout), String::from_utf8_lossy(&r.stderr));
    assert!(r.status.success(), "the harness failed ({}):\n{out}\n{err}", r.status);
    let last = out.lines().last().unwrap_or_default();
    let v: serde_json::Value = serde_json::from_str(last).unwrap_or_else(|e| panic!("{e}: {out}\n{err}"));
    assert_eq!(v["result"]["exit_status"], "Submitted", "{v}");
    let submission = v["result"]["submission"].as_str().unwrap();
    assert!(submission.contains("debug=true") && submission.contains("bg-alive"), "{submission}");
    assert_eq!(v["main"].as_str().unwrap().trim(), "print(1)");
    let messages: Vec<&str> = v["messages"].as_array().unwrap().iter().filter_map(|m| m.as_str()).collect();
    let context = messages
        .iter()
        .find(|m| m.contains("was rolled back to statepoint sp1"))
        .unwrap_or_else(|| panic!("no restore context in the conversation: {messages:#?}"));
    assert!(context.contains("Reason: I deleted the project by mistake"), "{context}");
    let ledger = messages
        .iter()
        .find(|m| m.contains("Statepoints of "))
        .unwrap_or_else(|| panic!("no ledger in the conversation: {messages:#?}"));
    assert!(ledger.contains("sp2*"), "{ledger}");
    eprintln!(
        "--- in mini-swe-agent's conversation, the ledger:\n{ledger}\n--- and after the rollback:\n{context}\n---"
    );
}
