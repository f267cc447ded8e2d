//! The agent's own statepoint tools (`planarian mcp CTR`), driven by the official MCP SDK client
//! against a real sandbox: the model lists its tools, saves a statepoint, changes files and
//! memory, notes what went wrong, rolls back, and reads what is now true.

use planarian_system_tests::sandbox::*;
use planarian_system_tests::*;
use serde_json::{json, Value};
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

/// node and the SDK (tests/run installs the SDK; node is Debian's).
fn node_and_sdk() -> Option<(PathBuf, PathBuf)> {
    let sdk = repo().join("target/npm/node_modules/@modelcontextprotocol/sdk");
    let node = ["/usr/bin/node", "/usr/local/bin/node"].into_iter().map(PathBuf::from).find(|p| p.exists());
    match (node, sdk.exists()) {
        (Some(node), true) => Some((node, sdk)),
        _ => {
            assert!(
                std::env::var_os("PLANARIAN_REQUIRE_SYSTEM").is_none(),
                "node or the MCP SDK missing ({}): tests/run installs them",
                sdk.display()
            );
            eprintln!("SKIPPED: node or the MCP SDK missing ({})", sdk.display());
            None
        }
    }
}

struct Agent {
    child: std::process::Child,
    stdin: std::process::ChildStdin,
    stdout: BufReader<std::process::ChildStdout>,
}

impl Agent {
    fn line(&mut self) -> Value {
        let mut l = String::new();
        assert!(self.stdout.read_line(&mut l).unwrap() > 0, "the SDK client exited");
        serde_json::from_str(&l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}"))
    }

    /// A tool call: (its text, whether it is a tool error).
    fn call(&mut self, name: &str, arguments: Value) -> (String, bool) {
        writeln!(self.stdin, "{}", json!({"name": name, "arguments": arguments})).unwrap();
        self.stdin.flush().unwrap();
        let r = self.line();
        let result = r.get("result").unwrap_or_else(|| panic!("{name}: {r}"));
        (result["content"][0]["text"].as_str().unwrap_or_default().to_string(), result["isError"] == true)
    }
}

#[test]
fn the_agent_saves_rolls_back_and_reads_its_ledger_through_the_official_sdk() {
    require_stack!();
    let Some((node, sdk)) = node_and_sdk() else { return };
    let mut sb = Sandbox::start("agent-tools", 4, &[]);
    let mut child = Command::new(node)
        .arg(repo().join("tests/tests/mcp-client.mjs"))
        .arg(&sdk)
        .arg(planarian_bin())
        .arg(&sb.name)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let (stdin, stdout) = (child.stdin.take().unwrap(), BufReader::new(child.stdout.take().unwrap()));
    let mut agent = Agent { child, stdin, stdout };

    // What the model is offered: the tools, each with its schema and annotations.
    let listed = agent.line();
    assert_eq!(listed["server"]["name"], "planarian");
    let tools = listed["tools"].as_array().unwrap();
    let tool =
        |n: &str| tools.iter().find(|t| t["name"] == n).cloned().unwrap_or_else(|| panic!("no tool {n}: {listed}"));
    assert_eq!(tools.len(), 6, "five statepoint tools (fork allowed) and run: {listed}");
    assert_eq!(tool("statepoint_fork")["inputSchema"]["properties"]["count"]["maximum"], 16);
    assert_eq!(tool("statepoint_ledger")["annotations"]["readOnlyHint"], true);
    assert_eq!(tool("statepoint_rollback")["annotations"]["destructiveHint"], true);
    assert_eq!(tool("statepoint_rollback")["inputSchema"]["required"], json!(["statepoint", "reason"]));

    let (text, err) = agent.call("statepoint_ledger", json!({}));
    assert!(!err && text.contains("(none yet)"), "{text}");

    sb.sh("echo v1 > /tmp/app.conf").ok();
    let before = sb.send("tick");
    let (text, err) =
        agent.call("statepoint_save", json!({"name": "before-change", "description": "app.conf is v1; tests pass"}));
    assert!(!err && text.starts_with("Saving statepoint sp1 \"before-change\""), "{text}");

    // The agent's own shell tool changes the files (under the container's shared lock); the
    // workload changes its memory.
    let (text, err) = agent.call("run", json!({"command": "echo broken > /tmp/app.conf && cat /tmp/app.conf"}));
    assert!(!err && text.contains("broken") && text.ends_with("[exit code 0]"), "{text}");
    let dirtied = sb.send("dirty 0 65536");
    assert_ne!(dirtied.checksum, before.checksum);
    let (text, err) = agent.call(
        "statepoint_note",
        json!({"statepoint": "before-change", "outcome": "rewriting app.conf broke the tests", "status": "failure"}),
    );
    assert!(!err && text.starts_with("Noted on statepoint sp1"), "{text}");

    let (text, err) = agent.call(
        "statepoint_rollback",
        json!({"statepoint": "before-change", "reason": "the new app.conf broke the tests"}),
    );
    assert!(!err, "{text}");
    eprintln!("--- what the model reads after statepoint_rollback:\n{text}---");
    assert!(
        text.starts_with(&format!(
            "[planarian] The sandbox {} was rolled back to statepoint sp1 \"before-change\".",
            sb.name
        )),
        "{text}"
    );
    assert!(text.contains("State at sp1: app.conf is v1; tests pass"), "{text}");
    assert!(text.contains("→ failure (agent): rewriting app.conf broke the tests"), "{text}");
    // What it says is true.
    assert_eq!(sb.sh("cat /tmp/app.conf").out(), "v1");
    sb.seq = sb.read().expect("state after rollback").0;
    let after = sb.send("tick");
    assert_eq!((after.counter, after.checksum.as_str()), (before.counter + 1, before.checksum.as_str()));

    let (text, _) = agent.call("statepoint_ledger", json!({}));
    eprintln!("--- what the model reads from statepoint_ledger:\n{text}---");
    assert!(text.contains("sp1* \"before-change\""), "{text}");
    assert!(
        text.contains(
            "→ abandoned (agent): rolled back here from the state after sp1; reason: the new app.conf broke the tests"
        ),
        "{text}"
    );

    // Two alternatives at once: forks of the statepoint, side by side, each at the statepoint;
    // the sandbox goes on unchanged.
    let stem = name("agent-alt");
    let forks: Vec<String> = (1..=2).map(|k| format!("{stem}-{k}")).collect();
    let _c: Vec<Cleanup> = forks.iter().cloned().map(Cleanup).collect();
    let (text, err) = agent.call("statepoint_fork", json!({"statepoint": "before-change", "name": stem, "count": 2}));
    assert!(
        !err && text
            .starts_with(&format!("2 of 2 forks of statepoint sp1 (before-change) run: {}, {}.", forks[0], forks[1])),
        "{text}"
    );
    for f in &forks {
        let mut fork = Sandbox::attach(f);
        assert_eq!(fork.sh("cat /tmp/app.conf").out(), "v1", "{f}");
        let t = fork.send("tick");
        assert_eq!((t.counter, t.checksum.as_str()), (before.counter + 1, before.checksum.as_str()), "{f}");
    }
    let (text, err) = agent.call("statepoint_fork", json!({"statepoint": "before-change", "name": stem, "count": 17}));
    assert!(err && text.contains("count must be a whole number from 1 to 16"), "{text}");

    // Mistakes are tool errors with one line, and change nothing.
    let (text, err) = agent.call("statepoint_rollback", json!({"statepoint": "sp99", "reason": "x"}));
    assert!(err && text.starts_with("planarian: unknown statepoint sp99"), "{text}");
    assert_eq!(sb.state().counter, after.counter);

    drop(agent.stdin);
    let status = agent.child.wait().unwrap();
    assert!(status.success(), "the SDK client failed: {status}");
}
